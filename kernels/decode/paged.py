"""Paged decode attention in Triton: one query token per sequence against a paged KV cache.

Counterparts: vLLM's paged_attention v1 (grid (B, Hq)) and v2 (split-KV + reduce), FlashInfer's
GQA decode (a KV head's query group as one tile).

Modes (the grid depends only on tensor shapes, never on their values, so every mode is
CUDA-graph capturable):
  v1       grid (B, Hq): one query head per program, scores by multiply-reduce.
  gqa      grid (B, Hkv): the group's Hq/Hkv query heads as one tile (padded to ≥ 16 rows for
           ``tl.dot``), so each K/V tile is loaded once per group.
  split_k  grid (B, Hkv, segments): each program covers ``segment_tokens`` of the context and
           writes its (m, l) and its normalized partial O (input dtype) to scratch; a reduce
           kernel (B, Hq) merges them — or (``LaunchConfig.merge_partials``) the last program
           of each (b, KV head) to finish merges its group's heads, counted by an int32 arrival
           counter it resets, so no second launch. Segments past a sequence's length write
           m = -inf, l = 0 and vanish in the merge.
  auto     picks one of the three from the shape (``heuristics.choose_mode``).

Backends: ``backend="triton"`` runs the modes above; ``backend="cuda"`` the hand-written CUDA
kernel of ``paged_cuda.py`` (head dim 128, 16-token blocks, fp16/bf16, groups ≤ 16, sm_80+;
nvcc on first use); ``backend="auto"`` takes the CUDA kernel where it applies, in place of gqa,
and of split_k on ≥ 200 MiB of K/V or B·Hkv ≥ 3/4 of the SMs
(``heuristics.paged_prefers_cuda``). ``plan`` makes the frozen ``PagedPlan`` a call runs.

Tokens are gathered per row through the block table (row t: block ``block_table[b, t //
block_size]``, slot ``t % block_size``), so any block size 8–128 uses the same ``LaunchConfig.tile_n``-token
tiles. fp32 inputs use ``input_precision="ieee"``: TF32 would cost ~4e-4 of accuracy.

The arrival counters are a cached per-device workspace (zero between calls): split_k calls that
merge in-kernel must not run concurrently on two streams of one device.
"""
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ws_lab.check import (SUPPORTED, Support, overlaps, refuse_expanded, refuse_grad,
                          refuse_in_capture, refuse_overlapping_out, require_device,
                          require_tensors, validate_scale)
from ws_lab.kernels import LOG2E
from ws_lab.kernels.decode import heuristics, paged_cuda
from ws_lab.kernels.decode.heuristics import DEFAULTS, LaunchConfig
from ws_lab.kernels.decode.triton_common import (MIN_DOT_ROWS, arrival_counters, has_pdl,
                                                 in_pool, merge_chunk, merge_heads, poison_if_any,
                                                 sm_count, store_partials)

BACKENDS = ("auto", "triton", "cuda")
MODES = ("v1", "gqa", "split_k")  # the Triton kernels' modes
ALL_MODES = MODES + ("auto",)
AUTO_CHOICES = MODES + ("cuda",)  # what a plan can run: a Triton mode, or the CUDA kernel
HEAD_DIMS = (64, 80, 96, 128, 256)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

TILE_BYTES = 32 * 1024  # one K (or V) tile; keeps num_stages × (K + V) tiles within shared memory
INT32_MAX = 2**31 - 1


def tile_for(config: LaunchConfig, head_dim_pad: int, elem_bytes: int) -> int:
    """config.tile_n, capped so a tile of head_dim_pad-wide rows stays within TILE_BYTES."""
    return max(MIN_DOT_ROWS, min(config.tile_n, TILE_BYTES // (head_dim_pad * elem_bytes)))


@triton.jit
def _context_len(ContextLens, b, max_tokens):
    """Sequence b's length, clamped to [0, the block table's capacity]: no length makes a
    program read past its row of the table."""
    return tl.minimum(tl.maximum(tl.load(ContextLens + b), 0), max_tokens)


@triton.jit
def _token_slots(block_table_row, tokens, n_ctx, num_blocks, BLOCK_SIZE: tl.constexpr,
                 WIDE: tl.constexpr):
    """(physical block, slot, valid, loaded) of each token: tokens >= n_ctx are not valid, and
    only valid tokens whose block id lies in the pool are loaded (``in_pool``; ``poison_if_any``
    makes the rest's row NaN). WIDE: element offsets into the cache need 64 bits (else 32-bit
    offset tiles: half the registers of 64-bit ones)."""
    valid = tokens < n_ctx
    block = tl.load(block_table_row + tokens // BLOCK_SIZE, mask=valid, other=0)
    loaded = valid & in_pool(block, num_blocks)
    if WIDE:
        block = block.to(tl.int64)
    return block, tokens % BLOCK_SIZE, valid, loaded


@triton.jit
def _decode_v1_kernel(Q, K, V, BlockTable, ContextLens, Out, scale_log2,
                      max_tokens, num_blocks, stride_qb, stride_qh, stride_kb, stride_ks, stride_kh,
                      stride_vb, stride_vs, stride_vh, stride_bt, stride_ob, stride_oh,
                      GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, WIDE: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    n_ctx = _context_len(ContextLens, b, max_tokens)
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    # q and out may have batch strides near 2^31: their offsets alone are 64-bit (an int64 b
    # made all of split_k's address math 64-bit: +35 registers; notes/triton.md, "Session 34")
    q_at, out_at = Q + b.to(tl.int64) * stride_qb, Out + b.to(tl.int64) * stride_ob
    q = tl.load(q_at + h * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
    m = tl.full([1], float("-inf"), tl.float32)
    l = tl.zeros([1], tl.float32)
    acc = tl.zeros([D_PAD], tl.float32)
    unloaded = tl.zeros([TILE], tl.int1)
    for start in range(0, n_ctx, TILE):
        tokens = start + tl.arange(0, TILE)
        block, slot, valid, loaded = _token_slots(BlockTable + b * stride_bt, tokens, n_ctx,
                                                  num_blocks, BLOCK_SIZE, WIDE)
        rows_k = block * stride_kb + slot * stride_ks
        rows_v = block * stride_vb + slot * stride_vs
        mask = loaded[:, None] & d_ok[None, :]
        k = tl.load(K + rows_k[:, None] + kvh * stride_kh + d[None, :], mask=mask, other=0.0)
        s = tl.sum(k.to(tl.float32) * q[None, :], axis=1) * scale_log2
        unloaded = unloaded | (valid & ~loaded)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        p = tl.exp2(s - m_new)
        alpha = tl.exp2(m - m_new)
        v = tl.load(V + rows_v[:, None] + kvh * stride_vh + d[None, :], mask=mask, other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        l = l * alpha + tl.sum(p, axis=0)
        m = m_new
    l = poison_if_any(l, unloaded)
    # an empty context (l = 0) attends to nothing: zeros; a NaN l (non-finite input) stays NaN
    out = tl.where(l != 0, acc / l, 0.0)
    tl.store(out_at + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d_ok)


@triton.jit
def _decode_gqa_kernel(Q, K, V, BlockTable, ContextLens, Out, MScratch, LScratch, AccScratch,
                       Arrivals, scale_log2, segment_tokens, max_tokens, num_blocks,
                       stride_qb, stride_qh, stride_kb, stride_ks, stride_kh,
                       stride_vb, stride_vs, stride_vh, stride_bt, stride_ob, stride_oh,
                       GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                       D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                       WIDE: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
                       MERGE_IN_KERNEL: tl.constexpr, SEG_PAD: tl.constexpr,
                       MERGE_HEADS: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()  # launched early (programmatic dependent launch): the inputs' writer first
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    seg = tl.program_id(2)
    n_ctx = _context_len(ContextLens, b, max_tokens)
    lo = seg * segment_tokens
    hi = tl.minimum(lo + segment_tokens, n_ctx)
    g = tl.arange(0, G_PAD)
    g_ok = g < GROUP
    heads = kvh * GROUP + g
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    q_at = Q + b.to(tl.int64) * stride_qb  # 64-bit, as in the v1 kernel
    q = tl.load(q_at + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    unloaded = tl.zeros([TILE], tl.int1)
    for start in range(lo, hi, TILE):
        tokens = start + tl.arange(0, TILE)
        block, slot, valid, loaded = _token_slots(BlockTable + b * stride_bt, tokens, hi,
                                                  num_blocks, BLOCK_SIZE, WIDE)
        rows_k = block * stride_kb + slot * stride_ks
        rows_v = block * stride_vb + slot * stride_vs
        mask = loaded[:, None] & d_ok[None, :]
        k = tl.load(K + rows_k[:, None] + kvh * stride_kh + d[None, :], mask=mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        unloaded = unloaded | (valid & ~loaded)
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        v = tl.load(V + rows_v[:, None] + kvh * stride_vh + d[None, :], mask=mask, other=0.0)
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new
    l = poison_if_any(l, unloaded)
    if PDL:
        # The next grid may launch now: it waits for this one to finish before it reads. Not
        # at the top: there, measured, the early grid took 12 % off the two-wave gqa rows.
        gdc_launch_dependents()
    if SPLIT:
        kv_heads = tl.num_programs(1)
        store_partials(MScratch, LScratch, AccScratch, Out, Arrivals + b * kv_heads + kvh, m, l,
                        acc, b, kvh, seg, heads, g_ok, d, tl.num_programs(2), kv_heads * GROUP,
                        stride_ob, stride_oh, GROUP, D, D_PAD, SEG_PAD, MERGE_HEADS,
                        MERGE_IN_KERNEL)
    else:
        out = tl.where(l[:, None] != 0, acc / l[:, None], 0.0)  # empty context: zeros
        tl.store(Out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _split_reduce_kernel(MScratch, LScratch, AccScratch, Out, n_seg, stride_ob, stride_oh,
                         D: tl.constexpr, D_PAD: tl.constexpr, SEG_PAD: tl.constexpr,
                         PDL: tl.constexpr):
    if PDL:
        gdc_wait()  # launched while the split programs drain: their partials first
    merge_heads(MScratch, LScratch, AccScratch, Out, tl.program_id(0), tl.program_id(1), 1,
                 tl.num_programs(1), n_seg, stride_ob, stride_oh, D, D_PAD, SEG_PAD, 1)


def _validate(q, k_cache, v_cache, block_table, context_lens, backend, mode, softmax_scale, out,
              config):
    """Refuses bad input before any launch (TypeError / ValueError naming the problem); returns
    the softmax scale."""
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                   context_lens=context_lens)
    require_tensors(**tensors)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if mode not in ALL_MODES:
        raise ValueError(f"mode must be one of {ALL_MODES} (the Triton modes; the CUDA kernel is "
                         f"backend='cuda'), got {mode!r}")
    if backend == "cuda" and (mode != "auto" or config is not None):
        raise ValueError("mode and config choose among the Triton kernels; backend='cuda' plans "
                         "its own launch")
    if q.dtype not in DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; supported: {DTYPES}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"q, k_cache, v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, "
                        f"{v_cache.dtype}")
    for name in ("block_table", "context_lens"):
        if tensors[name].dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {tensors[name].dtype}")
    if q.dim() != 3 or k_cache.dim() != 4 or block_table.dim() != 2 or context_lens.dim() != 1:
        raise ValueError("expected q (B, Hq, D), k_cache/v_cache (num_blocks, block_size, Hkv, D), "
                         f"block_table (B, max_blocks), context_lens (B,); got {q.shape}, "
                         f"{k_cache.shape}, {block_table.shape}, {context_lens.shape}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    batch, heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, cache_dim = k_cache.shape
    if block_table.shape[0] != batch or context_lens.shape[0] != batch:
        raise ValueError(f"batch mismatch: q {batch}, block_table {block_table.shape[0]}, "
                         f"context_lens {context_lens.shape[0]}")
    for count, what in ((heads, "q has 0 query heads"), (kv_heads, "k_cache has 0 KV heads"),
                        (num_blocks, "k_cache holds 0 blocks"),
                        (block_table.shape[1], "block_table has 0 columns (no room for a token)")):
        if count == 0:
            raise ValueError(what)
    if cache_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {cache_dim}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"unsupported head dim {head_dim}; supported: {HEAD_DIMS}")
    if heads % kv_heads:
        raise ValueError(f"Hq={heads} is not a multiple of Hkv={kv_heads}")
    if block_size < 8 or block_size > 128 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two in 8..128, got {block_size}")
    for name, t in tensors.items():
        if t.stride(-1) != 1 or (name != "q" and not t.is_contiguous()):
            raise ValueError(f"{name} must be contiguous (last dim stride 1), got strides "
                             f"{t.stride()}")
    if out is not None:
        _validate_out(out, q, tensors)
    devices = {t.device for t in tensors.values()} | ({out.device} if out is not None else set())
    if len(devices) != 1:
        raise ValueError(f"inputs are on different devices: {sorted(map(str, devices))}")
    if overlaps(k_cache, v_cache):
        raise ValueError("k_cache and v_cache overlap in memory; give two separate caches")
    refuse_grad("paged_attention", q=q, k_cache=k_cache, v_cache=v_cache)
    scale = validate_scale(softmax_scale, head_dim)
    try:
        require_device(q.device, "triton", q.dtype)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"paged_attention: {exc}") from None
    return scale


def _validate_out(out, q, inputs):
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must be a {q.dtype} tensor of q's shape {tuple(q.shape)}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    if out.stride(-1) != 1:
        raise ValueError(f"out must have stride 1 in the head dim, got strides {out.stride()}")
    refuse_expanded("out", out)
    refuse_overlapping_out(out, **inputs)


def check_index_range(block_table, context_lens, num_blocks, block_size) -> None:
    """The host-side check of ``check_indices=True`` (synchronizes): every length within the
    table's capacity, every block id a sequence uses within the pool."""
    capacity = block_table.shape[1] * block_size
    lens = context_lens.long()
    bad = ((lens < 0) | (lens > capacity)).nonzero()
    if bad.numel():
        b = int(bad[0, 0])
        raise ValueError(f"context_lens[{b}] = {int(lens[b])} is outside [0, {capacity}] (the "
                         f"block table holds {block_table.shape[1]} blocks of {block_size})")
    used = (torch.arange(block_table.shape[1], device=lens.device)[None, :]
            < (lens[:, None] + block_size - 1) // block_size)
    bad = (used & ((block_table < 0) | (block_table >= num_blocks))).nonzero()
    if bad.numel():
        b, col = (int(x) for x in bad[0])
        raise ValueError(f"block_table[{b}, {col}] = {int(block_table[b, col])} is not a block of "
                         f"the pool [0, {num_blocks})")


def split_plan(batch, kv_heads, group, max_tokens, sm_count, cfg: LaunchConfig,
               tile) -> tuple[int, int, bool]:
    """split_k's (segments, tokens per segment, merge in the kernel?): segments of whole tiles,
    and the in-kernel merge where it reads ≤ cfg.merge_partials partial rows."""
    n_seg = heuristics.segments_for(batch, kv_heads, group, max_tokens, sm_count, cfg, tile)
    segment_tokens = math.ceil(max_tokens / n_seg / tile) * tile
    n_seg = math.ceil(max_tokens / segment_tokens)
    return n_seg, segment_tokens, group * n_seg <= cfg.merge_partials


@dataclass(frozen=True)
class PagedPlan:
    """What one call runs, from shapes alone (so it holds under CUDA-graph replay): the backend,
    the kernel (``kernel``: a Triton mode, or "cuda"), its launch config and the context split.
    ``static_specs`` and the launch read the same plan."""
    backend: str  # "triton" or "cuda"
    kernel: str  # one of AUTO_CHOICES
    config: object  # heuristics.LaunchConfig (Triton) or paged_cuda.CudaConfig
    tile: int = 0  # Triton: tokens a tile
    segments: int = 1
    segment_tokens: int = 0  # Triton split_k: tokens a segment; cuda: blocks a segment
    merge_in_kernel: bool = False  # Triton split_k: the last program merges (no reduce launch)


def plan(batch, heads, kv_heads, head_dim, block_size, max_blocks, elem_bytes, sm_count, *,
         backend="auto", mode="auto", config: LaunchConfig | None = None,
         cuda: Support = SUPPORTED) -> PagedPlan:
    """The call's plan from its shapes. ``cuda``: whether the CUDA kernel runs these inputs
    (``paged_cuda.supports``); ``backend="auto"`` takes it where ``heuristics`` prefers it, a
    Triton ``mode`` or ``config`` keeps to the Triton kernels."""
    group = heads // kv_heads
    max_tokens = max_blocks * block_size
    if backend == "cuda":
        cuda.require("paged_attention(backend='cuda')")
        return _cuda_plan(batch, kv_heads, max_blocks, sm_count)
    if mode == "auto":
        mode = heuristics.choose_mode(batch, heads, kv_heads, max_tokens, sm_count)
        kv_bytes = 2 * batch * kv_heads * max_tokens * head_dim * elem_bytes
        if (backend == "auto" and config is None and cuda
                and heuristics.paged_prefers_cuda(mode, kv_bytes, batch * kv_heads, sm_count)):
            return _cuda_plan(batch, kv_heads, max_blocks, sm_count)
    d_pad = triton.next_power_of_2(head_dim)
    config = config or heuristics.launch_config(mode, batch, kv_heads, sm_count, group,
                                                d_pad * elem_bytes)
    tile = tile_for(config, d_pad, elem_bytes)
    if mode != "split_k":
        return PagedPlan("triton", mode, config, tile)
    n_seg, segment_tokens, in_kernel = split_plan(batch, kv_heads, group, max_tokens, sm_count,
                                                  config, tile)
    return PagedPlan("triton", mode, config, tile, n_seg, segment_tokens, in_kernel)


def _cuda_plan(batch, kv_heads, max_blocks, sm_count) -> PagedPlan:
    cfg, n_seg, per_seg = paged_cuda.plan(batch, kv_heads, max_blocks, sm_count)
    return PagedPlan("cuda", "cuda", cfg, segments=n_seg, segment_tokens=per_seg)


def plan_for(q, k_cache, block_table, *, backend="auto", mode="auto", config=None, v_cache=None):
    """``plan`` for validated tensors on their device (``v_cache``: ask the CUDA kernel whether
    it runs them; without it the plan keeps to the Triton kernels unless backend="cuda")."""
    _, block_size, kv_heads, head_dim = k_cache.shape
    asks_cuda = backend == "cuda" or (backend == "auto" and mode == "auto" and config is None)
    cuda = (paged_cuda.supports(q, k_cache, v_cache) if asks_cuda and v_cache is not None
            else Support("not asked"))
    return plan(q.shape[0], q.shape[1], kv_heads, head_dim, block_size, block_table.shape[1],
                q.element_size(), sm_count(q.device), backend=backend, mode=mode, config=config,
                cuda=cuda)


def paged_attention(q, k_cache, v_cache, block_table, context_lens, *, backend="auto",
                    mode="auto", softmax_scale=None, out=None,
                    config: LaunchConfig | None = None, check_indices: bool = False):
    """Decode attention: q (B, Hq, D) against the paged cache -> (B, Hq, D) in q's dtype.

    k_cache / v_cache (num_blocks, block_size, Hkv, D); block_table (B, max_blocks) int32;
    context_lens (B,) int32. ``backend``: "triton", "cuda" (``paged_cuda.py``: D 128, 16-token
    blocks, fp16/bf16, groups ≤ 16, sm_80+) or "auto" (the CUDA kernel where it applies and
    ``heuristics`` prefers it). ``mode``: the Triton kernel (v1 / gqa / split_k, or "auto":
    ``heuristics.choose_mode``). ``config`` overrides the Triton mode's launch config (tuning).
    Shapes, dtypes, devices, layouts and ``out`` are checked once, before any launch. Values are
    not, unless ``check_indices=True`` (a host check that synchronizes, refusing an id outside
    the pool). In the kernels, an id outside [0, num_blocks) among a sequence's first
    ceil(len / block_size) is not read and gives that sequence NaN rows; lengths are clamped to
    [0, max_blocks · block_size], so no length reads past its row of the table; a sequence of
    length 0 gets zeros, and a non-finite q, k or v gives NaN in exactly the rows it reaches.
    B = 0 returns an empty result without a launch."""
    scale = _validate(q, k_cache, v_cache, block_table, context_lens, backend, mode,
                      softmax_scale, out, config)
    num_blocks, block_size = k_cache.shape[:2]
    the_plan = plan_for(q, k_cache, block_table, backend=backend, mode=mode, config=config,
                        v_cache=v_cache)
    if out is None:
        out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    if check_indices:
        refuse_in_capture(q.device, "check_indices=True")
        check_index_range(block_table, context_lens, num_blocks, block_size)
    if the_plan.backend == "cuda":
        return paged_cuda.paged_attention(q, k_cache, v_cache, block_table, context_lens, out,
                                          scale, the_plan.config, the_plan.segments,
                                          the_plan.segment_tokens)
    return _launch_triton(the_plan, q, k_cache, v_cache, block_table, context_lens, out, scale)


def gqa_meta(the_plan: PagedPlan, group, head_dim, block_size, ieee, wide, pdl) -> dict:
    """The gqa kernel's compile-time arguments for a Triton plan (gqa or split_k): what the
    launch and ``static_specs`` both pass."""
    d_pad = triton.next_power_of_2(head_dim)
    split = the_plan.kernel == "split_k"
    seg_pad = triton.next_power_of_2(the_plan.segments)
    return dict(GROUP=group, G_PAD=max(MIN_DOT_ROWS, triton.next_power_of_2(group)), D=head_dim,
                D_PAD=d_pad, BLOCK_SIZE=block_size, TILE=the_plan.tile, WIDE=wide, IEEE=ieee,
                SPLIT=split, MERGE_IN_KERNEL=the_plan.merge_in_kernel,
                SEG_PAD=seg_pad if split else 1,
                MERGE_HEADS=merge_chunk(group, the_plan.config.num_warps, seg_pad, d_pad)
                if split else 1, PDL=pdl)


def _launch_triton(the_plan: PagedPlan, q, k_cache, v_cache, block_table, context_lens, out,
                   scale):
    batch, heads, head_dim = q.shape
    num_blocks, block_size, kv_heads = k_cache.shape[:3]
    group = heads // kv_heads
    max_tokens = block_table.shape[1] * block_size
    config, tile = the_plan.config, the_plan.tile
    d_pad = triton.next_power_of_2(head_dim)
    common = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
              v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
              out.stride(0), out.stride(1))
    wide = k_cache.numel() > INT32_MAX  # an element offset into the cache may pass int32
    pdl = has_pdl(q.device)
    if the_plan.kernel == "v1":
        _decode_v1_kernel[(batch, heads)](q, k_cache, v_cache, block_table, context_lens, out,
                                          scale * LOG2E, max_tokens, num_blocks, *common,
                                          GROUP=group,
                                          D=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size,
                                          TILE=tile, WIDE=wide, num_warps=config.num_warps,
                                          num_stages=config.num_stages)
        return out
    meta = gqa_meta(the_plan, group, head_dim, block_size, q.dtype == torch.float32, wide, pdl)
    launch = dict(num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl)
    if the_plan.kernel == "gqa":
        # SPLIT=False never touches the scratch and counter arguments: named placeholders
        no_scratch, no_counters = out, block_table
        _decode_gqa_kernel[(batch, kv_heads, 1)](
            q, k_cache, v_cache, block_table, context_lens, out, no_scratch, no_scratch,
            no_scratch, no_counters, scale * LOG2E, max_tokens, max_tokens, num_blocks, *common,
            **meta, **launch)
        return out
    n_seg, in_kernel = the_plan.segments, the_plan.merge_in_kernel
    seg_pad = meta["SEG_PAD"]
    m_scratch = torch.empty(batch, heads, n_seg, dtype=torch.float32, device=q.device)
    l_scratch = torch.empty_like(m_scratch)
    acc_scratch = torch.empty(batch, heads, n_seg, d_pad, dtype=q.dtype, device=q.device)
    # without the in-kernel merge the counters are never touched: the table is a placeholder
    arrivals = arrival_counters(q.device, batch * kv_heads) if in_kernel else block_table
    _decode_gqa_kernel[(batch, kv_heads, n_seg)](
        q, k_cache, v_cache, block_table, context_lens, out, m_scratch, l_scratch, acc_scratch,
        arrivals, scale * LOG2E, the_plan.segment_tokens, max_tokens, num_blocks, *common,
        **meta, **launch)
    if not in_kernel:
        _split_reduce_kernel[(batch, heads)](m_scratch, l_scratch, acc_scratch, out, n_seg,
                                             out.stride(0), out.stride(1), D=head_dim,
                                             D_PAD=d_pad, SEG_PAD=seg_pad, PDL=pdl,
                                             num_warps=heuristics.reduce_warps(seg_pad, d_pad),
                                             launch_pdl=pdl)
    return out


STATIC_SEG_PAD = 16  # the static report's split: 16 segments


def static_specs(heads, kv_heads, head_dim, block_size, dtype="float16"):
    """sm_90 specializations of the gqa and split_k kernels, each with its mode's default launch
    config (``heuristics.DEFAULTS``, split_k's by ``split_k_config``) and STATIC_SEG_PAD
    segments, for the no-GPU static report: the same ``gqa_meta`` the launch passes."""
    from ws_lab.triton_static import StaticSpec

    elem = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}[dtype]
    elem_bytes = 4 if dtype == "float32" else 2
    d_pad = triton.next_power_of_2(head_dim)
    group = heads // kv_heads
    types = {n: "i32" for n in _decode_gqa_kernel.arg_names}
    types.update(Q=elem, K=elem, V=elem, Out=elem, BlockTable="*i32", ContextLens="*i32",
                 MScratch="*fp32", LScratch="*fp32", AccScratch=elem, Arrivals="*i32",
                 scale_log2="fp32")
    specs = []
    for mode in ("gqa", "split_k"):
        config = (heuristics.split_k_config(group, d_pad * elem_bytes) if mode == "split_k"
                  else DEFAULTS[mode])
        segments = STATIC_SEG_PAD if mode == "split_k" else 1
        the_plan = PagedPlan("triton", mode, config, tile_for(config, d_pad, elem_bytes),
                             segments, 0, group * segments <= config.merge_partials)
        meta = gqa_meta(the_plan, group, head_dim, block_size, dtype == "float32", False, True)
        specs.append(StaticSpec(f"decode_{mode}", _decode_gqa_kernel, types, meta,
                                dict(num_warps=config.num_warps, num_stages=config.num_stages)))
    return specs
