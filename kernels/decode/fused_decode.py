"""Fused decode attention in Triton: RoPE on q and the new k, the KV-cache write, and attention
over [0, position] in one launch, with each sequence's position read from device memory.

Counterparts: vLLM's fused RoPE + reshape_and_cache + paged attention (three kernels there),
FlashInfer's decode with ``pos_encoding_mode="ROPE_LLAMA"`` (RoPE applied on the fly), and the
flash-decoding split of FA2/FA3 (context segments merged by their log-sum-exp).

Layouts:
  static  caches (B, Hkv, Lmax, D): Hugging Face's StaticCache.
  paged   caches (num_blocks, block_size, Hkv, D) + block_table (B, max_blocks): kernels/decode/paged.py.
cos / sin (L, D), L ≥ the cache's capacity: the rotate-half convention of HF Llama / Qwen2
(``x·cos + rotate_half(x)·sin``, ``rotate_half(x) = cat(−x[D/2:], x[:D/2])``).

Grid (B, Hkv, segments): one program per (sequence, KV head, context segment) serves the KV
head's whole query group, so each K/V tile is read once per group. The segment count comes
from the capacity; the segments themselves split each sequence's current context into runs of
whole tiles as even as the tiles allow (the longest program reads the fewest tiles it can).
Every program rotates q and the new k in registers; the segment-0 program writes the rotated
k and v at ``positions[b]`` (once per KV head) and folds the new token into its softmax state
from registers, while every program reads only cache tokens < position — no program reads a
slot written in the same launch.
With more than one segment each program leaves (m, l, O/l) in scratch and the last to arrive
merges its group (an int32 arrival counter it resets), as kernels/decode/paged.py's in-kernel merge.
The segment count comes from shapes only (no host sync), so the call captures in a CUDA graph
and compiles once under ``torch.compile`` while positions advance. On sm_90 it launches with
programmatic dependent launch (waits for its inputs' writer at the top, lets the next kernel
launch after its main loop), as kernels/decode/paged.py and the decode layer's kernels. Before that
wait, each program of the static layout asks the L2 for its segment's cache rows (a hint; the
context was written by earlier steps): Qwen2.5-0.5B's decode step, B 64, 0.957 → 0.952 ms
(notes/rollout.md, Session 20).

A position outside [0, capacity), or (paged) a block id outside the pool among the row's
tokens, writes nothing and gives that sequence NaN rows: nothing outside a buffer is touched.
``check_positions=True`` refuses an out-of-range position on the host instead (it
synchronizes). Non-finite inputs give NaN in exactly the rows they reach.

Static calls at the rollout's shape (D 64, B·Hkv ≥ 3/4 of the SMs, capacity ≤ 512, sm_90+) run
the hand-written CUDA kernel instead (``fused_decode_cuda.supports`` and ``heuristics.fused_prefers_cuda``; same contract, same
checks):
in Qwen2.5-0.5B's decode step it took the step from 0.894 to 0.876 ms (notes/rollout.md, Session 25), then 0.853
with its prologue's loads ahead of the context's (session 26; notes/rollout.md).
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ws_lab.check import (SUPPORTED, Support, overlaps, refuse_grad, refuse_in_capture,
                          refuse_overlapping_out, require_device, require_tensors,
                          validate_scale)
from ws_lab.kernels import LOG2E
from ws_lab.kernels.decode import fused_decode_cuda, heuristics
from ws_lab.kernels.decode.triton_common import (MIN_DOT_ROWS, arrival_counters,
                                                 bulk_prefetch_l2, has_pdl, merge_chunk,
                                                 in_pool, poison_if_any, sm_count,
                                                 store_partials)

BACKENDS = ("auto", "triton", "cuda")

HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)
TILE = 64  # cache tokens per step: a 16 KB K tile at D 128
NUM_STAGES = 3


@triton.jit
def _rotate(X, d, cos, sin, HALF: tl.constexpr, D: tl.constexpr, mask):
    """RoPE (rotate-half) of rows whose element d lives at ``X + d``: x·cos + rotate_half(x)·sin,
    in fp32."""
    x = tl.load(X + d, mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(X + (d + HALF) % D, mask=mask, other=0.0).to(tl.float32)
    sign = tl.where(d < HALF, -1.0, 1.0)
    return x * cos + sign * partner * sin


@triton.jit
def _position(Positions, b, capacity):
    """(position, in range): sequence b's position clamped to [0, capacity − 1], with ``in
    range`` false where the clamp moved it: such a row writes nothing and comes out NaN, so no
    position reaches past the cache (notes/fused_decode.md, "Session 33")."""
    wanted = tl.load(Positions + b)
    pos = tl.minimum(tl.maximum(wanted, 0), capacity - 1)
    return pos, pos == wanted


@triton.jit
def _segment(pos, seg, n_seg, TILE_N: tl.constexpr):
    """[lo, hi): the cache tokens < pos that segment seg of n_seg reads. The grid is sized for
    the capacity; the segments split the position's context into runs of whole tiles as even
    as the tiles allow, so the longest program reads as few tiles as it can."""
    length = tl.cdiv(tl.cdiv(pos, n_seg), TILE_N) * TILE_N
    lo = seg * length
    return lo, tl.minimum(lo + length, pos)


@triton.jit
def _prefetch_segment(KCache, VCache, Positions, b, kvh, seg, n_seg, n_kv_heads, capacity,
                      D: tl.constexpr, TILE_N: tl.constexpr):
    """Asks the L2 for the program's cache rows of K and V (static layout: two contiguous
    runs) before the wait for q/k/v's writer: the context is most of the kernel's bytes and was
    written by earlier steps, so its DRAM latency overlaps the kernel before. A hint only: the
    position it reads may still be being written by the kernel before (the kernel reads it
    again after the wait), so nothing here reaches the result."""
    lo, hi = _segment(_position(Positions, b, capacity)[0], seg, n_seg, TILE_N)
    if hi > lo:
        run = ((b * n_kv_heads + kvh).to(tl.int64) * capacity + lo) * D
        nbytes = (hi - lo) * D * (KCache.dtype.element_ty.primitive_bitwidth // 8)
        bulk_prefetch_l2(KCache + run, nbytes)
        bulk_prefetch_l2(VCache + run, nbytes)


@triton.jit
def _token_offsets(BlockTable, b, kvh, tokens, valid, n_kv_heads, capacity, num_blocks,
                   stride_bt, PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr, D: tl.constexpr):
    """(element offset of each token's row in the cache (int64), loaded): the valid tokens
    whose paged block id lies in the pool are loaded (``in_pool``; ``poison_if_any`` makes
    the rest's row NaN); a static cache loads every valid token."""
    if PAGED:
        block = tl.load(BlockTable + b * stride_bt + tokens // BLOCK_SIZE, mask=valid, other=0)
        return (((block.to(tl.int64) * BLOCK_SIZE + tokens % BLOCK_SIZE) * n_kv_heads + kvh) * D,
                valid & in_pool(block, num_blocks))
    return ((b * n_kv_heads + kvh).to(tl.int64) * capacity + tokens) * D, valid


@triton.jit
def _fused_decode_kernel(Q, KNew, VNew, KCache, VCache, Cos, Sin, Positions, BlockTable, Out,
                         MScratch, LScratch, AccScratch, Arrivals, scale_log2, capacity,
                         num_blocks, n_q_heads, n_kv_heads, stride_bt, stride_qb,
                         stride_knb, stride_vnb,
                         GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                         TILE_N: tl.constexpr, PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         SPLIT: tl.constexpr, MERGE_HEADS: tl.constexpr, SEG_PAD: tl.constexpr,
                         PDL: tl.constexpr, L2_AHEAD: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    seg = tl.program_id(2)
    HALF: tl.constexpr = D // 2
    n_seg = tl.num_programs(2)
    if L2_AHEAD:
        _prefetch_segment(KCache, VCache, Positions, b, kvh, seg, n_seg, n_kv_heads, capacity,
                          D, TILE_N)
    if PDL:
        gdc_wait()  # launched early (programmatic dependent launch): q/k/v's writer first
    pos, pos_ok = _position(Positions, b, capacity)
    d = tl.arange(0, D)
    cos = tl.load(Cos + pos.to(tl.int64) * D + d).to(tl.float32)
    sin = tl.load(Sin + pos.to(tl.int64) * D + d).to(tl.float32)
    g = tl.arange(0, G_PAD)
    heads = kvh * GROUP + g
    rows = (b * n_q_heads + heads).to(tl.int64) * D  # of the (contiguous) output
    q_ok = (g < GROUP)[:, None]
    q_rows = b.to(tl.int64) * stride_qb + heads * D
    q = _rotate(Q + q_rows[:, None], d[None, :], cos[None, :], sin[None, :], HALF, D, q_ok)
    q = q.to(KCache.dtype.element_ty)
    k_new = _rotate(KNew + b.to(tl.int64) * stride_knb + kvh * D, d, cos, sin, HALF, D,
                    d < D).to(KCache.dtype.element_ty)
    v_new = tl.load(VNew + b.to(tl.int64) * stride_vnb + kvh * D + d)

    lo, hi = _segment(pos, seg, n_seg, TILE_N)  # cache tokens < pos; the new one comes below
    if seg == 0:
        # the new token's slot exists (position in range, paged block in the pool), or
        # nothing is written and the row comes out NaN
        slot, write = _token_offsets(BlockTable, b, kvh, pos, pos_ok, n_kv_heads, capacity,
                                     num_blocks, stride_bt, PAGED, BLOCK_SIZE, D)
        row_ok = d < tl.where(write, D, 0)  # a vector mask (the interpreter's stores need one)
        tl.store(KCache + slot + d, k_new, mask=row_ok)
        tl.store(VCache + slot + d, v_new.to(VCache.dtype.element_ty), mask=row_ok)
        # the new token opens the softmax state: m = its score, l = 1, O = its value
        m = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale_log2
        l = tl.where(write, tl.full([G_PAD], 1.0, tl.float32), float("nan"))
        acc = tl.zeros([G_PAD, D], tl.float32) + v_new.to(tl.float32)[None, :]
    else:
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        # a bad position's row is poisoned by segment 0 (l = NaN); the others read up to the
        # clamped position, inside the cache
        l = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
    unloaded = tl.zeros([TILE_N], tl.int1)
    for start in range(lo, hi, TILE_N):
        tokens = start + tl.arange(0, TILE_N)
        valid = tokens < hi
        offs, loaded = _token_offsets(BlockTable, b, kvh, tokens, valid, n_kv_heads,
                                      capacity, num_blocks, stride_bt, PAGED, BLOCK_SIZE, D)
        k = tl.load(KCache + offs[:, None] + d[None, :], mask=loaded[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        if PAGED:
            unloaded = unloaded | (valid & ~loaded)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        v = tl.load(VCache + offs[:, None] + d[None, :], mask=loaded[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new
    if PAGED:
        l = poison_if_any(l, unloaded)
    if PDL:
        gdc_launch_dependents()  # after the loop, as kernels/decode/paged.py (measured there)
    g_ok = g < GROUP
    if SPLIT:
        store_partials(MScratch, LScratch, AccScratch, Out, Arrivals + b * n_kv_heads + kvh,
                        m, l, acc, b, kvh, seg, heads, g_ok, d, n_seg, n_q_heads,
                        n_q_heads * D, D, GROUP, D, D, SEG_PAD, MERGE_HEADS, True)
    else:
        tl.store(Out + rows[:, None] + d[None, :], (acc / l[:, None]).to(Out.dtype.element_ty),
                 mask=g_ok[:, None])


def _validate(q, k_new, v_new, k_cache, v_cache, cos, sin, positions, block_table, out,
              softmax_scale, backend):
    """Refuses bad input before any launch; returns (capacity, softmax scale)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    named = dict(q=q, k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache, cos=cos,
                 sin=sin, positions=positions)
    if block_table is not None:
        named["block_table"] = block_table
    require_tensors(**named)
    if q.dtype not in DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; supported: {DTYPES}")
    for name in ("k_new", "v_new", "k_cache", "v_cache"):
        if named[name].dtype != q.dtype:
            raise TypeError(f"{name} has dtype {named[name].dtype}, q has {q.dtype}")
    for name in ("cos", "sin"):
        if not named[name].is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {named[name].dtype}")
    for name in ("positions",) + (("block_table",) if block_table is not None else ()):
        if named[name].dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {named[name].dtype}")
    if q.dim() != 3 or k_new.dim() != 3 or v_new.dim() != 3:
        raise ValueError(f"q must be (B, Hq, D) and k_new / v_new (B, Hkv, D); got {tuple(q.shape)}, "
                         f"{tuple(k_new.shape)}, {tuple(v_new.shape)}")
    batch, heads, head_dim = q.shape
    if k_new.shape != v_new.shape or k_new.shape[0] != batch or k_new.shape[2] != head_dim:
        raise ValueError(f"k_new {tuple(k_new.shape)} and v_new {tuple(v_new.shape)} must both be "
                         f"(B={batch}, Hkv, D={head_dim})")
    kv_heads = k_new.shape[1]
    if min(batch, heads, kv_heads) == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k_new {tuple(k_new.shape)}")
    if heads % kv_heads:
        raise ValueError(f"Hq={heads} is not a multiple of Hkv={kv_heads}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"unsupported head dim {head_dim}; supported: {HEAD_DIMS}")
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must "
                         "be equal 4-D caches")
    if block_table is None:
        want = (batch, kv_heads, k_cache.shape[2], head_dim)
        if tuple(k_cache.shape) != want:
            raise ValueError(f"static caches must be (B, Hkv, Lmax, D) = {want[:2] + ('Lmax',) + want[3:]}"
                             f", got {tuple(k_cache.shape)}")
        capacity, block_size = k_cache.shape[2], 0
    else:
        block_size = k_cache.shape[1]
        if k_cache.shape[2:] != (kv_heads, head_dim):
            raise ValueError(f"paged caches must be (num_blocks, block_size, Hkv={kv_heads}, "
                             f"D={head_dim}), got {tuple(k_cache.shape)}")
        if block_size < 8 or block_size > 128 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two in 8..128, got {block_size}")
        if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] == 0:
            raise ValueError(f"block_table must be (B={batch}, max_blocks ≥ 1), got "
                             f"{tuple(block_table.shape)}")
        capacity = block_table.shape[1] * block_size
    if capacity == 0 or k_cache.shape[0] == 0:
        raise ValueError(f"the cache holds no token: {tuple(k_cache.shape)}")
    for name in ("cos", "sin"):
        t = named[name]
        if t.dim() != 2 or t.shape[1] != head_dim:
            raise ValueError(f"{name} must be (L, D={head_dim}), got {tuple(t.shape)}")
        if t.shape[0] < capacity:
            raise ValueError(f"{name} has {t.shape[0]} rows, fewer than the cache's {capacity} "
                             "positions")
    if positions.shape != (batch,):
        raise ValueError(f"positions must be (B={batch},), got {tuple(positions.shape)}")
    for name, t in named.items():
        # q / k_new / v_new may be views with a batch stride (slices of a fused qkv GEMM's
        # output); their heads and dims must be packed
        packed = (t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]) if name in _ROW_VIEWS \
            else t.is_contiguous()
        if not packed:
            need = "packed heads (strides (·, D, 1))" if name in _ROW_VIEWS else "contiguous"
            raise ValueError(f"{name} must be {need}, got strides {t.stride()}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {q.dtype} tensor of q's shape "
                             f"{tuple(q.shape)}, got {out.dtype} {tuple(out.shape)}")
        refuse_overlapping_out(out, **named)
    devices = {t.device for t in named.values()} | ({out.device} if out is not None else set())
    if len(devices) != 1:
        raise ValueError(f"inputs are on different devices: {sorted(map(str, devices))}")
    if overlaps(k_cache, v_cache):
        raise ValueError("k_cache and v_cache overlap in memory; give two separate caches")
    refuse_grad("fused decode", q=q, k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache)
    scale = validate_scale(softmax_scale, head_dim)
    return capacity, scale


_ROW_VIEWS = ("q", "k_new", "v_new")



def _new_out(q):
    """A contiguous (B, Hq, D) output (q itself may be a strided view)."""
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def _check_positions(positions, capacity):
    refuse_in_capture(positions.device, "check_positions=True")
    bad = ((positions < 0) | (positions >= capacity)).nonzero()
    if bad.numel():
        b = int(bad[0, 0])
        raise ValueError(f"positions[{b}] = {int(positions[b])} is outside [0, {capacity})")


def _check_written_blocks(block_table, positions, num_blocks, block_size):
    """``check_indices=True`` of the paged entry (synchronizes): every block a sequence reads or
    writes lies in the pool, and no two sequences write one slot (their new tokens would race)."""
    refuse_in_capture(block_table.device, "check_indices=True")
    pos = positions.long()
    used = (torch.arange(block_table.shape[1], device=pos.device)[None, :]
            <= pos[:, None] // block_size)
    bad = (used & ((block_table < 0) | (block_table >= num_blocks))).nonzero()
    if bad.numel():
        b, col = (int(x) for x in bad[0])
        raise ValueError(f"block_table[{b}, {col}] = {int(block_table[b, col])} is not a block of "
                         f"the pool [0, {num_blocks})")
    rows = torch.arange(pos.shape[0], device=pos.device)
    slots = block_table[rows, pos // block_size].long() * block_size + pos % block_size
    unique, counts = torch.unique(slots, return_counts=True)
    if bool((counts > 1).any()):
        slot = int(unique[counts > 1][0])
        owners = rows[slots == slot].tolist()
        raise ValueError(f"sequences {owners} write the same cache slot (block {slot // block_size}, "
                         f"slot {slot % block_size}): each sequence needs its own blocks")


@dataclass(frozen=True)
class FusedPlan:
    """What one fused call runs, from shapes alone (CUDA-graph and ``torch.compile`` safe): the
    backend, and for Triton the context split and warps. The launch and ``static_specs`` read
    the same plan."""
    backend: str  # "triton" or "cuda"
    segments: int = 1
    segment_tokens: int = 0
    num_warps: int = 0

    @property
    def split(self) -> bool:
        return self.segments > 1


def plan(batch, kv_heads, head_dim, capacity, sm_count, *, backend="auto", paged=False,
         cuda: Support = SUPPORTED) -> FusedPlan:
    """The call's plan. ``cuda``: whether the CUDA kernel runs these inputs
    (``fused_decode_cuda.supports``); ``backend="auto"`` takes it on static caches where
    ``heuristics.fused_prefers_cuda`` holds."""
    if backend == "cuda":
        if paged:
            raise ValueError("fused_paged_decode_attention: the CUDA kernel runs static caches "
                             "only; backend must be 'auto' or 'triton'")
        cuda.require("fused_decode_attention(backend='cuda')")
        return FusedPlan("cuda")
    if (backend == "auto" and not paged and cuda
            and heuristics.fused_prefers_cuda(batch, kv_heads, sm_count)):
        return FusedPlan("cuda")
    n_seg = heuristics.fused_segments(batch, kv_heads, capacity, sm_count, TILE)
    segment_tokens = math.ceil(capacity / n_seg / TILE) * TILE
    return FusedPlan("triton", math.ceil(capacity / segment_tokens), segment_tokens,
                     heuristics.fused_num_warps(head_dim))


def _plan_for(q, k_new, v_new, k_cache, v_cache, cos, sin, out, capacity, block_table, backend):
    """``plan`` for validated tensors on their device."""
    paged = block_table is not None
    cuda = (fused_decode_cuda.supports(q, k_new, v_new, k_cache, v_cache, cos, sin, out)
            if not paged and backend != "triton" else Support("not asked"))
    return plan(q.shape[0], k_new.shape[1], q.shape[2], capacity, sm_count(q.device),
                backend=backend, paged=paged, cuda=cuda)


def _launch(q, k_new, v_new, k_cache, v_cache, cos, sin, positions, block_table, out, capacity,
            scale, backend):
    the_plan = _plan_for(q, k_new, v_new, k_cache, v_cache, cos, sin, out, capacity, block_table,
                         backend)
    if the_plan.backend == "cuda":
        return fused_decode_cuda.launch(q, k_new, v_new, k_cache, v_cache, cos, sin, positions,
                                        out, scale)
    batch, heads, head_dim = q.shape
    kv_heads = k_new.shape[1]
    n_seg = the_plan.segments
    if the_plan.split:
        m_scratch = torch.empty(batch, heads, n_seg, dtype=torch.float32, device=q.device)
        l_scratch = torch.empty_like(m_scratch)
        acc_scratch = torch.empty(batch, heads, n_seg, head_dim, dtype=q.dtype, device=q.device)
        arrivals = arrival_counters(q.device, batch * kv_heads)
    else:  # one segment never touches the scratch or the counters: named placeholders
        no_scratch, no_counters = out, positions
        m_scratch = l_scratch = acc_scratch = no_scratch
        arrivals = no_counters
    paged = block_table is not None
    no_table = positions  # the static layout never reads a block table
    pdl = has_pdl(q.device)
    _fused_decode_kernel[(batch, kv_heads, n_seg)](
        q, k_new, v_new, k_cache, v_cache, cos, sin, positions,
        block_table if paged else no_table, out, m_scratch, l_scratch, acc_scratch, arrivals,
        scale * LOG2E, capacity, k_cache.shape[0], heads, kv_heads,
        block_table.stride(0) if paged else 0, q.stride(0), k_new.stride(0), v_new.stride(0),
        **_meta(the_plan, heads // kv_heads, head_dim, paged,
                k_cache.shape[1] if paged else 1, pdl,
                aligned=k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 16 == 0),
        num_warps=the_plan.num_warps, num_stages=NUM_STAGES, launch_pdl=pdl)
    return out


def _meta(the_plan: FusedPlan, group, head_dim, paged, block_size, pdl, aligned=True) -> dict:
    """The kernel's compile-time arguments for a Triton plan: what the launch and
    ``static_specs`` both pass. ``aligned``: the caches start on 16 bytes, as the L2 bulk
    prefetch of each segment's rows needs (a misaligned view skips the hint)."""
    seg_pad = triton.next_power_of_2(the_plan.segments)
    return dict(GROUP=group, G_PAD=max(MIN_DOT_ROWS, triton.next_power_of_2(group)), D=head_dim,
                TILE_N=TILE, PAGED=paged, BLOCK_SIZE=block_size, SPLIT=the_plan.split,
                MERGE_HEADS=merge_chunk(group, the_plan.num_warps, seg_pad, head_dim),
                SEG_PAD=seg_pad, PDL=pdl, L2_AHEAD=pdl and not paged and aligned)


@torch.library.custom_op("ws_lab::fused_decode", mutates_args=("k_cache", "v_cache"))
def fused_decode(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, positions: torch.Tensor, softmax_scale: Optional[float] = None,
                 backend: str = "auto") -> torch.Tensor:
    """The static-cache call as a custom op: it mutates the caches (the new token's slot) and
    returns a fresh (B, Hq, D); Dynamo keeps it whole and CUDA graphs capture it. Its inputs
    are validated here, once."""
    capacity, scale = _validate(q, k_new, v_new, k_cache, v_cache, cos, sin, positions, None,
                                None, softmax_scale, backend)
    require_device(q.device, "triton", q.dtype)
    return _launch(q, k_new, v_new, k_cache, v_cache, cos, sin, positions, None,
                   _new_out(q), capacity, scale, backend)


@fused_decode.register_fake
def _(q, k_new, v_new, k_cache, v_cache, cos, sin, positions, softmax_scale=None,
      backend="auto"):
    _validate(q, k_new, v_new, k_cache, v_cache, cos, sin, positions, None, None, softmax_scale,
              backend)
    return _new_out(q)


def fused_decode_attention(q, k_new, v_new, k_cache, v_cache, cos, sin, positions, *,
                           backend="auto", softmax_scale=None, out=None, check_positions=False):
    """RoPE(q), RoPE(k_new) → k_cache[b, :, positions[b]], v_new → v_cache[b, :, positions[b]],
    then attention of q over tokens [0, positions[b]] → (B, Hq, D) in q's dtype.

    q (B, Hq, D); k_new / v_new (B, Hkv, D); k_cache / v_cache (B, Hkv, Lmax, D), fp16 or bf16,
    D 64 or 128; cos / sin (L ≥ Lmax, D); positions (B,) int32 on the device, ragged allowed.
    ``backend``: "triton", "cuda" (``fused_decode_cuda.py``: D 64, groups ≤ 16, sm_90+) or
    "auto" (the CUDA kernel where it applies and ``heuristics.fused_prefers_cuda`` holds).
    Without ``out`` the call goes through ``torch.ops.ws_lab.fused_decode``, which validates."""
    if out is None and not check_positions:
        # the op validates; only what its dispatcher would refuse less clearly is checked here
        require_tensors(q=q, k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache,
                         cos=cos, sin=sin, positions=positions)
        return torch.ops.ws_lab.fused_decode(q, k_new, v_new, k_cache, v_cache, cos, sin,
                                             positions, softmax_scale, backend)
    capacity, scale = _validate(q, k_new, v_new, k_cache, v_cache, cos, sin, positions, None,
                                out, softmax_scale, backend)
    require_device(q.device, "triton", q.dtype)
    if check_positions:
        _check_positions(positions, capacity)
    return _launch(q, k_new, v_new, k_cache, v_cache, cos, sin, positions, None,
                   _new_out(q) if out is None else out, capacity, scale, backend)


def fused_paged_decode_attention(q, k_new, v_new, k_cache, v_cache, block_table, cos, sin,
                                 positions, *, backend="auto", softmax_scale=None, out=None,
                                 check_positions=False, check_indices=False):
    """The same fused step over kernels/decode/paged.py's cache layout: k_cache / v_cache
    (num_blocks, block_size, Hkv, D), block_table (B, max_blocks) int32; token positions[b]
    goes to block block_table[b, pos // block_size], slot pos % block_size. The context of
    sequence b is [0, positions[b]]. The Triton kernel runs it (``backend`` "auto" or
    "triton"). ``check_indices=True`` (a host check that synchronizes) refuses block ids outside
    the pool and two sequences writing one slot."""
    capacity, scale = _validate(q, k_new, v_new, k_cache, v_cache, cos, sin, positions,
                                block_table, out, softmax_scale, backend)
    require_device(q.device, "triton", q.dtype)
    if check_positions or check_indices:  # the slots below index the table by position
        _check_positions(positions, capacity)
    if check_indices:
        _check_written_blocks(block_table, positions, k_cache.shape[0], k_cache.shape[1])
    return _launch(q, k_new, v_new, k_cache, v_cache, cos, sin, positions, block_table,
                   _new_out(q) if out is None else out, capacity, scale, backend)


STATIC_SEGMENTS = 4  # the static report's split


def static_specs(heads, kv_heads, head_dim, dtype="float16", paged=False):
    """sm_90 specialization of the fused kernel (a STATIC_SEGMENTS split, in-kernel merge) for
    the static report: the same ``_meta`` the launch passes."""
    from ws_lab.triton_static import StaticSpec

    elem = {"float16": "*fp16", "bfloat16": "*bf16"}[dtype]
    types = {n: "i32" for n in _fused_decode_kernel.arg_names}
    types.update(Q=elem, KNew=elem, VNew=elem, KCache=elem, VCache=elem, Cos=elem, Sin=elem,
                 Positions="*i32", BlockTable="*i32", Out=elem, MScratch="*fp32",
                 LScratch="*fp32", AccScratch=elem, Arrivals="*i32", scale_log2="fp32")
    the_plan = FusedPlan("triton", STATIC_SEGMENTS, TILE, heuristics.fused_num_warps(head_dim))
    meta = _meta(the_plan, heads // kv_heads, head_dim, paged, 16 if paged else 1, True)
    return [StaticSpec(f"fused_decode{'_paged' if paged else ''}", _fused_decode_kernel, types,
                       meta, dict(num_warps=the_plan.num_warps, num_stages=NUM_STAGES))]
