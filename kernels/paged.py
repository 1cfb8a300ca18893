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
  auto     picks one of the three from the shape (``choose_mode``; rule from NOTES.md's sweep).
  cuda     the hand-written CUDA kernel of ``paged_cuda.py`` (head dim 128, 16-token blocks,
           fp16/bf16, groups ≤ 16, sm_80+; nvcc on first use). ``auto`` takes it, where it
           applies, in place of gqa, and of split_k on ≥ 200 MiB of K/V or B·Hkv ≥ 3/4 of the SMs
           (``auto_mode``).

Tokens are gathered per row through the block table (row t: block ``block_table[b, t //
block_size]``, slot ``t % block_size``), so any block size 8–128 uses the same ``LaunchConfig.tile_n``-token
tiles. fp32 inputs use ``input_precision="ieee"``: TF32 would cost ~4e-4 of accuracy.

The arrival counters are a cached per-device workspace (zero between calls): split_k calls that
merge in-kernel must not run concurrently on two streams of one device.
"""
import dataclasses
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ws_lab.check import refuse_overlapping_out, require_device, validate_scale
from ws_lab.kernels import LOG2E
from ws_lab.kernels import paged_cuda

MODES = ("v1", "gqa", "split_k")
AUTO_CHOICES = MODES + ("cuda",)  # what auto picks from; "cuda": paged_cuda.py
ALL_MODES = AUTO_CHOICES + ("auto",)
HEAD_DIMS = (64, 80, 96, 128, 256)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

@dataclass(frozen=True)
class LaunchConfig:
    tile_n: int  # tokens per tile
    num_warps: int
    num_stages: int
    waves: int  # split_k: aim for this many waves of (B, Hkv, segment) programs
    # split_k: cap the segments so the scratch round trip (each query head's partial O, written
    # and read back: group · segments / context of the K/V bytes) stays within 1/scratch_div of
    # the K/V read; 0: no cap.
    scratch_div: int = 0
    # split_k: the last segment program of each (b, KV head) merges its heads (no reduce
    # launch) when group × segments ≤ merge_partials; else the reduce kernel.
    merge_partials: int = 0
    @classmethod
    def parse(cls, text: str) -> "LaunchConfig":
        """'tile_n,num_warps,num_stages,waves[,scratch_div[,merge_partials]]' (the form
        bench/paged.py prints)."""
        return cls(*(int(x) for x in text.split(",")))

    def __str__(self):
        return (f"{self.tile_n},{self.num_warps},{self.num_stages},{self.waves},"
                f"{self.scratch_div},{self.merge_partials}")


# Per mode, from `python bench/paged.py --tune` on the H100 (NOTES.md, paged; split_k re-tuned
# in session 16 on disjoint tables with programmatic dependent launch): split_k takes 3 stages
# and always the reduce kernel (merge_partials 0) — with PDL the reduce launches while the split
# programs drain, and it beat the in-kernel merge on llama3-8b B8 (28.9 vs 31.3 µs) at equal
# speed on llama70b B4 and MQA B16. gqa (B·Hkv ≥ SMs, one program per KV head, streaming at the
# HBM floor) keeps 128-token tiles on 8 warps, 3–7 % faster there than 64 on 4;
# ``launch_config`` deepens its pipeline and halves its warps where the grid is short.
DEFAULTS = {"v1": LaunchConfig(tile_n=128, num_warps=8, num_stages=2, waves=4),
            "gqa": LaunchConfig(tile_n=128, num_warps=8, num_stages=2, waves=4),
            "split_k": LaunchConfig(tile_n=64, num_warps=4, num_stages=3, waves=4, scratch_div=8,
                                    merge_partials=0)}
# gqa on a short grid (B·Hkv ≤ 2·SMs: one or two programs per SM)
GQA_SHORT_GRID = dict(num_warps=4, num_stages=3)


# split_k on a query group of 32 heads (MQA of a 32-head model) with 16-bit rows of ≤ 128
# elements: 32-token tiles, 6 stages (96 KB of K/V buffers a program). Measured 1.037–1.083 ×
# the default on all six group-32 shapes timed (MQA B16 4k 19.1 → 18.2 µs, B1–B64, ctx 512–16k;
# notes/triton.md, Session 31, run 263); 3 or 4 stages at 32 tokens were 9–25 % slower. Other
# groups were not timed with it.
WIDE_GROUP = 32
SPLIT_K_WIDE_GROUP = dict(tile_n=32, num_stages=6)


def split_k_config(group, row_bytes) -> LaunchConfig:
    """split_k's default config for a query group of ``group`` heads and K/V rows of
    ``row_bytes`` (padded head dim × element size)."""
    config = DEFAULTS["split_k"]
    if group == WIDE_GROUP and row_bytes <= 256:
        return dataclasses.replace(config, **SPLIT_K_WIDE_GROUP)
    return config


def launch_config(mode, batch, kv_heads, sm_count, group=1, row_bytes=256) -> LaunchConfig:
    """The mode's default config for this grid. gqa with B·Hkv ≤ 2·SMs takes GQA_SHORT_GRID:
    3 stages measured 1–3 % faster on the B·Hkv 256 rows (NOTES.md, session 5), and on 4 warps
    another 0.3–0.8 % (llama7b-8k 346.6 → 344.7 µs, session 6). Larger gqa grids keep the
    8 warps × 2 stages the sweeps validated (3 stages there were within ±2 % in one sweep: not
    enough to change). split_k: ``split_k_config``."""
    if mode == "split_k":
        return split_k_config(group, row_bytes)
    config = DEFAULTS[mode]
    if mode == "gqa" and batch * kv_heads <= 2 * sm_count:
        return dataclasses.replace(config, **GQA_SHORT_GRID)
    return config


TILE_BYTES = 32 * 1024  # one K (or V) tile; keeps num_stages × (K + V) tiles within shared memory


def tile_for(config: LaunchConfig, head_dim_pad: int, elem_bytes: int) -> int:
    """config.tile_n, capped so a tile of head_dim_pad-wide rows stays within TILE_BYTES."""
    return max(MIN_DOT_ROWS, min(config.tile_n, TILE_BYTES // (head_dim_pad * elem_bytes)))
MIN_DOT_ROWS = 16  # tl.dot needs M >= 16
INT32_MAX = 2**31 - 1


@triton.jit
def _context_len(ContextLens, b, max_tokens):
    """Sequence b's length, clamped to [0, the block table's capacity]: no length makes a
    program read past its row of the table."""
    return tl.minimum(tl.maximum(tl.load(ContextLens + b), 0), max_tokens)


@triton.jit
def _token_slots(block_table_row, tokens, n_ctx, BLOCK_SIZE: tl.constexpr, WIDE: tl.constexpr):
    """(physical block, slot, valid) of each token; tokens >= n_ctx read block 0 and are masked.
    WIDE: element offsets into the cache need 64 bits (else 32-bit offset tiles: half the
    registers of 64-bit ones)."""
    valid = tokens < n_ctx
    block = tl.load(block_table_row + tokens // BLOCK_SIZE, mask=valid, other=0)
    if WIDE:
        block = block.to(tl.int64)
    return block, tokens % BLOCK_SIZE, valid


@triton.jit
def _decode_v1_kernel(Q, K, V, BlockTable, ContextLens, Out, scale_log2,
                      max_tokens, stride_qb, stride_qh, stride_kb, stride_ks, stride_kh,
                      stride_vb, stride_vs, stride_vh, stride_bt, stride_ob, stride_oh,
                      GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, WIDE: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    n_ctx = _context_len(ContextLens, b, max_tokens)
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    q = tl.load(Q + b * stride_qb + h * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
    m = tl.full([1], float("-inf"), tl.float32)
    l = tl.zeros([1], tl.float32)
    acc = tl.zeros([D_PAD], tl.float32)
    for start in range(0, n_ctx, TILE):
        tokens = start + tl.arange(0, TILE)
        block, slot, valid = _token_slots(BlockTable + b * stride_bt, tokens, n_ctx, BLOCK_SIZE,
                                          WIDE)
        rows_k = block * stride_kb + slot * stride_ks
        rows_v = block * stride_vb + slot * stride_vs
        mask = valid[:, None] & d_ok[None, :]
        k = tl.load(K + rows_k[:, None] + kvh * stride_kh + d[None, :], mask=mask, other=0.0)
        s = tl.sum(k.to(tl.float32) * q[None, :], axis=1) * scale_log2
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        p = tl.exp2(s - m_new)
        alpha = tl.exp2(m - m_new)
        v = tl.load(V + rows_v[:, None] + kvh * stride_vh + d[None, :], mask=mask, other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        l = l * alpha + tl.sum(p, axis=0)
        m = m_new
    out = tl.where(l > 0, acc / l, 0.0)  # an empty context attends to nothing: zeros
    tl.store(Out + b * stride_ob + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d_ok)


@triton.jit
def _decode_gqa_kernel(Q, K, V, BlockTable, ContextLens, Out, MScratch, LScratch, AccScratch,
                       Arrivals, scale_log2, segment_tokens, max_tokens,
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
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for start in range(lo, hi, TILE):
        tokens = start + tl.arange(0, TILE)
        block, slot, valid = _token_slots(BlockTable + b * stride_bt, tokens, hi, BLOCK_SIZE,
                                          WIDE)
        rows_k = block * stride_kb + slot * stride_ks
        rows_v = block * stride_vb + slot * stride_vs
        mask = valid[:, None] & d_ok[None, :]
        k = tl.load(K + rows_k[:, None] + kvh * stride_kh + d[None, :], mask=mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
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
    if PDL:
        # The next grid may launch now: it waits for this one to finish before it reads. Not
        # at the top: there, measured, the early grid took 12 % off the two-wave gqa rows.
        gdc_launch_dependents()
    if SPLIT:
        kv_heads = tl.num_programs(1)
        _store_partials(MScratch, LScratch, AccScratch, Out, Arrivals + b * kv_heads + kvh, m, l,
                        acc, b, kvh, seg, heads, g_ok, d, tl.num_programs(2), kv_heads * GROUP,
                        stride_ob, stride_oh, GROUP, D, D_PAD, SEG_PAD, MERGE_HEADS,
                        MERGE_IN_KERNEL)
    else:
        out = tl.where(l[:, None] > 0, acc / l[:, None], 0.0)  # empty context: zeros
        tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _store_partials(MScratch, LScratch, AccScratch, Out, counter, m, l, acc, b, kvh, seg, heads,
                    g_ok, d, n_seg, heads_total, stride_ob, stride_oh, GROUP: tl.constexpr,
                    D: tl.constexpr, D_PAD: tl.constexpr, SEG_PAD: tl.constexpr,
                    MERGE_HEADS: tl.constexpr, MERGE_IN_KERNEL: tl.constexpr):
    """A split program's epilogue: its (m, l) and normalized partial O into scratch (B, Hq,
    segments) — in the input dtype, as vLLM v2 and FlashInfer keep partial outputs: half the
    scratch bytes of fp32; an empty segment (l = 0) stores zeros. With MERGE_IN_KERNEL the
    program that arrives last at ``counter`` (int32, zero between calls) merges the group's
    heads into Out and zeroes the counter again (CUDA-graph replays)."""
    row = (b * heads_total + heads) * n_seg + seg
    tl.store(MScratch + row, m, mask=g_ok)
    tl.store(LScratch + row, l, mask=g_ok)
    part = tl.where(l[:, None] > 0, acc / l[:, None], 0.0)
    tl.store(AccScratch + row[:, None] * D_PAD + d[None, :],
             part.to(AccScratch.dtype.element_ty), mask=g_ok[:, None])
    if MERGE_IN_KERNEL:
        # Every thread's scratch stores precede the (single-thread, release) arrival; the
        # program that arrives last acquires them all and merges the group.
        tl.debug_barrier()
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == n_seg - 1:
            for h0 in range(0, GROUP, MERGE_HEADS):
                _merge_heads(MScratch, LScratch, AccScratch, Out, b, kvh * GROUP + h0,
                             GROUP - h0, heads_total, n_seg, stride_ob, stride_oh, D, D_PAD,
                             SEG_PAD, MERGE_HEADS)
            tl.store(counter, 0)


@triton.jit
def _merge_heads(MScratch, LScratch, AccScratch, Out, b, head0, n_heads, heads_total, n_seg,
                 stride_ob, stride_oh, D: tl.constexpr, D_PAD: tl.constexpr,
                 SEG_PAD: tl.constexpr, HEADS: tl.constexpr):
    """Out[b, head0 : head0 + min(HEADS, n_heads)] from the heads' n_seg partials in scratch
    (B, Hq, segments): each segment weighted by its share of the softmax mass. Loads bypass L1
    (.cg): other SMs wrote the partials."""
    h = tl.arange(0, HEADS)
    h_ok = h < n_heads
    s = tl.arange(0, SEG_PAD)
    ok = h_ok[:, None] & (s < n_seg)[None, :]  # pow2 padding segments read as empty (m = -inf)
    rows = (b * heads_total + head0 + h)[:, None] * n_seg + s[None, :]
    m = tl.load(MScratch + rows, mask=ok, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(LScratch + rows, mask=ok, other=0.0, cache_modifier=".cg")
    d = tl.arange(0, D_PAD)
    part = tl.load(AccScratch + rows[:, :, None] * D_PAD + d[None, None, :], mask=ok[:, :, None],
                   other=0.0, cache_modifier=".cg").to(tl.float32)
    m_all = tl.max(m, axis=1)
    # each segment's share of the softmax mass; an empty segment (l = 0, m = -inf) weighs 0,
    # and a sequence with no tokens at all (every m = -inf) gets zeros, not 0/0
    w = tl.where(l > 0, l * tl.exp2(m - m_all[:, None]), 0.0)
    total = tl.sum(w, axis=1)
    out = tl.where(total[:, None] > 0,
                   tl.sum(part * w[:, :, None], axis=1) / tl.maximum(total, 1e-30)[:, None], 0.0)
    tl.store(Out + b * stride_ob + (head0 + h)[:, None] * stride_oh + d[None, :],
             out.to(Out.dtype.element_ty), mask=h_ok[:, None] & (d < D)[None, :])


@triton.jit
def _split_reduce_kernel(MScratch, LScratch, AccScratch, Out, n_seg, stride_ob, stride_oh,
                         D: tl.constexpr, D_PAD: tl.constexpr, SEG_PAD: tl.constexpr,
                         PDL: tl.constexpr):
    if PDL:
        gdc_wait()  # launched while the split programs drain: their partials first
    _merge_heads(MScratch, LScratch, AccScratch, Out, tl.program_id(0), tl.program_id(1), 1,
                 tl.num_programs(1), n_seg, stride_ob, stride_oh, D, D_PAD, SEG_PAD, 1)


def _validate(q, k_cache, v_cache, block_table, context_lens, mode, softmax_scale, out):
    """Refuses bad input before any launch (TypeError / ValueError naming the problem); returns
    the softmax scale."""
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                   context_lens=context_lens)
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if mode not in ALL_MODES:
        raise ValueError(f"mode must be one of {ALL_MODES}, got {mode!r}")
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
    scale = validate_scale(softmax_scale, head_dim)
    try:
        require_device(q.device, "triton")
    except ValueError as exc:
        raise ValueError(f"paged_attention: {exc}") from None
    return scale


def _validate_out(out, q, inputs):
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must be a {q.dtype} tensor of q's shape {tuple(q.shape)}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    if out.stride(-1) != 1:
        raise ValueError(f"out must have stride 1 in the head dim, got strides {out.stride()}")
    refuse_overlapping_out(out, **inputs)


def _check_indices(block_table, context_lens, num_blocks, block_size) -> None:
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


def _has_pdl(device) -> bool:
    """Programmatic dependent launch (sm_90+, not the interpreter), as FA3 launches its combine
    kernel: each grid launches while the one before it drains, so the launch gap between the
    split and reduce kernels, and between consecutive calls, overlaps work (measured: MQA B16
    20.9 -> 20.1 µs, llama70b B4 18.1 -> 17.6; the large rows unchanged; NOTES.md paged,
    session 16)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _sm_count(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter: plan for an H100


def segments_for(batch, kv_heads, group, max_tokens, sm_count,
                 cfg: LaunchConfig = DEFAULTS["split_k"], tile=None) -> int:
    """Enough (B, Hkv, segment) programs for ``cfg.waves`` waves, each segment at least one tile
    of ``tile`` tokens (default ``cfg.tile_n``), within ``cfg.scratch_div``'s scratch cap."""
    n_seg = min(math.ceil(cfg.waves * sm_count / (batch * kv_heads)),
                math.ceil(max_tokens / (tile or cfg.tile_n)))
    if cfg.scratch_div:
        n_seg = min(n_seg, max_tokens // (cfg.scratch_div * group))
    return max(1, n_seg)


def split_plan(batch, kv_heads, group, max_tokens, sm_count, cfg: LaunchConfig,
               tile) -> tuple[int, int, bool]:
    """split_k's (segments, tokens per segment, merge in the kernel?): segments of whole tiles,
    and the in-kernel merge where it reads ≤ cfg.merge_partials partial rows."""
    n_seg = segments_for(batch, kv_heads, group, max_tokens, sm_count, cfg, tile)
    segment_tokens = math.ceil(max_tokens / n_seg / tile) * tile
    n_seg = math.ceil(max_tokens / segment_tokens)
    return n_seg, segment_tokens, group * n_seg <= cfg.merge_partials


def choose_mode(batch, heads, kv_heads, max_tokens, sm_count) -> str:
    """The ``auto`` rule, from the sweeps of NOTES.md (Triton paged decode, sessions 3 and 5):
    split_k wherever B·Hkv < SMs (one program per KV head leaves SMs idle); gqa from one to two
    programs per SM (B·Hkv 256: 10–12 % ahead) and from 4 per SM on (B·Hkv 1024: 1–9 %, 2048:
    2–12 %); between them split_k (B·Hkv 512: 6–8 % ahead from 4k tokens, its 2 segments per
    KV head as 3 small programs per SM against gqa's one 128 KB program)."""
    programs = batch * kv_heads
    if sm_count <= programs <= 2 * sm_count or programs >= GQA_FROM_PER_SM * sm_count:
        return "gqa"
    return "split_k"


GQA_FROM_PER_SM = 4


# Where choose_mode says split_k, mode="cuda" takes the row instead (where it applies) when its
# K/V reach CUDA_SPLIT_FROM_BYTES or B·Hkv reaches CUDA_SPLIT_FROM_SM_SHARE of the SMs. Measured
# on the 82-shape sweep's split_k rows (notes/triton.md, Session 24, runs 156 and 158): from
# 268 MB up cuda ran at 0.961–1.001 × split_k, and at B·Hkv 128 / 512 at 0.87–0.98 ×; at
# B·Hkv ≤ 64 with 2–134 MB it ran at 0.995–1.63 ×.
CUDA_SPLIT_FROM_BYTES = 200 * 2**20
CUDA_SPLIT_FROM_SM_SHARE = 0.75


def auto_mode(q, k_cache, v_cache, block_table, sm_count, config=None) -> str:
    """``auto``'s pick: ``choose_mode``'s, with mode="cuda" where that kernel applies
    (``paged_cuda.supports``) in place of gqa, and of split_k on big caches or about one KV
    head an SM (see ``CUDA_SPLIT_FROM_BYTES``). On the sweep shapes the rule sends to gqa the
    CUDA kernel ran at 0.960–1.015 × the best Triton mode (notes/triton.md, Session 23); on
    the small split rows split_k's short segments win. A ``config`` is for the Triton modes:
    with one, auto keeps to them."""
    batch, heads, _ = q.shape
    _, block_size, kv_heads, head_dim = k_cache.shape
    max_tokens = block_table.shape[1] * block_size
    mode = choose_mode(batch, heads, kv_heads, max_tokens, sm_count)
    kv_bytes = 2 * batch * kv_heads * max_tokens * head_dim * k_cache.element_size()
    wants_cuda = (mode == "gqa" or kv_bytes >= CUDA_SPLIT_FROM_BYTES
                  or batch * kv_heads >= CUDA_SPLIT_FROM_SM_SHARE * sm_count)
    if wants_cuda and config is None and paged_cuda.supports(q, k_cache, v_cache):
        return "cuda"
    return mode


def paged_attention(q, k_cache, v_cache, block_table, context_lens, *, mode="auto",
                    softmax_scale=None, out=None, config: LaunchConfig | None = None,
                    check_indices: bool = False):
    """Decode attention: q (B, Hq, D) against the paged cache -> (B, Hq, D) in q's dtype.

    k_cache / v_cache (num_blocks, block_size, Hkv, D); block_table (B, max_blocks) int32;
    context_lens (B,) int32. Shapes, dtypes, devices, layouts and ``out`` are checked before
    any launch. Values are not, unless ``check_indices=True`` (a host check that synchronizes):
    the contract is that the first ceil(len / block_size) ids of each row of the table lie in
    [0, num_blocks) — an id outside reads outside the cache. Lengths are clamped in the kernel
    to [0, max_blocks · block_size], so no length reads past its row of the table; a sequence
    of length 0 gets zeros. B = 0 returns an empty result without a launch.
    ``config`` overrides the mode's launch config (``DEFAULTS``) — for tuning."""
    scale = _validate(q, k_cache, v_cache, block_table, context_lens, mode, softmax_scale, out)
    if mode == "cuda":
        if config is not None:
            raise ValueError("config sets the Triton modes' launch; mode='cuda' plans its own")
        paged_cuda.validate(q, k_cache, v_cache)
    batch, heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    if check_indices:
        _check_indices(block_table, context_lens, num_blocks, block_size)
    group = heads // kv_heads
    max_tokens = block_table.shape[1] * block_size
    sm_count = _sm_count(q.device)
    if mode == "auto":
        mode = auto_mode(q, k_cache, v_cache, block_table, sm_count, config)
    if mode == "cuda":
        return paged_cuda.paged_attention(q, k_cache, v_cache, block_table, context_lens, out,
                                          scale)
    d_pad = triton.next_power_of_2(head_dim)
    config = config or launch_config(mode, batch, kv_heads, sm_count, group,
                                     d_pad * q.element_size())
    tile = tile_for(config, d_pad, q.element_size())
    common = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
              v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
              out.stride(0), out.stride(1))
    wide = k_cache.numel() > INT32_MAX  # an element offset into the cache may pass int32
    pdl = _has_pdl(q.device)
    if mode == "v1":
        _decode_v1_kernel[(batch, heads)](q, k_cache, v_cache, block_table, context_lens, out,
                                          scale * LOG2E, max_tokens, *common, GROUP=group, D=head_dim,
                                          D_PAD=d_pad, BLOCK_SIZE=block_size, TILE=tile,
                                          WIDE=wide, num_warps=config.num_warps,
                                          num_stages=config.num_stages)
        return out
    meta = dict(GROUP=group, G_PAD=max(MIN_DOT_ROWS, triton.next_power_of_2(group)), D=head_dim,
                D_PAD=d_pad, BLOCK_SIZE=block_size, TILE=tile, WIDE=wide,
                IEEE=q.dtype == torch.float32, num_warps=config.num_warps,
                num_stages=config.num_stages, PDL=pdl, launch_pdl=pdl)
    if mode == "gqa":
        _decode_gqa_kernel[(batch, kv_heads, 1)](
            q, k_cache, v_cache, block_table, context_lens, out, out, out, out, block_table,
            scale * LOG2E, max_tokens, max_tokens, *common, SPLIT=False, MERGE_IN_KERNEL=False, SEG_PAD=1,
            MERGE_HEADS=1, **meta)
        return out
    n_seg, segment_tokens, in_kernel = split_plan(batch, kv_heads, group, max_tokens, sm_count,
                                                  config, tile)
    seg_pad = triton.next_power_of_2(n_seg)
    m_scratch = torch.empty(batch, heads, n_seg, dtype=torch.float32, device=q.device)
    l_scratch = torch.empty_like(m_scratch)
    acc_scratch = torch.empty(batch, heads, n_seg, d_pad, dtype=q.dtype, device=q.device)
    arrivals = _arrival_counters(q.device, batch * kv_heads) if in_kernel else block_table
    _decode_gqa_kernel[(batch, kv_heads, n_seg)](
        q, k_cache, v_cache, block_table, context_lens, out, m_scratch, l_scratch, acc_scratch,
        arrivals, scale * LOG2E, segment_tokens, max_tokens, *common, SPLIT=True, MERGE_IN_KERNEL=in_kernel,
        SEG_PAD=seg_pad, MERGE_HEADS=merge_chunk(group, config.num_warps, seg_pad, d_pad),
        **meta)
    if not in_kernel:
        _split_reduce_kernel[(batch, heads)](m_scratch, l_scratch, acc_scratch, out, n_seg,
                                             out.stride(0), out.stride(1), D=head_dim,
                                             D_PAD=d_pad, SEG_PAD=seg_pad,
                                             PDL=pdl, num_warps=reduce_warps(seg_pad, d_pad),
                                             launch_pdl=pdl)
    return out


MERGE_ELEMS_PER_THREAD = 64


def merge_chunk(group, num_warps, seg_pad, d_pad) -> int:
    """Heads per step of the in-kernel merge: ~MERGE_ELEMS_PER_THREAD partial elements a thread."""
    return min(triton.next_power_of_2(group),
               max(1, MERGE_ELEMS_PER_THREAD * 32 * num_warps // (seg_pad * d_pad)))


def reduce_warps(seg_pad, d_pad) -> int:
    """Warps of a reduce program (one query head): as few as keep ~MERGE_ELEMS_PER_THREAD
    partial elements a thread — measured, 1 warp instead of 4 takes MQA B16 from 19.8–20.2 to
    17.7 µs and llama70b B4 from 15.6–15.8 to 14.9–15.0 (NOTES.md, session 5)."""
    return min(8, max(1, seg_pad * d_pad // (32 * MERGE_ELEMS_PER_THREAD)))


_ARRIVALS: dict = {}


def _arrival_counters(device, n: int) -> torch.Tensor:
    """≥ n zeroed int32 arrival counters on ``device``, cached: the merging program resets its
    own, so they are zero again after every call. Inside a CUDA-graph capture with no cached
    buffer large enough, a fresh one (its zeroing is captured with the call)."""
    cached = _ARRIVALS.get(device)
    if cached is not None and cached.numel() >= n:
        return cached
    counters = torch.zeros(n, dtype=torch.int32, device=device)
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _ARRIVALS[device] = counters
    return counters


STATIC_SEG_PAD = 16  # the static report's split: 16 segments


def static_specs(heads, kv_heads, head_dim, block_size, dtype="float16"):
    """sm_90 specializations of the gqa and split_k kernels (each with its mode's launch config),
    for the no-GPU static report."""
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
    for mode, split in (("gqa", False), ("split_k", True)):
        config = split_k_config(group, d_pad * elem_bytes) if split else DEFAULTS[mode]
        meta = dict(GROUP=group, G_PAD=max(MIN_DOT_ROWS, triton.next_power_of_2(group)),
                    D=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size, SPLIT=split, WIDE=False,
                    TILE=tile_for(config, d_pad, elem_bytes),
                    IEEE=dtype == "float32",
                    MERGE_IN_KERNEL=split and group * STATIC_SEG_PAD <= config.merge_partials,
                    SEG_PAD=STATIC_SEG_PAD if split else 1,
                    MERGE_HEADS=merge_chunk(group, config.num_warps, STATIC_SEG_PAD, d_pad),
                    PDL=True)
        specs.append(StaticSpec(f"decode_{mode}", _decode_gqa_kernel, types, meta,
                                dict(num_warps=config.num_warps, num_stages=config.num_stages)))
    return specs
