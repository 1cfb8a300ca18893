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
           kernel (B, Hq) merges them. Segments past a sequence's length write m = -inf, l = 0
           and vanish in the reduce.
  auto     picks one of the three from the shape (``choose_mode``; rule from NOTES.md's sweep).

Tokens are gathered per row through the block table (row t: block ``block_table[b, t //
block_size]``, slot ``t % block_size``), so any block size 8–128 uses the same ``LaunchConfig.tile_n``-token
tiles. fp32 inputs use ``input_precision="ieee"``: TF32 would cost ~4e-4 of accuracy.
"""
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import LOG2E

MODES = ("v1", "gqa", "split_k")
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

    @classmethod
    def parse(cls, text: str) -> "LaunchConfig":
        """'tile_n,num_warps,num_stages,waves[,scratch_div]' (the form bench/paged.py prints)."""
        return cls(*(int(x) for x in text.split(",")))

    def __str__(self):
        return f"{self.tile_n},{self.num_warps},{self.num_stages},{self.waves},{self.scratch_div}"


# Per mode, from `python bench/paged.py --tune` on the H100 (NOTES.md, 2026-11-22, session 3):
# split_k's config has the best geometric mean over the four tuned rows (llama7b-8k, llama3-8b B8,
# llama70b B4, MQA B16); gqa (B·Hkv ≥ SMs, one program per KV head, streaming at the HBM floor)
# keeps 128-token tiles on 8 warps, 3–7 % faster there than split_k's 64 on 4.
DEFAULTS = {"v1": LaunchConfig(tile_n=128, num_warps=8, num_stages=2, waves=4),
            "gqa": LaunchConfig(tile_n=128, num_warps=8, num_stages=2, waves=4),
            "split_k": LaunchConfig(tile_n=64, num_warps=4, num_stages=2, waves=4, scratch_div=8)}
TILE_BYTES = 32 * 1024  # one K (or V) tile; keeps num_stages × (K + V) tiles within shared memory


def tile_for(config: LaunchConfig, head_dim_pad: int, elem_bytes: int) -> int:
    """config.tile_n, capped so a tile of head_dim_pad-wide rows stays within TILE_BYTES."""
    return max(MIN_DOT_ROWS, min(config.tile_n, TILE_BYTES // (head_dim_pad * elem_bytes)))
MIN_DOT_ROWS = 16  # tl.dot needs M >= 16


@triton.jit
def _token_slots(block_table_row, tokens, n_ctx, BLOCK_SIZE: tl.constexpr):
    """(physical block, slot, valid) of each token; tokens >= n_ctx read block 0 and are masked."""
    valid = tokens < n_ctx
    block = tl.load(block_table_row + tokens // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return block, tokens % BLOCK_SIZE, valid


@triton.jit
def _decode_v1_kernel(Q, K, V, BlockTable, ContextLens, Out, scale_log2,
                      stride_qb, stride_qh, stride_kb, stride_ks, stride_kh,
                      stride_vb, stride_vs, stride_vh, stride_bt, stride_ob, stride_oh,
                      GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    n_ctx = tl.load(ContextLens + b)
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    q = tl.load(Q + b * stride_qb + h * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
    m = tl.full([1], float("-inf"), tl.float32)
    l = tl.zeros([1], tl.float32)
    acc = tl.zeros([D_PAD], tl.float32)
    for start in range(0, n_ctx, TILE):
        tokens = start + tl.arange(0, TILE)
        block, slot, valid = _token_slots(BlockTable + b * stride_bt, tokens, n_ctx, BLOCK_SIZE)
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
    tl.store(Out + b * stride_ob + h * stride_oh + d, (acc / l).to(Out.dtype.element_ty), mask=d_ok)


@triton.jit
def _decode_gqa_kernel(Q, K, V, BlockTable, ContextLens, Out, MScratch, LScratch, AccScratch,
                       scale_log2, segment_tokens,
                       stride_qb, stride_qh, stride_kb, stride_ks, stride_kh,
                       stride_vb, stride_vs, stride_vh, stride_bt, stride_ob, stride_oh,
                       GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                       D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                       SPLIT: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    seg = tl.program_id(2)
    n_ctx = tl.load(ContextLens + b)
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
        block, slot, valid = _token_slots(BlockTable + b * stride_bt, tokens, hi, BLOCK_SIZE)
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
    if SPLIT:
        n_seg = tl.num_programs(2)
        row = (b * tl.num_programs(1) * GROUP + heads) * n_seg + seg  # scratch (B, Hq, segments)
        tl.store(MScratch + row, m, mask=g_ok)
        tl.store(LScratch + row, l, mask=g_ok)
        # Normalized, in the input dtype (vLLM v2 and FlashInfer keep partial outputs so): half
        # the scratch bytes of fp32; an empty segment (l = 0) stores zeros.
        part = tl.where(l[:, None] > 0, acc / l[:, None], 0.0)
        tl.store(AccScratch + row[:, None] * D_PAD + d[None, :],
                 part.to(AccScratch.dtype.element_ty), mask=g_ok[:, None])
    else:
        out = acc / l[:, None]
        tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _split_reduce_kernel(MScratch, LScratch, AccScratch, Out, n_seg, stride_ob, stride_oh,
                         D: tl.constexpr, D_PAD: tl.constexpr, SEG_PAD: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    row0 = (b * tl.num_programs(1) + h) * n_seg
    s = tl.arange(0, SEG_PAD)
    s_ok = s < n_seg  # pow2 padding segments read as empty (m = -inf)
    m = tl.load(MScratch + row0 + s, mask=s_ok, other=float("-inf"))
    l = tl.load(LScratch + row0 + s, mask=s_ok, other=0.0)
    d = tl.arange(0, D_PAD)
    part = tl.load(AccScratch + (row0 + s)[:, None] * D_PAD + d[None, :], mask=s_ok[:, None],
                   other=0.0).to(tl.float32)
    m_all = tl.max(m, axis=0)
    w = l * tl.exp2(m - m_all)  # each segment's share of the softmax mass; empty ones: 0
    out = tl.sum(part * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(Out + b * stride_ob + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d < D)


def _validate(q, k_cache, v_cache, block_table, context_lens, mode, softmax_scale):
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                   context_lens=context_lens)
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if mode not in MODES + ("auto",):
        raise ValueError(f"mode must be one of {MODES + ('auto',)}, got {mode!r}")
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
    _, block_size, kv_heads, cache_dim = k_cache.shape
    if block_table.shape[0] != batch or context_lens.shape[0] != batch:
        raise ValueError(f"batch mismatch: q {batch}, block_table {block_table.shape[0]}, "
                         f"context_lens {context_lens.shape[0]}")
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
    if len({t.device for t in tensors.values()}) != 1:
        raise ValueError(f"inputs are on different devices: {[str(t.device) for t in tensors.values()]}")
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float))
                                          and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a finite float > 0, got {softmax_scale!r}")


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


def choose_mode(batch, heads, kv_heads, max_tokens, sm_count) -> str:
    """The ``auto`` rule, from the 59-shape sweep (NOTES.md, Triton paged decode, session 3):
    gqa won every shape with B·Hkv ≥ 256, split_k all but one with B·Hkv ≤ 128 — once one
    program per KV head fills the SMs, the split's scratch round trip and second launch buy
    nothing."""
    if batch * kv_heads >= sm_count:
        return "gqa"
    return "split_k"


def paged_attention(q, k_cache, v_cache, block_table, context_lens, *, mode="auto",
                    softmax_scale=None, out=None, config: LaunchConfig | None = None):
    """Decode attention: q (B, Hq, D) against the paged cache -> (B, Hq, D) in q's dtype.
    ``config`` overrides the mode's launch config (``DEFAULTS``) — for tuning."""
    _validate(q, k_cache, v_cache, block_table, context_lens, mode, softmax_scale)
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    max_tokens = block_table.shape[1] * block_size
    sm_count = _sm_count(q.device)
    if mode == "auto":
        mode = choose_mode(batch, heads, kv_heads, max_tokens, sm_count)
    config = config or DEFAULTS[mode]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    if out is None:
        out = torch.empty_like(q)
    d_pad = triton.next_power_of_2(head_dim)
    tile = tile_for(config, d_pad, q.element_size())
    common = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
              v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
              out.stride(0), out.stride(1))
    if mode == "v1":
        _decode_v1_kernel[(batch, heads)](q, k_cache, v_cache, block_table, context_lens, out,
                                          scale * LOG2E, *common, GROUP=group, D=head_dim,
                                          D_PAD=d_pad, BLOCK_SIZE=block_size, TILE=tile,
                                          num_warps=config.num_warps, num_stages=config.num_stages)
        return out
    g_pad = max(MIN_DOT_ROWS, triton.next_power_of_2(group))
    meta = dict(GROUP=group, G_PAD=g_pad, D=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size,
                TILE=tile, IEEE=q.dtype == torch.float32, num_warps=config.num_warps,
                num_stages=config.num_stages)
    if mode == "gqa":
        _decode_gqa_kernel[(batch, kv_heads, 1)](
            q, k_cache, v_cache, block_table, context_lens, out, out, out, out, scale * LOG2E,
            max_tokens, *common, SPLIT=False, **meta)
        return out
    n_seg = segments_for(batch, kv_heads, group, max_tokens, sm_count, config, tile)
    segment_tokens = math.ceil(max_tokens / n_seg / tile) * tile
    n_seg = math.ceil(max_tokens / segment_tokens)
    m_scratch = torch.empty(batch, heads, n_seg, dtype=torch.float32, device=q.device)
    l_scratch = torch.empty_like(m_scratch)
    acc_scratch = torch.empty(batch, heads, n_seg, d_pad, dtype=q.dtype, device=q.device)
    _decode_gqa_kernel[(batch, kv_heads, n_seg)](
        q, k_cache, v_cache, block_table, context_lens, out, m_scratch, l_scratch, acc_scratch,
        scale * LOG2E, segment_tokens, *common, SPLIT=True, **meta)
    _split_reduce_kernel[(batch, heads)](m_scratch, l_scratch, acc_scratch, out, n_seg,
                                         out.stride(0), out.stride(1), D=head_dim, D_PAD=d_pad,
                                         SEG_PAD=triton.next_power_of_2(n_seg))
    return out


def static_specs(heads, kv_heads, head_dim, block_size, dtype="float16"):
    """sm_90 specializations of the gqa and split_k kernels (each with its mode's launch config),
    for the no-GPU static report."""
    from ws_lab.triton_static import StaticSpec

    elem = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}[dtype]
    d_pad = triton.next_power_of_2(head_dim)
    group = heads // kv_heads
    types = {n: "i32" for n in _decode_gqa_kernel.arg_names}
    types.update(Q=elem, K=elem, V=elem, Out=elem, BlockTable="*i32", ContextLens="*i32",
                 MScratch="*fp32", LScratch="*fp32", AccScratch=elem, scale_log2="fp32")
    specs = []
    for mode, split in (("gqa", False), ("split_k", True)):
        config = DEFAULTS[mode]
        meta = dict(GROUP=group, G_PAD=max(MIN_DOT_ROWS, triton.next_power_of_2(group)),
                    D=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size, SPLIT=split,
                    TILE=tile_for(config, d_pad, 4 if dtype == "float32" else 2),
                    IEEE=dtype == "float32")
        specs.append(StaticSpec(f"decode_{mode}", _decode_gqa_kernel, types, meta,
                                dict(num_warps=config.num_warps, num_stages=config.num_stages)))
    return specs
