"""Warp-specialized GQA backward with explicit roles ("bwd-ws"): the roles, rings and barriers
written out, FA3's way, where ``pipelined`` leaves them to TileLang's automatic pass.

FA3 counterpart: ``hopper/mainloop_bwd_sm90_tma_gmma_ws.hpp`` (``load``, ``mma``,
``store_dq``) with ``hopper/flash_bwd_kernel_sm90.h``; TileOPs' ``gqa/bwd_ws.py`` is the
TileLang precedent read for it. Why: ``pipelined``'s loop holds TileLang's two 256-thread
``BAR.SYNC`` around the shared dSᵀ tile, and ncu put 6 × TileOPs' warp-cycles at barriers
there (notes/bwd.md, "Session 49"); here nothing in the loop waits on a named barrier.

Roles (384 threads; TileLang's fragment layouts count threads from 0, so the producer
warpgroup is the last, as in ``kernels/fwd/coop.py``):
  threads   0..127  consumer WG1, K/V rows [0, 64) of the CTA's tile         setmaxnreg 240
  threads 128..255  consumer WG2, K/V rows [64, 128)                         setmaxnreg 240
  threads 256..383  setmaxnreg 24: warp 8 the producer (TMA: K and V once, then the Q + lse·log2 e
                    and dO + Δ·scale rings); warps 9 / 10 WG1's / WG2's dQ writer (one bulk
                    reduce-add a step of the warpgroup's dQ plane); warp 11 the zeroer of
                    the next call's dQ accumulator (``Config.zero_next``, on in ``DEFAULT``)
                    or idle
A CTA holds one 128-row K/V tile of one KV head and walks its group's query heads, Q tiles of
64 rows (``tile_scheduler.q_walk``; causal: from the diagonal's tile). The 1-D grid launches
the K/V tiles of ``fill`` KV heads together, tile 0 first (``tile_scheduler.grouped_kv_tile``,
``heuristics.kv_fill``: causal, as many KV heads as one wave holds, so a wave's Q / dO reads
and dQ adds stay within a few heads; 1.04–1.09 × every head's tiles together on the causal 8B
rows, notes/bwd.md "Session 53").
A consumer's step (slot = step mod 2), its 64 K/V rows as the GEMMs' M:
  lse·log2 e into registers, then Sᵀ = K_w Qᵀ and dPᵀ = V_w dOᵀ (SS, issued together);
       Δ·scale into registers while dPᵀ runs
  Pᵀ = exp2(Sᵀ·scale·log2 e − lse·log2 e) (masked on the diagonal's tiles; half the exponents
       before dPᵀ's wait, half among dSᵀ's FMAs); dSᵀ = Pᵀ ∘ (dPᵀ·scale − Δ·scale) → its own dS
       tile ``ds_s[slot, w]``, ds_ready[slot, w]
  dV += Pᵀ dO (RS); once the other warpgroup's dS tile is ready, dQ[:, w half] = Σ_i dS_i K_i[:,
       w half] (SS, both 64-key halves); dK += dSᵀ Q (RS: dSᵀ from registers, TileOPs' way)
  dV and dQ retire: do_empty; dQ → its plane ``dq_s[w]`` → dq_full[w] (the writer adds it into
  the accumulator plane w); dK retires: q_empty.
Epilogue: dK and dV (the sum over the group) from registers straight to global memory.

Barriers (mbarriers; no named barrier in the kernel, TileLang's automatic syncs off):
  kv_full          K and V landed (32 + bytes)
  q_full[s]        Q and lse·log2 e of slot s landed (32 + bytes); do_full[s] dO and Δ·scale
  q_empty[s]       both consumers' dK GEMMs of slot s retired (256; + the zeroer's 1 with
                   zero_next); do_empty[s] their dV GEMMs
  ds_ready[s, w]   consumer w's dSᵀ rows are in ds_s[s, w] (128); one a slot, so a warpgroup
                   never laps the other's wait by a whole phase
  dq_full[w]       consumer w's dQ is in dq_s[w] (128); dq_empty[w] its reduce-add read it (1)
Shared memory at D 128 (bm 128, bn 64, 2 slots): K and V 64 KB, Q and dO 64 KB, dS 32 KB, dQ
  planes 2 × 64 × 64 fp32 = 32 KB (swizzled; padded 36 KB), lse and Δ 1 KB: 194 KB (+ barriers;
  + the zeroer's 2 KB zero block with zero_next).
Runs S a multiple of 128 (no ragged tile), D 128, the group whole (``supports_problem``);
``pipelined.attention_bwd`` runs it there (``heuristics.backend``) and ``pipelined`` elsewhere.
dQ's accumulator is ``prepost``'s, 2 planes (``prepost.dq_accum_shape``). ``Config.pdl`` launches
the three kernels as programmatic dependents (off until measured).
Correct on the H100 (tests/ws/test_bwd.py, racecheck and memcheck); × TileOPs' backward
1.005 on train8b-4k and 0.989 on llama8b-8k (intervals spanning 1), 0.986 on llama8b-4k (behind;
notes/bwd.md, "Session 54"; train8b-8k not yet timed with these changes).
"""
import functools
import math
from dataclasses import dataclass

import tilelang
import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from ws_lab.kernels import LOG2E, batch_extent
from ws_lab.kernels.bwd import heuristics, prepost
from ws_lab.kernels.bwd.tile_scheduler import grouped_kv_tile, kv_walk_steps, q_walk, steps_before
from ws_lab.target import H100_SMS, compile_sm90a

PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,
    # without TileLang's syncs, reusing one buffer's bytes for another races (tilelang #2416)
    tilelang.PassConfigKey.TL_DISABLE_SHARED_MEMORY_REUSE: True,
    tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
}
BLOCK_KV = 128  # K/V rows a CTA: 64 a consumer warpgroup
HALF = BLOCK_KV // 2
BLOCK_Q = 64  # Q rows a step
CONSUMER_THREADS = 256
WARP = 32
PLANES = 2  # dQ accumulator planes: one a consumer warpgroup
ZERO_ROWS = 8  # accumulator rows one zeroing bulk store covers (2 KB of a swizzled plane)
ZERO_GROUPS_IN_FLIGHT = 4  # the zeroer's bulk stores still reading shared memory, at most
HEAD_DIMS = (128,)


@dataclass(frozen=True)
class Config:
    """``attention_bwd(backend="ws", config=...)``'s options."""
    fill: int | None = None  # KV heads launched together; None: heuristics.kv_fill
    # dQ accumulator's layout (``prepost.DQ_LAYOUTS``): "swizzled" drops the 8-column pad
    # (1/9 of each reduce-add and of the pre / postprocess' bytes; 1.01–1.03 × "padded",
    # notes/bwd.md "Session 54")
    dq_layout: str = "swizzled"
    # PDL: the main kernel starts on the preprocess' tail (its K / V loads before it waits) and
    # the postprocess on its own; off until measured on a GPU (notes/bwd.md, "Session 54, later")
    pdl: bool = False
    # dQ into one of two accumulators while warp 11 zeroes the other for the next call by
    # evict-first bulk stores (TileOPs' design): no clear in the preprocess; the pair and the
    # device-side parity that picks one are kept between calls (notes/bwd.md "Session 59");
    # ``DEFAULT`` has it on: 1.013-1.016 × off on the H100 (notes/bwd.md "Session 60")
    zero_next: bool = False

    def __post_init__(self):
        if self.dq_layout not in prepost.DQ_LAYOUTS:
            raise ValueError(f"ws.Config.dq_layout must be one of {prepost.DQ_LAYOUTS}, not "
                             f"{self.dq_layout!r}")


# the backend's configuration when none is given: the kept pair costs 2 × dQ_accum a shape
# (up to ``pipelined.dq_accum_pair``'s 8), the price of no clear per call
DEFAULT = Config(zero_next=True)


def supports_problem(seq_len, head_dim) -> str | None:
    """None where this kernel runs the problem, else why not."""
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (runs {HEAD_DIMS})"
    if seq_len % BLOCK_KV:
        return f"seq_len {seq_len} is no multiple of {BLOCK_KV} (no ragged tiles)"
    return None


def flash_bwd_ws(batch, seq_len, heads, kv_heads, head_dim, causal, dtype, softmax_scale,
                 fill=1, dq_layout="swizzled", pdl=False, zero_next=False):
    """(Q, K, V, dO, lse·log2 e, Δ·scale (B, Hq, S) from ``prepost.preprocess``) -> dQ_accum
    (fp32, 2 planes, added to), dK, dV (dtype). ``batch`` may be ``DYNAMIC_BATCH``.
    ``fill``: the KV heads whose K/V tiles launch together (``tile_scheduler.grouped_kv_tile``;
    ``heuristics.kv_fill``). ``dq_layout``: the accumulator's (``Config.dq_layout``).
    ``pdl``: launched as the preprocess' programmatic dependent, it lets its own dependent (the
    postprocess) launch at its start and waits for the preprocess before its first lse / Δ
    load; every dQ add follows that load. ``zero_next``: dQ_accum is a pair and the kernel takes
    the int32 parity the preprocess flipped: it adds into ``dQ[parity]`` and warp 11 zeroes
    ``dQ[1 - parity]`` for the next call (``zeroer``)."""
    if kv_heads % fill:
        raise ValueError(f"fill {fill} must divide kv_heads {kv_heads}")
    why = supports_problem(seq_len, head_dim)
    if why:
        raise ValueError(f"bwd-ws does not run {why}")
    batch = batch_extent(batch)
    group = heads // kv_heads
    scale_log2 = softmax_scale * LOG2E
    accum = "float"
    bn, half_d = BLOCK_Q, head_dim // PLANES
    n_qtiles = seq_len // bn
    n_kvtiles = seq_len // BLOCK_KV
    accum_shape = prepost.dq_accum_shape(batch, seq_len, heads, head_dim, PLANES, dq_layout)
    dq_width = accum_shape[-1]  # a staging row: D / 2 and the pad, if any
    dq_run_bytes = bn * dq_width * 4

    zero_bytes = ZERO_ROWS * dq_width * 4
    rows = accum_shape[3]

    def first_qtile(bx):
        """The first Q tile that sees K/V tile ``bx`` (causal: the diagonal's)."""
        return (bx * BLOCK_KV) // bn if causal else 0

    def total_steps(bx):
        return kv_walk_steps(bx, n_qtiles, group, causal, BLOCK_KV // bn)

    # the zeroer's C chunks over all CTAs' N steps (int64: a step index times C passes 2^31)
    chunks = T.Cast("int64", batch * heads * PLANES * rows // ZERO_ROWS)
    steps = T.Cast("int64", steps_before(0, 0, batch, n_qtiles, n_kvtiles, kv_heads, group,
                                         causal, BLOCK_KV // bn))
    chunk_quot, chunk_rem = T.Cast("int32", chunks // steps), T.Cast("int32", chunks % steps)
    step_count = T.Cast("int32", steps)

    def step(bx, it):
        """(query head within the group, Q tile) of step ``it``."""
        return q_walk(it, n_qtiles - first_qtile(bx), first_qtile(bx), 0, group, n_qtiles,
                      False)

    @T.macro
    def producer(Q, K, V, dO, LSElog2, DeltaScaled, k_s, v_s, q_s, do_s, lse_s, dl_s,
                 kv_full, q_full, do_full, q_empty, do_empty, bx, kvh, b):
        for w in T.unroll(2):
            rows = bx * BLOCK_KV + w * HALF
            T.tma_copy(K[b, rows:rows + HALF, kvh, :], k_s[w, :, :], barrier=kv_full)
            T.tma_copy(V[b, rows:rows + HALF, kvh, :], v_s[w, :, :], barrier=kv_full)
        T.mbarrier_arrive(kv_full)
        if pdl:
            T.pdl_trigger()  # the postprocess may launch once every CTA is here
            T.pdl_sync()  # lse·log2 e, Δ·scale and the cleared accumulator are the preprocess'
        for it in T.serial(total_steps(bx)):
            hh, qt = step(bx, it)
            h = kvh * group + hh
            slot, phase = it % 2, (it // 2) % 2
            T.mbarrier_wait_parity(q_empty[slot], phase ^ 1)
            T.tma_copy(Q[b, qt * bn:(qt + 1) * bn, h, :], q_s[slot, :, :], barrier=q_full[slot])
            T.tma_copy(LSElog2[b, h, qt * bn:(qt + 1) * bn], lse_s[slot, :],
                       barrier=q_full[slot])
            T.mbarrier_arrive(q_full[slot])
            T.mbarrier_wait_parity(do_empty[slot], phase ^ 1)
            T.tma_copy(dO[b, qt * bn:(qt + 1) * bn, h, :], do_s[slot, :, :],
                       barrier=do_full[slot])
            T.tma_copy(DeltaScaled[b, h, qt * bn:(qt + 1) * bn], dl_s[slot, :],
                       barrier=do_full[slot])
            T.mbarrier_arrive(do_full[slot])

    def accum_at(dQ, Parity, b, h, plane, row, spare=False):
        """dQ_accum's element (b, h, plane, row, 0); zero_next: of ``dQ[Parity[0]]``, or
        ``spare``, of the other one. Parity is read here, after a barrier wait that follows the
        preprocess' flip."""
        if not zero_next:
            return dQ[b, h, plane, row, 0]
        return dQ[1 - Parity[0] if spare else Parity[0], b, h, plane, row, 0]

    @T.macro
    def dq_writer(w, dq_s, dQ, Parity, dq_full, dq_empty, bx, kvh, b):
        """Warp 9 + w: each step, one bulk reduce-add of consumer w's dQ plane into plane w of
        the accumulator (a contiguous run), then hand the plane back once it has been read."""
        lane0 = T.get_thread_binding() % WARP == 0
        for it in T.serial(total_steps(bx)):
            hh, qt = step(bx, it)
            T.mbarrier_wait_parity(dq_full[w], it % 2)
            if lane0:
                T.call_extern("handle", "tl::tma_store_add", T.access_ptr(dq_s[w, 0, 0], "r"),
                              T.access_ptr(accum_at(dQ, Parity, b, kvh * group + hh, w, qt * bn),
                                           "w"),
                              dq_run_bytes)
                T.tma_store_arrive()
                T.tma_store_wait(0)  # read: the plane may be restaged
                T.mbarrier_arrive(dq_empty[w])

    @T.macro
    def zeroer(dQ, Parity, zero_s, q_full, q_empty, bx, kvh, b):
        """Warp 11 (zero_next): zeroes ``dQ[1 - Parity[0]]``, the accumulator the next call
        adds into, in ``ZERO_ROWS``-row chunks from a zeroed shared block by evict-first bulk
        stores (they leave L2 to the lines the kernel reuses). Global step g takes chunks
        [g·C / N, (g+1)·C / N) of all C over all N steps, so the stores spread over the launch;
        its arrival on q_empty keeps it within a slot of the producer."""
        lane = T.get_thread_binding() % WARP
        for i in T.serial(zero_bytes // 4 // WARP):
            zero_s[i * WARP + lane] = T.float32(0)
        T.fence_proxy_async()  # the generic-proxy zeros, before the bulk stores read them
        T.sync_warp()
        if lane == 0:
            first = T.Cast("int64", steps_before(bx, kvh, b, n_qtiles, n_kvtiles, kv_heads,
                                                 group, causal, BLOCK_KV // bn))
            # step g's chunks start at g·C // N; C = q·N + r, so a step moves that start by q,
            # and by one more when the remainder passes N: int32 from here (24 registers)
            at = T.alloc_var("int32", init=T.Cast("int32", first * chunks // steps))
            rem = T.alloc_var("int32", init=T.Cast("int32", first * chunks % steps))
            for it in T.serial(total_steps(bx)):
                slot, phase = it % 2, (it // 2) % 2
                T.mbarrier_wait_parity(q_full[slot], phase)
                carry = T.if_then_else(rem + chunk_rem >= step_count, 1, 0)
                for k in T.serial(chunk_quot + carry):
                    row = (at + k) * ZERO_ROWS  # over (b, h, plane, row), flattened
                    T.call_extern(
                        "handle", "tl::tma_store<tl::CacheHintSm90::EVICT_FIRST>",
                        T.access_ptr(accum_at(dQ, Parity, row // (rows * PLANES * heads),
                                              row // (rows * PLANES) % heads,
                                              row // rows % PLANES, row % rows, spare=True),
                                     "w"),
                        T.access_ptr(zero_s[0], "r"), zero_bytes)
                    T.tma_store_arrive()
                T.mbarrier_arrive(q_empty[slot])
                at = at + chunk_quot + carry
                rem = rem + chunk_rem - carry * step_count
                T.tma_store_wait(ZERO_GROUPS_IN_FLIGHT)
            T.tma_store_wait(0)  # read: shared memory outlives the stores' reads

    @T.macro
    def consumer(w, k_s, v_s, q_s, do_s, lse_s, dl_s, ds_s, dq_s, dK, dV, kv_full, q_full,
                 do_full, q_empty, do_empty, ds_ready, dq_full, dq_empty, bx, kvh, b):
        st = T.alloc_fragment([HALF, bn], accum)  # Sᵀ, then Pᵀ
        dpt = T.alloc_fragment([HALF, bn], accum)
        lse_r = T.alloc_fragment([HALF, bn], accum)  # lse·log2 e, Δ·scale by column, in Sᵀ's
        dl_r = T.alloc_fragment([HALF, bn], accum)  # layout
        pt = T.alloc_fragment([HALF, bn], dtype)
        dst = T.alloc_fragment([HALF, bn], dtype)
        dq = T.alloc_fragment([bn, half_d], accum)
        dk = T.alloc_fragment([HALF, head_dim], accum)
        dv = T.alloc_fragment([HALF, head_dim], accum)
        row0 = bx * BLOCK_KV + w * HALF  # this warpgroup's first key
        T.clear(dk)
        T.clear(dv)
        T.mbarrier_wait_parity(kv_full, 0)
        for it in T.serial(total_steps(bx)):
            hh, qt = step(bx, it)
            slot, phase = it % 2, (it // 2) % 2
            T.mbarrier_wait_parity(q_full[slot], phase)
            # lse read before the GEMMs: behind HGMMAs a load waits for the tensor core to take
            # them (notes/bwd.md "Session 67, later"; Δ read early too spills)
            for i, j in T.Parallel(HALF, bn):
                lse_r[i, j] = lse_s[slot, j]
            T.wgmma_gemm(k_s[w, :, :], q_s[slot, :, :], st, transpose_B=True, clear_accum=True)
            T.mbarrier_wait_parity(do_full[slot], phase)
            T.wgmma_gemm(v_s[w, :, :], do_s[slot, :, :], dpt, transpose_B=True,
                          clear_accum=True)
            T.wait_wgmma(1)
            T.warpgroup_fence_operand(st, num_regs=HALF * bn // 128)
            for i, j in T.Parallel(HALF, bn):
                st[i, j] = st[i, j] * scale_log2 - lse_r[i, j]
            if causal:
                if qt * bn < row0 + HALF:  # the tile meets the diagonal
                    for i, j in T.Parallel(HALF, bn):
                        st[i, j] = T.if_then_else(row0 + i <= qt * bn + j, st[i, j],
                                                  -T.infinity(accum))
            # half the exponents while dPᵀ is in flight, half among dSᵀ's FMAs (MUFU beside FMA)
            for i, j in T.Parallel(HALF, bn):
                if j < bn // 2:
                    st[i, j] = T.exp2(st[i, j])
            for i, j in T.Parallel(HALF, bn):  # read while dPᵀ is in flight
                dl_r[i, j] = dl_s[slot, j]
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(dpt, num_regs=HALF * bn // 128)
            for i, j in T.Parallel(HALF, bn):
                if j >= bn // 2:
                    st[i, j] = T.exp2(st[i, j])
                dst[i, j] = st[i, j] * (dpt[i, j] * softmax_scale - dl_r[i, j])
            T.copy(st, pt)
            T.copy(dst, ds_s[slot, w, :, :])
            T.fence_proxy_async()  # the generic-proxy stores, before any wgmma reads them
            T.mbarrier_arrive(ds_ready[slot * 2 + w])
            T.wgmma_gemm(pt, do_s[slot, :, :], dv)
            T.mbarrier_wait_parity(ds_ready[slot * 2 + 1 - w], phase)
            # dQ contracts over both warpgroups' 64 keys
            T.wgmma_gemm(ds_s[slot, 0, :, :], k_s[0, :, w * half_d:(w + 1) * half_d], dq,
                         transpose_A=True, clear_accum=True)
            T.wgmma_gemm(ds_s[slot, 1, :, :], k_s[1, :, w * half_d:(w + 1) * half_d], dq,
                         transpose_A=True)
            T.wgmma_gemm(dst, q_s[slot, :, :], dk)  # from registers: no dSᵀ read from smem
            T.wait_wgmma(1)  # dV and dQ retired; dK runs on
            T.warpgroup_fence_operand(dv, num_regs=HALF * head_dim // 128)
            T.warpgroup_fence_operand(dq, num_regs=bn * half_d // 128)
            T.mbarrier_arrive(do_empty[slot])
            T.mbarrier_wait_parity(dq_empty[w], (it % 2) ^ 1)
            for j, d in T.Parallel(bn, half_d):
                dq_s[w, j, prepost.stored_column(dq_layout, j, d)] = dq[j, d]
            T.fence_proxy_async()
            T.mbarrier_arrive(dq_full[w])
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(dk, num_regs=HALF * head_dim // 128)
            T.mbarrier_arrive(q_empty[slot])
        T.copy(dk, dK[b, row0:row0 + HALF, kvh, :])
        T.copy(dv, dV[b, row0:row0 + HALF, kvh, :])

    def q_t():  # a fresh annotation per parameter (tests/upstream/test_shared_annotation.py)
        return T.Tensor([batch, seq_len, heads, head_dim], dtype)

    def kv_t():
        return T.Tensor([batch, seq_len, kv_heads, head_dim], dtype)

    def row_t():
        return T.Tensor([batch, heads, seq_len], accum)

    @T.macro
    def body(Q, K, V, dO, LSElog2, DeltaScaled, dQ, dK, dV, Parity):
        with T.Kernel(n_kvtiles * kv_heads * batch, threads=CONSUMER_THREADS + 128) as t:
            bx, kvh, b = grouped_kv_tile(t, n_kvtiles, kv_heads, fill)
            k_s = T.alloc_shared([2, HALF, head_dim], dtype)
            v_s = T.alloc_shared([2, HALF, head_dim], dtype)
            q_s = T.alloc_shared([2, bn, head_dim], dtype)
            do_s = T.alloc_shared([2, bn, head_dim], dtype)
            ds_s = T.alloc_shared([2, 2, HALF, bn], dtype)  # (slot, warpgroup)
            dq_s = T.alloc_shared([PLANES, bn, dq_width], accum)
            lse_s = T.alloc_shared([2, bn], accum)
            dl_s = T.alloc_shared([2, bn], accum)
            T.annotate_layout({buf: make_swizzled_layout(buf)
                               for buf in (k_s, v_s, q_s, do_s, ds_s)})
            kv_full = T.alloc_barrier(WARP)
            q_full = T.alloc_barrier([WARP] * 2)
            do_full = T.alloc_barrier([WARP] * 2)
            zero_s = T.alloc_shared([zero_bytes // 4], accum) if zero_next else None
            # zero_next: the zeroer's arrival too, which keeps it within a slot of the producer
            q_empty = T.alloc_barrier([CONSUMER_THREADS + (1 if zero_next else 0)] * 2)
            do_empty = T.alloc_barrier([CONSUMER_THREADS] * 2)
            ds_ready = T.alloc_barrier([128] * 4)  # slot * 2 + warpgroup
            dq_full = T.alloc_barrier([128] * PLANES)
            dq_empty = T.alloc_barrier([1] * PLANES)
            tx = T.get_thread_binding()
            if tx >= CONSUMER_THREADS:
                # 24 + 2 × 240 = 3 × 168, the registers the CTA launched with: an increase takes
                # what a decrease freed; with 32 here the kernel never returned (notes/bwd.md)
                T.set_max_nreg(24, 0)
                if tx < CONSUMER_THREADS + WARP:
                    producer(Q, K, V, dO, LSElog2, DeltaScaled, k_s, v_s, q_s, do_s, lse_s, dl_s,
                             kv_full, q_full, do_full, q_empty, do_empty, bx, kvh, b)
                elif tx < CONSUMER_THREADS + 2 * WARP:
                    dq_writer(0, dq_s, dQ, Parity, dq_full, dq_empty, bx, kvh, b)
                elif tx < CONSUMER_THREADS + 3 * WARP:
                    dq_writer(1, dq_s, dQ, Parity, dq_full, dq_empty, bx, kvh, b)
                elif zero_next:
                    zeroer(dQ, Parity, zero_s, q_full, q_empty, bx, kvh, b)
            elif tx < 128:
                T.set_max_nreg(240, 1)
                consumer(0, k_s, v_s, q_s, do_s, lse_s, dl_s, ds_s, dq_s, dK, dV, kv_full,
                         q_full, do_full, q_empty, do_empty, ds_ready, dq_full, dq_empty, bx,
                         kvh, b)
            else:
                T.set_max_nreg(240, 1)
                consumer(1, k_s, v_s, q_s, do_s, lse_s, dl_s, ds_s, dq_s, dK, dV, kv_full,
                         q_full, do_full, q_empty, do_empty, ds_ready, dq_full, dq_empty, bx,
                         kvh, b)

    if zero_next:
        @T.prim_func
        def main_pair(Q: q_t(), K: kv_t(), V: kv_t(), dO: q_t(), LSElog2: row_t(),
                      DeltaScaled: row_t(), dQ: T.Tensor((2, *accum_shape), accum), dK: kv_t(),
                      dV: kv_t(), Parity: T.Tensor([1], "int32")):
            body(Q, K, V, dO, LSElog2, DeltaScaled, dQ, dK, dV, Parity)

        return main_pair

    @T.prim_func
    def main(Q: q_t(), K: kv_t(), V: kv_t(), dO: q_t(), LSElog2: row_t(), DeltaScaled: row_t(),
             dQ: T.Tensor(accum_shape, accum), dK: kv_t(), dV: kv_t()):
        body(Q, K, V, dO, LSElog2, DeltaScaled, dQ, dK, dV, None)

    return main


@functools.lru_cache(maxsize=None)
def compiled(*args):
    """The kernel for ``flash_bwd_ws``'s positional arguments."""
    return compile_sm90a(flash_bwd_ws(*args), PASS_CONFIGS)


def prim_func_for(shape):
    """The kernel's prim_func for a named shape, launched as on an H100 (the CPU codegen checks
    and ``emit``)."""
    fill = heuristics.kv_fill(shape.kv_heads, shape.seq_len // BLOCK_KV, shape.causal, H100_SMS)
    return flash_bwd_ws(shape.batch, shape.seq_len, shape.heads, shape.kv_heads, shape.head_dim,
                        shape.causal, shape.dtype, 1.0 / math.sqrt(shape.head_dim), fill,
                        DEFAULT.dq_layout, DEFAULT.pdl)
