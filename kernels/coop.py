"""Cooperative 2-consumer-warpgroup warp-specialized forward ("coop"), written with TileLang's
explicit warp-specialization primitives.

FA3 counterpart: ``hopper/flash_fwd_kernel_sm90.h`` (roles, register budgets) with
``hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp`` (``load()`` / ``mma()`` without IntraWGOverlap)
and ``hopper/named_barrier.hpp`` (``WarpSchedulerWG1/2``), kBlockM = 128.

Roles (384 threads; TileLang's fragment layouts count threads from 0, so the producer is the
*last* warpgroup here where FA3 makes it WG0):
  threads   0..127  consumer WG1, Q rows [0, 64)    setmaxnreg 240
  threads 128..255  consumer WG2, Q rows [64, 128)  setmaxnreg 240
  threads 256..383  producer; its first warp issues every TMA load  setmaxnreg 24
Each consumer: S = Q Kᵀ (SS wgmma) → wait → release K → mask (diagonal / ragged blocks only),
online softmax in registers (exp2 of scale·log2 e) → rescale O → O += P V (RS wgmma, P in
registers) → wait → release V. Epilogue: O / l → its own half of the Q buffer (its last QK GEMM
has retired) → fence.proxy.async → named barrier of its 128 threads → TMA store.

The consumer's KV loop is a parameter of ``coop_fwd`` (``serial_mainloop`` here;
``kernels/coop_overlap.py`` plugs in FA3's IntraWGOverlap loop and shares everything else).

Persistent (``Config.persistent``, FA3 ``StaticPersistentTileScheduler``; D 64/128): one CTA per
SM walks one tile per round, numbered heaviest first, rounds zigzagging, in groups of 16 Q tiles
of one head when the K/V exceed half of L2 (``tile_rank``); the K/V ring's stage/phase run on
across tiles (``it0``), Q is double-buffered by tile parity behind q_full[2] / q_empty[2] (256:
both consumers, once their O store has read the slot), so the next tile's Q and K/V stream in
while this tile's O is stored, and each tile's last PV shares an issue turn with the next
tile's first QK (the mainloop's ``drain_into_next``). Pingpong's pre-paid turn is taken once
per CTA.

K/V multicast (``Config.cluster`` = 2, persistent, even GQA groups; ``cluster_for`` turns it on
when the call's K/V exceed half of L2; FA3 ``ClusterM = 2``, which pairs adjacent Q tiles of
one head and so runs without a causal mask only): a 2-CTA cluster walks one tile list, the two
CTAs on adjacent Q heads of one KV head, so their K/V blocks and causal masks are the same. The
rank-0 producer loads each block once into both CTAs' shared memory (TMA ``.multicast::cluster``);
the rank-1 producer only expects the bytes. L2 serves each block once per pair, not twice.

Pingpong (``Config.pingpong``, FA3 ``warp_scheduler_barrier_sync/arrive``): a consumer issues
its QK GEMM only after the other consumer has issued its own, so one warpgroup's GEMMs run
while the other does softmax.

Barriers: mbarriers q_full (32 arrivals: the producer warp), k_full[s] / v_full[s] (32 +
TMA bytes), k_empty[s] / v_empty[s] (256: every consumer thread; in a cluster 264, cluster
barriers: lane 0 of each of the peer's 8 consumer warps arrives remotely too, as in CUTLASS's
``PipelineTmaAsync``, since the next load of the stage lands in both CTAs); named barriers in
``NamedBarrier``; in a cluster a ``cluster_sync`` after the barriers' init and one before exit.

Shared memory (2-byte elements, stages s, block_n bn): Q 128·D + s·bn·(D + Dv); O reuses Q.
  D 64: 16 + 2·128·128 B = 80 KB; D 128: 32 + 128 = 160 KB (bn 128, s 2);
  D 256: 64 + 2·64·512 B = 192 KB (bn 64, s 2). Persistent: Q twice, D 64 96 KB, D 128 192 KB.
TileLang's automatic barrier insertion is off (``tl.disable_thread_storage_sync``): it would put
``__syncthreads()`` where only some warpgroups arrive. Its shared-memory reuse is off too
(``tl.disable_shared_memory_reuse``): without those syncs, reusing a buffer's bytes for another
is a race (tilelang #2416); the one reuse here, O into Q, is explicit and per warpgroup.
"""

import contextlib
import functools
import inspect
import math
from dataclasses import dataclass
from enum import IntEnum
from types import SimpleNamespace

import tilelang
import tilelang.language as T
import torch
from tilelang.layout import make_swizzled_layout

from ws_lab import postproc
from ws_lab.kernels import LOG2E, qtile_grid
from ws_lab.kernels.softmax import alloc_softmax_state, normalize_o, online_softmax, score_mask
from ws_lab.check import validate_attention_inputs
from ws_lab.shapes import Shape
from ws_lab.target import H100_L2_BYTES, H100_SMS, compile_sm90a

BLOCK_M = 128  # two consumer warpgroups × 64 rows
HALF = BLOCK_M // 2
CONSUMER_THREADS = 256
PRODUCER_WARP = 32

PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,
    tilelang.PassConfigKey.TL_DISABLE_SHARED_MEMORY_REUSE: True,
    tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
}


class NamedBarrier(IntEnum):
    """Hardware named barriers (id 0 is __syncthreads)."""
    WARP_SCHEDULER_WG1 = 1  # WG1 may issue its QK GEMM (256 = 128 sync + 128 arrive)
    WARP_SCHEDULER_WG2 = 2
    EPILOGUE_WG1 = 3  # WG1's 128 threads have written their O tile
    EPILOGUE_WG2 = 4
    ROW_SUM = 5  # largehdv: WG1's final row sums are in smem for WG2 (128 arrive + 128 sync)


@dataclass(frozen=True)
class Config:
    block_n: int
    num_stages: int
    pingpong: bool
    heavy_first: bool = False
    persistent: bool = False  # one CTA per SM walking a static, heavy-first list of tiles
    cluster: int = 1  # persistent: 2 = CTA pairs on two Q heads of one KV head, K/V multicast


# Persistent walk: when the call's K/V exceed half of L2, RANK_GROUP Q tiles of one head run on
# neighbouring CTAs, so the ~132 resident tiles read the K/V of a few heads, not of all of them.
RANK_GROUP = 16


CONFIGS = {
    64: Config(128, 2, True),
    128: Config(128, 2, True),
    256: Config(64, 2, True),
}
HEAD_DIMS = sorted((d, d) for d in CONFIGS)
PERSISTENT_HEAD_DIMS = [(64, 64), (128, 128)]


def config_for(head_dim: int, causal: bool, pingpong: bool = True,
               persistent: bool = False, cluster: int = 1) -> Config:
    base = CONFIGS[head_dim]
    return Config(base.block_n, base.num_stages, pingpong, heavy_first=causal,
                  persistent=persistent, cluster=cluster)


def kv_exceed_half_l2(batch, seq_len, kv_heads, head_dim, head_dim_v, l2_bytes) -> bool:
    """The call's K and V (2-byte elements) do not fit in half of L2: the line above which the
    persistent walk groups Q tiles by head and runs CTA pairs."""
    return batch * kv_heads * seq_len * (head_dim + head_dim_v) * 2 > l2_bytes // 2


def cluster_for(batch, seq_len, heads, kv_heads, head_dim, head_dim_v, l2_bytes) -> int:
    """CTAs per cluster of the persistent walk: 2 (two Q heads of one GQA group on a CTA pair,
    each K/V block loaded once and multicast into both) when the group is even and the call's
    K/V exceed half of L2; else 1. Measured against single CTAs (NOTES, session 11): +1 to +7 %
    at 32–64 MB of K/V (±1 % on the full-mask 32 MB row), −1 % at 16 MB, where L2 holds them."""
    group_even = (heads // kv_heads) % 2 == 0
    big = kv_exceed_half_l2(batch, seq_len, kv_heads, head_dim, head_dim_v, l2_bytes)
    return 2 if group_even and big else 1


def kv_producer(bn: int, stages: int, v_parts: int = 1, cluster: int = 1):
    """The producer warp's KV loop, shared by every WS kernel of the lab: per block, wait for
    the stage to be free, TMA K into k_s[stage] and V into v_s[stage] (in ``v_parts`` column
    slices v_s[stage, part] when a consumer warpgroup owns each slice, as in largehdv).
    ``cluster`` 2: the pair's rank-0 CTA multicasts each load into both CTAs (the stage's empty
    barrier then counts the peer's consumer warps too); the other CTA only expects the bytes."""
    mask = (1 << cluster) - 1 if cluster > 1 else None

    @T.macro
    def produce(K, V, k_s, v_s, k_full, k_empty, v_full, v_empty, b, kv_head, loop_range, it0=0):
        for kb in T.serial(loop_range):
            stage = (it0 + kb) % stages  # it0: blocks this CTA streamed for earlier tiles
            phase = ((it0 + kb) // stages) % 2
            T.mbarrier_wait_parity(k_empty[stage], phase ^ 1)
            T.tma_copy(K[b, kb * bn:(kb + 1) * bn, kv_head, :], k_s[stage, :, :],
                       barrier=k_full[stage], cluster_mask=mask)
            T.mbarrier_arrive(k_full[stage])
            T.mbarrier_wait_parity(v_empty[stage], phase ^ 1)
            if v_parts == 1:
                T.tma_copy(V[b, kb * bn:(kb + 1) * bn, kv_head, :], v_s[stage, :, :],
                           barrier=v_full[stage], cluster_mask=mask)
            else:
                width = v_s.shape[-1]
                for part in T.unroll(v_parts):
                    T.tma_copy(V[b, kb * bn:(kb + 1) * bn, kv_head, part * width:(part + 1) * width],
                               v_s[stage, part, :, :], barrier=v_full[stage])
            T.mbarrier_arrive(v_full[stage])

    return produce


@T.macro
def store_o(acc_o, o_s, out, barrier_id):
    """Epilogue of one consumer warpgroup: its normalized O tile → o_s (smem it alone owns now)
    → fence.proxy.async → named barrier of its 128 threads → TMA store into ``out``."""
    T.copy(acc_o, o_s)
    T.fence_proxy_async()
    T.sync_threads(barrier_id, 128)
    T.copy(o_s, out)


def serial_mainloop(t):
    """FA3's mainloop without IntraWGOverlap: per KV block, S = Q Kᵀ → wait → softmax → O += P V
    → wait. ``t`` holds the kernel's trace-time constants and shared macros (``coop_fwd``).
    A mainloop factory returns its macros: ``tile`` (one tile's KV loop) and, for the
    persistent kernel, the pieces that let a tile's last PV share an issue turn with the next
    tile's first QK (``kernels/coop_overlap.py``); ``fills_o`` says whether the consumer
    zero-fills O before a tile (False: the mainloop's first PV overwrites it)."""

    @T.macro
    def mainloop(wg, row0, q_s, k_s, v_s, k_full, k_empty, v_full, v_empty, loop_range,
                 acc_s, p, acc_o, row_max, row_max_prev, row_rescale, block_sum, row_sum, slot,
                 it0):
        for kb in T.serial(loop_range):
            stage = (it0 + kb) % t.stages
            phase = ((it0 + kb) // t.stages) % 2
            t.issue_qk(wg, q_s, slot, k_s, k_full, stage, phase, acc_s)
            if t.pingpong:
                T.named_barrier_arrive(t.schedulers[1 - wg], CONSUMER_THREADS)
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(acc_s, num_regs=t.s_regs)
            t.release(k_empty, stage)

            t.mask(acc_s, kb, row0)
            online_softmax(acc_s, p, acc_o, row_max, row_max_prev, row_rescale, block_sum,
                           row_sum, HALF, t.bn, t.head_dim_v, t.scale_log2)

            T.mbarrier_wait_parity(v_full[stage], phase)
            T.wgmma_gemm(p, v_s[stage, :, :], acc_o, clear_accum=False)
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(acc_o, num_regs=t.o_regs)
            t.release(v_empty, stage)

    return SimpleNamespace(tile=mainloop, fills_o=True)


def coop_fwd(batch, seq_len, heads, kv_heads, head_dim, head_dim_v, causal, dtype, softmax_scale,
             cfg: Config, mainloop_factory=serial_mainloop, num_ctas=H100_SMS,
             l2_bytes=H100_L2_BYTES):
    """q (B,S,Hq,D), k (B,S,Hkv,D), v (B,S,Hkv,Dv) -> out (B,S,Hq,Dv). The producer, consumer
    setup and epilogue are shared; ``mainloop_factory(t)`` gives the consumer's KV loop."""
    bn, stages = cfg.block_n, cfg.num_stages
    group = heads // kv_heads
    scale_log2 = softmax_scale * LOG2E
    accum = "float"
    neg_inf = -T.infinity(accum)
    s_regs = HALF * bn // 128  # fp32 registers per thread of a 64 × bn accumulator
    o_regs = HALF * head_dim_v // 128
    n_qtiles = (seq_len + BLOCK_M - 1) // BLOCK_M
    n_kblocks = (seq_len + bn - 1) // bn
    schedulers = (NamedBarrier.WARP_SCHEDULER_WG1, NamedBarrier.WARP_SCHEDULER_WG2)
    epilogues = (NamedBarrier.EPILOGUE_WG1, NamedBarrier.EPILOGUE_WG2)

    mask = score_mask(causal, seq_len, HALF, bn, accum)

    @T.macro
    def issue_qk(wg, q_s, slot, k_s, k_full, stage, phase, acc_s):
        """Wait for K, take this warpgroup's pingpong turn, issue S = Q Kᵀ (no wait)."""
        T.mbarrier_wait_parity(k_full[stage], phase)
        if cfg.pingpong:
            T.sync_threads(schedulers[wg], CONSUMER_THREADS)
        T.wgmma_gemm(q_s[slot, wg, :, :], k_s[stage, :, :], acc_s, transpose_B=True,
                     clear_accum=True)

    @T.macro
    def release(empty, stage):
        """A consumer thread frees a K/V stage. In a cluster the stage's next load lands in
        both CTAs, so lane 0 of each warp frees it in the peer CTA too."""
        T.mbarrier_arrive(empty[stage])
        if cfg.cluster > 1:
            if T.get_thread_binding() % 32 == 0:
                T.mbarrier_arrive(empty[stage], 1 - T.block_rank_in_cluster())

    t = SimpleNamespace(bn=bn, stages=stages, pingpong=cfg.pingpong, schedulers=schedulers,
                        causal=causal, seq_len=seq_len,
                        s_regs=s_regs, o_regs=o_regs, p_regs=HALF * bn // 256,
                        head_dim_v=head_dim_v, scale_log2=scale_log2, mask=mask,
                        issue_qk=issue_qk, release=release)
    loop = mainloop_factory(t)
    if cfg.cluster not in (1, 2) or (cfg.cluster == 2 and not cfg.persistent):
        raise ValueError(f"cluster={cfg.cluster}: the persistent kernel runs CTA pairs (2) or "
                         "single CTAs (1); the non-persistent grid only single CTAs")
    if group % cfg.cluster:
        raise ValueError(f"cluster={cfg.cluster} pairs two Q heads of one KV head: the GQA group "
                         f"({heads} / {kv_heads} = {group}) must be even")
    if cfg.persistent and not hasattr(loop, "drain_into_next"):
        raise ValueError("the persistent kernel needs a mainloop whose last PV can share an issue "
                         "turn with the next tile's first QK (kernels.coop_overlap)")
    produce_kv = kv_producer(bn, stages, cluster=cfg.cluster)

    @T.macro
    def epilogue(wg, acc_o, row_sum, inv_sum, q_s, slot, q_empty, out_tile):
        """O / l → this warpgroup's half of the tile's Q slot (its last QK GEMM has retired)
        → TMA store; persistent: hand the slot back once the store has read it."""
        normalize_o(acc_o, row_sum, inv_sum, HALF, head_dim_v)
        store_o(acc_o, q_s[slot, wg, :, :], out_tile, epilogues[wg])
        if cfg.persistent:
            # the store's TMA has read the slot (its issuing thread waited): hand it back
            T.sync_threads(epilogues[wg], 128)
            T.mbarrier_arrive(q_empty[slot])

    @T.macro
    def consumer(wg, Out, q_s, k_s, v_s, q_full, k_full, k_empty, v_full, v_empty, qt, head, b,
                 loop_range):
        """One consumer warpgroup's tile (the non-persistent grid)."""
        row0 = qt * BLOCK_M + wg * HALF  # first query row of this warpgroup
        acc_s, p, acc_o, row_max, row_max_prev, row_rescale, block_sum, row_sum = \
            alloc_softmax_state(HALF, bn, head_dim_v, dtype)
        if loop.fills_o:
            T.fill(acc_o, 0)
        T.fill(row_sum, 0)
        T.fill(row_max, neg_inf)
        T.mbarrier_wait_parity(q_full[0], 0)
        if cfg.pingpong and wg == 1:
            # WG1 goes first: WG2 pre-pays its arrival on WG1's scheduler barrier.
            T.named_barrier_arrive(schedulers[0], CONSUMER_THREADS)
        loop.tile(wg, row0, q_s, k_s, v_s, k_full, k_empty, v_full, v_empty, loop_range, acc_s,
                  p, acc_o, row_max, row_max_prev, row_rescale, block_sum, row_sum, 0, 0)
        epilogue(wg, acc_o, row_sum, row_rescale, q_s, 0, None,
                 Out[b, row0:row0 + HALF, head, :])

    @T.macro
    def producer(Q, K, V, q_s, k_s, v_s, q_full, q_empty, k_full, k_empty, v_full, v_empty, qt,
                 head, b, loop_range, slot=0, use=0, it0=0):
        """The producer warp's tile: both Q halves into the tile's slot, then the KV stream."""
        if cfg.persistent:
            T.mbarrier_wait_parity(q_empty[slot], (use % 2) ^ 1)
        for wg in T.unroll(2):
            T.tma_copy(Q[b, qt * BLOCK_M + wg * HALF:qt * BLOCK_M + (wg + 1) * HALF, head, :],
                       q_s[slot, wg, :, :], barrier=q_full[slot])
        T.mbarrier_arrive(q_full[slot])
        produce_kv(K, V, k_s, v_s, k_full, k_empty, v_full, v_empty, b, head // group,
                   loop_range, it0)

    def kv_blocks(qt):
        return T.min(n_kblocks, T.ceildiv((qt + 1) * BLOCK_M, bn)) if causal else n_kblocks

    def regular_kernel():
        @T.prim_func
        def main(
            Q: T.Tensor([batch, seq_len, heads, head_dim], dtype),
            K: T.Tensor([batch, seq_len, kv_heads, head_dim], dtype),
            V: T.Tensor([batch, seq_len, kv_heads, head_dim_v], dtype),
            Out: T.Tensor([batch, seq_len, heads, head_dim_v], dtype),
        ):
            grid, tile_of = qtile_grid(n_qtiles, heads, batch, cfg.heavy_first)
            with T.Kernel(*grid, threads=CONSUMER_THREADS + 128) as (gx, gy, b):
                qt, head = tile_of(gx, gy)
                q_s = T.alloc_shared([1, 2, HALF, head_dim], dtype)
                k_s = T.alloc_shared([stages, bn, head_dim], dtype)
                v_s = T.alloc_shared([stages, bn, head_dim_v], dtype)
                T.annotate_layout({q_s: make_swizzled_layout(q_s), k_s: make_swizzled_layout(k_s),
                                   v_s: make_swizzled_layout(v_s)})
                q_full = T.alloc_barrier(PRODUCER_WARP)
                k_full = T.alloc_barrier([PRODUCER_WARP] * stages)
                v_full = T.alloc_barrier([PRODUCER_WARP] * stages)
                k_empty = T.alloc_barrier([CONSUMER_THREADS] * stages)
                v_empty = T.alloc_barrier([CONSUMER_THREADS] * stages)
                loop_range = kv_blocks(qt)
                tx = T.get_thread_binding()
                if tx >= CONSUMER_THREADS:
                    T.set_max_nreg(24, 0)
                    if tx < CONSUMER_THREADS + PRODUCER_WARP:
                        producer(Q, K, V, q_s, k_s, v_s, q_full, None, k_full, k_empty, v_full,
                                 v_empty, qt, head, b, loop_range)
                elif tx < 128:
                    T.set_max_nreg(240, 1)
                    consumer(0, Out, q_s, k_s, v_s, q_full, k_full, k_empty, v_full, v_empty, qt,
                             head, b, loop_range)
                else:
                    T.set_max_nreg(240, 1)
                    consumer(1, Out, q_s, k_s, v_s, q_full, k_full, k_empty, v_full, v_empty, qt,
                             head, b, loop_range)

        return main

    def persistent_kernel(num_ctas):
        """One CTA per SM (``num_ctas``) walks one tile per round, rounds alternating direction
        (zigzag: CTA c takes tile c of even rounds and tile #CTAs-1-c of odd ones), tiles
        numbered heaviest first when ``cfg.heavy_first``, heads fastest — or, when the K/V
        exceed half of L2, in groups of RANK_GROUP Q tiles of one head. Without the zigzag CTA
        0 took the heaviest tile of every causal round (measured: slower than the
        non-persistent grid). Q is double-buffered (slot = tile parity), so the next tile's Q
        loads while this tile's O is stored from the other slot."""
        lanes = cfg.cluster  # CTAs walking one list together (a cluster), on adjacent heads
        num_tiles = n_qtiles * heads * batch
        ctas = min(num_ctas, num_tiles) // lanes * lanes
        walkers = ctas // lanes
        rounds, partial = divmod(num_tiles // lanes, walkers)
        big = kv_exceed_half_l2(batch, seq_len, kv_heads, head_dim, head_dim_v, l2_bytes)
        rank_group = RANK_GROUP if big else 1
        head_groups = heads // lanes
        head_batches = head_groups * batch

        def walker_of(cta):
            return cta // lanes if lanes > 1 else cta

        def tiles_of(cta):
            # the last, partial round runs from the low CTAs on even rounds, the high on odd
            w = walker_of(cta)
            in_partial = w < partial if rounds % 2 == 0 else walkers - 1 - w < partial
            return rounds + T.cast(in_partial, "int32")

        def tile_coords(i, cta):
            w = walker_of(cta)
            tile = i * walkers + T.if_then_else(i % 2 == 0, w, walkers - 1 - w)
            rank, head_batch = tile_rank(tile, n_qtiles, head_batches, rank_group,
                                         T.if_then_else)
            qt = n_qtiles - 1 - rank if cfg.heavy_first else rank
            head = head_batch % head_groups
            if lanes > 1:
                head = head * lanes + cta % lanes
            return qt, head, head_batch // head_groups

        @T.macro
        def consumer_tiles(wg, Out, q_s, k_s, v_s, q_full, q_empty, k_full, k_empty, v_full,
                           v_empty, cta, my_tiles):
            """One consumer warpgroup's tiles. Each tile's last PV shares an issue turn with
            the next tile's first QK (``loop.drain_into_next``), so the epilogue runs beside a
            GEMM; the state lives across tiles because that QK writes acc_s for the next."""
            acc_s, p, acc_o, row_max, row_max_prev, row_rescale, block_sum, row_sum = \
                alloc_softmax_state(HALF, bn, head_dim_v, dtype)
            part_sum = loop.alloc_row_sums()
            it0 = T.alloc_var("int32", init=0)  # KV blocks consumed for earlier tiles
            T.mbarrier_wait_parity(q_full[0], 0)
            if cfg.pingpong and wg == 1:
                # WG1 goes first: WG2 pre-pays its arrival on WG1's scheduler barrier.
                T.named_barrier_arrive(schedulers[0], CONSUMER_THREADS)
            loop.first_qk(wg, q_s, 0, k_s, k_full, acc_s, 0)
            for i in T.serial(my_tiles):
                qt, head, b = tile_coords(i, cta)
                row0 = qt * BLOCK_M + wg * HALF
                if loop.fills_o:
                    T.fill(acc_o, 0)
                T.fill(row_sum, 0)
                T.fill(row_max, neg_inf)
                loop.blocks(wg, row0, q_s, k_s, v_s, k_full, k_empty, v_full, v_empty,
                            kv_blocks(qt), acc_s, p, acc_o, row_max, row_max_prev, row_rescale,
                            block_sum, row_sum, part_sum, i % 2, it0)
                loop.drain_into_next(wg, q_s, k_s, v_s, q_full, k_full, v_full, v_empty,
                                     kv_blocks(qt), acc_s, p, acc_o, row_sum, part_sum, it0,
                                     i + 1 < my_tiles, (i + 1) % 2, (i + 1) // 2)
                epilogue(wg, acc_o, row_sum, row_rescale, q_s, i % 2, q_empty,
                         Out[b, row0:row0 + HALF, head, :])
                it0 += kv_blocks(qt)
            T.wait_wgmma(0)  # the throwaway QK after the last tile

        def alloc_kv_empty():
            if lanes == 1:
                return (T.alloc_barrier([CONSUMER_THREADS] * stages),
                        T.alloc_barrier([CONSUMER_THREADS] * stages))
            counts = [CONSUMER_THREADS + (lanes - 1) * CONSUMER_THREADS // 32] * stages
            return T.alloc_cluster_barrier(counts), T.alloc_cluster_barrier(counts)

        @T.prim_func
        def main(
            Q: T.Tensor([batch, seq_len, heads, head_dim], dtype),
            K: T.Tensor([batch, seq_len, kv_heads, head_dim], dtype),
            V: T.Tensor([batch, seq_len, kv_heads, head_dim_v], dtype),
            Out: T.Tensor([batch, seq_len, heads, head_dim_v], dtype),
        ):
            cluster = {"cluster_dims": lanes} if lanes > 1 else {}
            with T.Kernel(ctas, threads=CONSUMER_THREADS + 128, **cluster) as cta:
                q_s = T.alloc_shared([2, 2, HALF, head_dim], dtype)
                k_s = T.alloc_shared([stages, bn, head_dim], dtype)
                v_s = T.alloc_shared([stages, bn, head_dim_v], dtype)
                T.annotate_layout({q_s: make_swizzled_layout(q_s),
                                   k_s: make_swizzled_layout(k_s),
                                   v_s: make_swizzled_layout(v_s)})
                q_full = T.alloc_barrier([PRODUCER_WARP] * 2)
                q_empty = T.alloc_barrier([CONSUMER_THREADS] * 2)
                k_full = T.alloc_barrier([PRODUCER_WARP] * stages)
                v_full = T.alloc_barrier([PRODUCER_WARP] * stages)
                k_empty, v_empty = alloc_kv_empty()
                my_tiles = tiles_of(cta)
                tx = T.get_thread_binding()
                if tx >= CONSUMER_THREADS:
                    T.set_max_nreg(24, 0)
                    if tx < CONSUMER_THREADS + PRODUCER_WARP:
                        it0 = T.alloc_var("int32", init=0)
                        for i in T.serial(my_tiles):
                            qt, head, b = tile_coords(i, cta)
                            producer(Q, K, V, q_s, k_s, v_s, q_full, q_empty, k_full, k_empty,
                                     v_full, v_empty, qt, head, b, kv_blocks(qt), i % 2,
                                     i // 2, it0)
                            it0 += kv_blocks(qt)
                elif tx < 128:
                    T.set_max_nreg(240, 1)
                    consumer_tiles(0, Out, q_s, k_s, v_s, q_full, q_empty, k_full, k_empty,
                                   v_full, v_empty, cta, my_tiles)
                else:
                    T.set_max_nreg(240, 1)
                    consumer_tiles(1, Out, q_s, k_s, v_s, q_full, q_empty, k_full, k_empty,
                                   v_full, v_empty, cta, my_tiles)
                if lanes > 1:
                    T.cluster_sync()  # no CTA exits while its peer may still signal or load into it

        return main

    return persistent_kernel(num_ctas) if cfg.persistent else regular_kernel()


def supports(shape: Shape, pingpong: bool = True, persistent: bool = False) -> bool:
    # persistent double-buffers Q: at D 256 that is 128 KB of Q beside 128 KB of K/V
    return (shape.head_dim, shape.head_dim_v) in (PERSISTENT_HEAD_DIMS if persistent else HEAD_DIMS)


def prim_func_for(shape: Shape, pingpong: bool = True, mainloop_factory=serial_mainloop,
                  persistent: bool = False, cluster: int | None = None):
    """The prim_func the lab runs for a named shape (used by ``ws_lab.emit``; a persistent walk
    is planned for the H100's 132 SMs and 50 MB of L2)."""
    if persistent and cluster is None:
        cluster = cluster_for(shape.batch, shape.seq_len, shape.heads, shape.kv_heads,
                              shape.head_dim, shape.head_dim_v, H100_L2_BYTES)
    return coop_fwd(shape.batch, shape.seq_len, shape.heads, shape.kv_heads, shape.head_dim,
                    shape.head_dim_v, shape.causal, shape.dtype, 1.0 / math.sqrt(shape.head_dim),
                    config_for(shape.head_dim, shape.causal, pingpong, persistent, cluster or 1),
                    mainloop_factory)


def tile_rank(tile, n_qtiles, head_batches, rank_group, select):
    """A persistent walk's tile number -> (rank: 0 = the heaviest Q tile, head + heads·batch).
    Heads fastest, or — rank_group > 1 — full groups of rank_group ranks run one head's ranks
    on consecutive tiles and the ranks past the last full group go heads first. ``select`` is
    ``T.if_then_else`` in the kernel (a Python conditional in tests)."""
    if rank_group == 1:
        return tile // head_batches, tile % head_batches
    per_group = rank_group * head_batches
    grouped = n_qtiles // rank_group * per_group  # tiles in full groups
    rest = tile - grouped
    return (select(tile < grouped, tile // per_group * rank_group + tile % rank_group,
                   n_qtiles // rank_group * rank_group + rest // head_batches),
            select(tile < grouped, tile % per_group // rank_group, rest % head_batches))


def persistent_device_args(device) -> tuple[int, int]:
    """(SMs, L2 bytes) of the device: the persistent walk's CTA count and rank grouping."""
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, props.L2_cache_size


@functools.lru_cache(maxsize=None)
def compiled(*args):
    """The compiled kernel for ``coop_fwd``'s arguments (thread-safe); a mainloop factory with
    ``postproc_passes`` compiles under those passes."""
    factory = inspect.signature(coop_fwd).bind(*args).arguments.get("mainloop_factory")
    passes = getattr(factory, "postproc_passes", ())
    with postproc.active(passes=passes) if passes else contextlib.nullcontext():
        return compile_sm90a(coop_fwd(*args), pass_configs=PASS_CONFIGS)


def compiled_for(batch, seq_len, heads, kv_heads, head_dim, head_dim_v, causal, dtype,
                 softmax_scale, pingpong=True, mainloop_factory=serial_mainloop,
                 persistent=False, cluster=None, device=None):
    """The compiled kernel ``attention`` launches for these arguments (``cluster`` None: the
    persistent walk's ``cluster_for`` on ``device``'s L2; the grid sized to its SMs)."""
    extra = persistent_device_args(device) if persistent else ()
    if persistent and cluster is None:
        cluster = cluster_for(batch, seq_len, heads, kv_heads, head_dim, head_dim_v, extra[1])
    cfg = config_for(head_dim, bool(causal), pingpong, persistent, cluster or 1)
    return compiled(batch, seq_len, heads, kv_heads, head_dim, head_dim_v, bool(causal), dtype,
                    softmax_scale, cfg, mainloop_factory, *extra)


def attention(q, k, v, causal=False, softmax_scale=None, out=None, pingpong: bool = True,
              mainloop_factory=serial_mainloop, persistent: bool = False,
              cluster: int | None = None):
    """BSHD GQA forward. q (B,S,Hq,D), k (B,S,Hkv,D), v (B,S,Hkv,D) fp16/bf16 on CUDA; D 64/128/256
    (64/128 when persistent). ``cluster`` (persistent): 2 forces the K/V-multicast CTA pair, 1
    single CTAs, None picks by ``cluster_for``."""
    dims = validate_attention_inputs(
        q, k, v, supported_head_dims=PERSISTENT_HEAD_DIMS if persistent else HEAD_DIMS, out=out,
        softmax_scale=softmax_scale, causal=causal)
    kernel = compiled_for(dims.batch, dims.seq_len, dims.heads, dims.kv_heads, dims.head_dim,
                          dims.head_dim_v, causal, dims.tl_dtype, dims.softmax_scale, pingpong,
                          mainloop_factory, persistent, cluster, q.device)
    if out is None:
        out = torch.empty(*q.shape[:3], dims.head_dim_v, dtype=q.dtype, device=q.device)
    kernel(q, k, v, out)
    return out
