"""What the Triton decode kernels share (paged, fused decode, the decode step's ops): the
launch facts of a device (programmatic dependent launch, SM count), the split-K epilogue (each
segment's (m, l, O/l) into scratch, merged by the last program to arrive at an int32 counter, or
by a reduce kernel), the cached arrival counters, and the one-thread L2 bulk prefetch."""
import torch
import triton
import triton.language as tl

MIN_DOT_ROWS = 16  # tl.dot needs M >= 16


@triton.jit
def in_pool(block, num_blocks):
    """Whether each block id lies in [0, num_blocks), in one unsigned compare: the kernels load
    only those tokens (a masked load touches nothing); ``poison_if_any`` makes the row NaN."""
    return block.to(tl.uint32, bitcast=True) < tl.cast(num_blocks, tl.uint32)


@triton.jit
def poison_if_any(l, unloaded):
    """l, or NaN where any token of the context was not loaded (``unloaded``: the loop's OR of
    valid & ~loaded): O/l and the split merge carry it to the row. Reduced once after the loop,
    not a select on every tile's scores, which kept the flag alive past the dot and cost
    1–2.5 % (notes/triton.md, "Session 35")."""
    return tl.where(tl.max(unloaded.to(tl.int32), axis=0) > 0, float("nan"), l)


@triton.jit
def store_partials(MScratch, LScratch, AccScratch, Out, counter, m, l, acc, b, kvh, seg, heads,
                    g_ok, d, n_seg, heads_total, stride_ob, stride_oh, GROUP: tl.constexpr,
                    D: tl.constexpr, D_PAD: tl.constexpr, SEG_PAD: tl.constexpr,
                    MERGE_HEADS: tl.constexpr, MERGE_IN_KERNEL: tl.constexpr):
    """A split program's epilogue: its (m, l) and normalized partial O into scratch (B, Hq,
    segments) — in the input dtype, as vLLM v2 and FlashInfer keep partial outputs: half the
    scratch bytes of fp32; an empty segment (l = 0) stores zeros, a NaN l (non-finite input, or
    a block outside the pool) NaN. With MERGE_IN_KERNEL the
    program that arrives last at ``counter`` (int32, zero between calls) merges the group's
    heads into Out and zeroes the counter again (CUDA-graph replays)."""
    row = (b * heads_total + heads) * n_seg + seg
    tl.store(MScratch + row, m, mask=g_ok)
    tl.store(LScratch + row, l, mask=g_ok)
    part = tl.where(l[:, None] != 0, acc / l[:, None], 0.0)
    tl.store(AccScratch + row[:, None] * D_PAD + d[None, :],
             part.to(AccScratch.dtype.element_ty), mask=g_ok[:, None])
    if MERGE_IN_KERNEL:
        # Every thread's scratch stores precede the (single-thread, release) arrival; the
        # program that arrives last acquires them all and merges the group.
        tl.debug_barrier()
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == n_seg - 1:
            for h0 in range(0, GROUP, MERGE_HEADS):
                merge_heads(MScratch, LScratch, AccScratch, Out, b, kvh * GROUP + h0,
                             GROUP - h0, heads_total, n_seg, stride_ob, stride_oh, D, D_PAD,
                             SEG_PAD, MERGE_HEADS)
            tl.store(counter, 0)


@triton.jit
def merge_heads(MScratch, LScratch, AccScratch, Out, b, head0, n_heads, heads_total, n_seg,
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
    # and a sequence with no tokens at all (every l = 0) gets zeros, not 0/0. A NaN l weighs
    # NaN, so the row comes out NaN: nothing here may turn NaN into a number
    w = tl.where(l != 0, l * tl.exp2(m - m_all[:, None]), 0.0)
    total = tl.sum(w, axis=1)
    out = tl.where(total[:, None] != 0,
                   tl.sum(part * w[:, :, None], axis=1) / tl.maximum(total, 1e-30)[:, None], 0.0)
    tl.store(Out + b.to(tl.int64) * stride_ob + (head0 + h)[:, None] * stride_oh + d[None, :],
             out.to(Out.dtype.element_ty), mask=h_ok[:, None] & (d < D)[None, :])


MERGE_ELEMS_PER_THREAD = 64


def merge_chunk(group, num_warps, seg_pad, d_pad) -> int:
    """Heads per step of the in-kernel merge: ~MERGE_ELEMS_PER_THREAD partial elements a thread."""
    return min(triton.next_power_of_2(group),
               max(1, MERGE_ELEMS_PER_THREAD * 32 * num_warps // (seg_pad * d_pad)))


def has_pdl(device) -> bool:
    """Programmatic dependent launch (sm_90+, not the interpreter), as FA3 launches its combine
    kernel: each grid launches while the one before it drains, so the launch gap between the
    split and reduce kernels, and between consecutive calls, overlaps work (measured: MQA B16
    20.9 -> 20.1 µs, llama70b B4 18.1 -> 17.6; the large rows unchanged; notes/triton.md,
    Session 16)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def sm_count(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter: plan for an H100


_ARRIVALS: dict = {}


def cached_arrival_counters() -> list:
    """Every device's cached counters (the tests check that each call leaves them zero)."""
    return list(_ARRIVALS.values())


def arrival_counters(device, n: int) -> torch.Tensor:
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


@triton.jit
def bulk_prefetch_l2(Base, nbytes):
    """One ``cp.async.bulk.prefetch.L2`` of [Base, + nbytes) (a multiple of 16, ≤ 1 MB), from
    the program's first thread."""
    tl.inline_asm_elementwise(
        "{ .reg .u32 t; .reg .pred p; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }", "=r,l,r",
        [Base.to(tl.pointer_type(tl.int8)), nbytes], dtype=tl.int32, is_pure=False, pack=1)
