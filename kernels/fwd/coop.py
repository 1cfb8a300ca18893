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
``kernels/fwd/coop_overlap.py`` plugs in FA3's IntraWGOverlap loop and shares everything else).

Persistent (``Config.persistent``, FA3 ``StaticPersistentTileScheduler``; D 64/128): one CTA per
SM walks one tile per round, numbered heaviest first, rounds zigzagging, in groups of 16 Q tiles
of one head when the K/V exceed half of L2 (``tile_rank``); the K/V ring's stage/phase run on
across tiles (``it0``), Q is double-buffered by tile parity behind q_full[2] / q_empty[2] (256:
both consumers, once their O store has read the slot), so the next tile's Q and K/V stream in
while this tile's O is stored, and each tile's last PV shares an issue turn with the next
tile's first QK (the mainloop's ``drain_into_next``). Pingpong's pre-paid turn is taken once
per CTA. ``Config.q_slots`` = 1 is FA3's form: one Q slot, the producer loads each tile's K_0
before its Q (the slot frees once the previous O store has read it), and each tile runs whole
(``loop.tile``) before its epilogue; at D 128 it fits FA3's 176-key blocks (208 KB, 212 with
the anchors). Lowered without spills for train8b-8k, not yet run on a GPU (notes/coop_overlap.md,
"Session 44").

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
FP8 (``dtype`` "float8_e4m3fn"; ``kernels/fwd/fp8.py``'s "coop-overlap" and
"coop-overlap-persistent" designs): Q and K e4m3, V given as Vᵀ (B, Hkv, Dv, S_pad) so its (Dv,
bn) block is K-major as e4m3 wgmma needs, the (B, Hkv) descales of Q and K folded into the
softmax scale at run time (``SoftmaxState.scale_log2``) and V's into O. A plain e4m3 copy of
the scores is no RS operand in TileLang 0.1.15 (a key reorder makes one, but P held across the
PV wait took the consumer past 240 registers: notes/fp8.md, "Session 40"), so each warpgroup
stores its P to a tile of its own (``KVStages.p_s``, 2 × 64 × bn), fences and waits on its 128
threads' barrier (``NamedBarrier.FP8_P_WG1/2``) before its SS PV GEMM; the other warpgroup
never waits for it. O (bf16) leaves through its own tile (2 × 64 × Dv), Q's e4m3 slot being
half its size. Shared memory at D 128, bn 256 (``fp8.coop_config_for``): Q 16 + K/Vᵀ 128 + P
32 + O 32 KB (+ 4 KB of anchors) = 212 KB.
``Config.transpose_v`` (P in registers, non-persistent): V read as stored into a source ring
and made into Vᵀ by the whole producer warpgroup (still setmaxnreg 24;
``kernels/fwd/v_transpose.py``), +56 KB at bn 224.
Persistent, bn 256: Q 2 · 16 + K/Vᵀ 128 + P 32 KB + anchors = 196 KB; a bf16 O tile would pass
the 227 KB, so O goes from registers to global memory (bounded stores) and the Q slot is handed
back at once; the walk's L2 rules count 1-byte K / V. Persistent with P in registers (bn 224):
Q 2 · 16 + K/Vᵀ 112 + O 32 KB = 176 KB, so O keeps its tile and TMA store (FA3's epilogue), the
tile reused once the last store has read it (its issuing thread waits; the warpgroup's epilogue
barrier orders the rest).
TileLang's automatic barrier insertion is off (``tl.disable_thread_storage_sync``): it would put
``__syncthreads()`` where only some warpgroups arrive. Its shared-memory reuse is off too
(``tl.disable_shared_memory_reuse``): without those syncs, reusing a buffer's bytes for another
is a race (tilelang #2416); the one reuse here, O into Q, is explicit and per warpgroup.
"""

import contextlib
import dataclasses
import functools
import inspect
import math
from dataclasses import dataclass
from typing import Callable

import tilelang
import tilelang.language as T
import torch
from tilelang.layout import make_swizzled_layout

from ws_lab import postproc
from ws_lab.check import Support, head_dims_supported, validate_attention_inputs
from ws_lab.kernels import LOG2E
from ws_lab.kernels.fwd.barriers import EPILOGUES, FP8_P_BARRIERS, WARP_SCHEDULERS, NamedBarrier
from ws_lab.kernels.fwd.pipeline import KVRing
from ws_lab.kernels.fwd.softmax import (FP8_PROB_LOG2_OFFSET, SoftmaxState, alloc_softmax_state,
                                        normalize_o, online_softmax, score_mask)
from ws_lab.kernels.fwd.tile_scheduler import (RANK_GROUP, PersistentScheduler, cluster_for,
                                               kv_exceed_half_l2, persistent_device_args,
                                               qtile_grid)
from ws_lab.kernels.fwd.v_transpose import TRANSPOSE_THREADS, transposing_producer
from ws_lab.shapes import Shape
from ws_lab.target import H100_L2_BYTES, H100_SMS, compile_sm90a

BLOCK_M = 128  # two consumer warpgroups × 64 rows
FP8_DTYPE = "float8_e4m3fn"  # the dtype that makes coop_fwd the FP8 kernel
HALF = BLOCK_M // 2
CONSUMER_THREADS = 256
PRODUCER_WARP = 32

PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,
    tilelang.PassConfigKey.TL_DISABLE_SHARED_MEMORY_REUSE: True,
    tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
}


@dataclass(frozen=True)
class Config:
    block_n: int
    num_stages: int
    pingpong: bool
    heavy_first: bool = False
    persistent: bool = False  # one CTA per SM walking a static, heavy-first list of tiles
    cluster: int = 1  # persistent: 2 = CTA pairs on two Q heads of one KV head, K/V multicast
    # FP8: P from registers (RS) in the operand key order (``operand_key``), Vᵀ's keys in it too
    p_in_registers: bool = False
    # FP8 with P in registers: V read as stored and transposed in shared memory by the producer
    # warpgroup (FA3's Transpose_V; kernels/fwd/v_transpose.py), no Vᵀ pass before the kernel
    transpose_v: bool = False
    # persistent: Q slots. 2: the next tile's Q loads while this tile's O is stored and its
    # first QK shares a turn with this tile's last PV; 1: FA3's (K_0 loads before Q, the
    # epilogue runs alone), which leaves room for FA3's 176-key blocks: correct, not faster
    # (train8b-8k +0.5 %, causal rows −2 to −10 %; notes/coop_overlap.md "Session 45")
    q_slots: int = 2
    # FA3's walk: key block n − 1 − kb at iteration kb, so a causal tile's masked (diagonal)
    # blocks come first and the first is the prologue's (notes/fp8.md "Session 59"). The
    # IntraWGOverlap kernels take it (persistent: with two Q slots)
    kv_descending: bool = False


CONFIGS = {
    64: Config(128, 2, True),
    128: Config(128, 2, True),
    256: Config(64, 2, True),
}
HEAD_DIMS = sorted((d, d) for d in CONFIGS)
PERSISTENT_HEAD_DIMS = [(64, 64), (128, 128)]


def config_for(head_dim: int, causal: bool, pingpong: bool = True,
               persistent: bool = False, cluster: int = 1, kv_descending: bool = False) -> Config:
    base = CONFIGS[head_dim]
    return Config(base.block_n, base.num_stages, pingpong, heavy_first=causal,
                  persistent=persistent, cluster=cluster, kv_descending=kv_descending)


@dataclass(frozen=True)
class KVStages:
    """The K/V ring as a kernel allocated it: shared-memory stages and their mbarriers
    (``barriers.py`` names their roles). Macros take it whole."""
    k_s: object
    v_s: object
    k_full: object
    k_empty: object
    v_full: object
    v_empty: object
    p_s: object = None  # FP8: each warpgroup's P tile, the PV GEMM's A operand (2, 64, bn)


@dataclass(frozen=True)
class Fp8Epilogue:
    """What an FP8 kernel's consumer needs beyond the bf16 one's: the (B, Hkv) descales (Q's
    and K's fold into the softmax scale, V's into O) and O's own bf16 staging tile (2, 64, Dv):
    Q's e4m3 slot is half its size, so O cannot reuse it."""
    q_descale: object
    k_descale: object
    v_descale: object
    o_s: object


def swizzled(*buffers) -> dict:
    """TileLang's swizzled layout for each shared buffer given (None: not allocated)."""
    return {buf: make_swizzled_layout(buf) for buf in buffers if buf is not None}


def kv_loaders(bn: int, stages: int, v_parts: int = 1, cluster: int = 1,
               v_transposed: bool = False):
    """(load_k, load_v): the producer warp's loads of block kb's K and V, each once its stage
    is free, TMA into k_s[stage] / v_s[stage] (V in ``v_parts`` column slices v_s[stage, part]
    when a consumer warpgroup owns each slice, as in largehdv). ``cluster`` 2: the pair's
    rank-0 CTA multicasts each load into both CTAs (the stage's empty barrier then counts the
    peer's consumer warps too); the other CTA only expects the bytes. ``v_transposed`` (FP8):
    V is Vᵀ (B, Hkv, Dv, S_pad) and v_s[stage] its (Dv, bn) block. ``it0``: the blocks this
    CTA streamed for earlier tiles. ``key``: the key block loaded into block kb's stage (kb
    unless the walk is descending)."""
    mask = (1 << cluster) - 1 if cluster > 1 else None
    ring = KVRing(stages)

    def rows(kb, key):
        """The key rows of block ``key`` (None: kb's own), for the stage of iteration kb."""
        first = kb if key is None else key
        return slice(first * bn, (first + 1) * bn)

    @T.macro
    def load_k(K, kv: KVStages, b, kv_head, kb, it0, key=None):
        stage, phase = ring.at(it0 + kb)
        T.mbarrier_wait_parity(kv.k_empty[stage], phase ^ 1)
        T.tma_copy(K[b, rows(kb, key), kv_head, :], kv.k_s[stage, :, :],
                   barrier=kv.k_full[stage], cluster_mask=mask)
        T.mbarrier_arrive(kv.k_full[stage])

    @T.macro
    def load_v(V, kv: KVStages, b, kv_head, kb, it0, key=None):
        stage, phase = ring.at(it0 + kb)
        T.mbarrier_wait_parity(kv.v_empty[stage], phase ^ 1)
        if v_transposed:
            T.tma_copy(V[b, kv_head, :, rows(kb, key)], kv.v_s[stage, :, :],
                       barrier=kv.v_full[stage], cluster_mask=mask)
        elif v_parts == 1:
            T.tma_copy(V[b, rows(kb, key), kv_head, :], kv.v_s[stage, :, :],
                       barrier=kv.v_full[stage], cluster_mask=mask)
        else:
            width = kv.v_s.shape[-1]
            for part in T.unroll(v_parts):
                T.tma_copy(V[b, rows(kb, key), kv_head, part * width:(part + 1) * width],
                           kv.v_s[stage, part, :, :], barrier=kv.v_full[stage])
        T.mbarrier_arrive(kv.v_full[stage])

    return load_k, load_v


def kv_producer(bn: int, stages: int, v_parts: int = 1, cluster: int = 1,
                v_transposed: bool = False, descending: bool = False):
    """The producer warp's KV loop, shared by every WS kernel of the lab: per block, K then V
    (``kv_loaders``, which takes the same arguments); ``descending``: key block
    ``loop_range − 1 − kb`` at iteration kb (``Config.kv_descending``)."""
    load_k, load_v = kv_loaders(bn, stages, v_parts, cluster, v_transposed)

    @T.macro
    def produce(K, V, kv: KVStages, b, kv_head, loop_range, it0=0):
        for kb in T.serial(loop_range):
            key = loop_range - 1 - kb if descending else None
            load_k(K, kv, b, kv_head, kb, it0, key)
            load_v(V, kv, b, kv_head, kb, it0, key)

    return produce


@T.macro
def store_o(acc_o, o_s, out, barrier_id):
    """Epilogue of one consumer warpgroup: its normalized O tile → o_s (smem it alone owns now)
    → fence.proxy.async → named barrier of its 128 threads → TMA store into ``out``."""
    T.copy(acc_o, o_s)
    T.fence_proxy_async()
    T.sync_threads(barrier_id, 128)
    T.copy(o_s, out)


@dataclass(frozen=True)
class MainloopContext:
    """What ``coop_fwd`` hands a mainloop factory (FA3's mainloop ``Params``): the kernel's
    trace-time constants and the macros every mainloop shares."""
    bn: int
    ring: KVRing
    pingpong: bool
    causal: bool
    seq_len: int
    s_regs: int  # fp32 registers a thread holds of a 64 × bn accumulator
    o_regs: int
    p_regs: int  # 32-bit registers a thread holds of P (input dtype: e4m3 packs 4 a register)
    head_dim_v: int
    scale_log2: float
    prob_log2_offset: float  # P = exp2(s·scale − max·scale + this): FP8's 8, else 0
    mask: Callable  # score_mask's macro: mask(acc_s, kb, row0)
    issue_qk: Callable  # issue_qk(wg, q_s, slot, kv, stage, phase, acc_s)
    release: Callable  # release(empty, stage)
    issue_pv: Callable  # issue_pv(wg, st, kv, stage, clear): O (+)= P V of the stage, no wait
    # commit_p(wg, st, kv): P (in registers) made readable by issue_pv; None where issue_pv
    # reads the registers themselves (RS)
    commit_p: Callable | None = None
    copy_p: Callable = T.copy  # copy_p(acc_s, p): the scores as P (FP8 RS: operand key order)
    schedulers: tuple = WARP_SCHEDULERS
    kv_descending: bool = False  # Config.kv_descending: iteration kb holds key block n − 1 − kb

    def scale(self, st: SoftmaxState):
        """scale·log2 e for the softmax of ``st``'s tile (FP8: the run-time descaled one)."""
        return self.scale_log2 if st.scale_log2 is None else st.scale_log2[0]


@dataclass(frozen=True)
class Mainloop:
    """A mainloop factory's answer (FA3's ``CollectiveMainloopFwd::mma``): ``tile(wg, row0,
    q_s, kv, loop_range, st, slot, it0)`` runs one tile's KV loop. The persistent kernel also
    needs the pieces that let a tile's last PV share an issue turn with the next tile's first QK
    (``first_qk``, ``blocks``, ``drain_into_next``, ``alloc_row_sums``). ``fills_o``: whether
    the consumer zero-fills O before a tile (False: the first PV overwrites it)."""
    tile: Callable
    fills_o: bool = True
    first_qk: Callable | None = None
    blocks: Callable | None = None
    drain_into_next: Callable | None = None
    alloc_row_sums: Callable | None = None

    @property
    def runs_persistent(self) -> bool:
        return self.drain_into_next is not None


def serial_mainloop(t: MainloopContext) -> Mainloop:
    """FA3's mainloop without IntraWGOverlap: per KV block, S = Q Kᵀ → wait → softmax → O += P V
    → wait. ``kernels/fwd/coop_overlap.py`` is the other factory."""
    if t.kv_descending:
        raise ValueError("kv_descending is the IntraWGOverlap mainloop's (kernels.coop_overlap)")

    @T.macro
    def mainloop(wg, row0, q_s, kv: KVStages, loop_range, st: SoftmaxState, slot, it0):
        for kb in T.serial(loop_range):
            stage, phase = t.ring.at(it0 + kb)
            t.issue_qk(wg, q_s, slot, kv, stage, phase, st.acc_s)
            if t.pingpong:
                T.named_barrier_arrive(t.schedulers[1 - wg], CONSUMER_THREADS)
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(st.acc_s, num_regs=t.s_regs)
            t.release(kv.k_empty, stage)

            t.mask(st.acc_s, kb, row0)
            online_softmax(st.acc_s, st.p, st.acc_o, st.row_max, st.row_max_prev,
                           st.row_rescale, st.block_sum, st.row_sum, HALF, t.bn, t.head_dim_v,
                           t.scale(st), t.copy_p, t.prob_log2_offset)
            if t.commit_p is not None:
                t.commit_p(wg, st, kv)

            T.mbarrier_wait_parity(kv.v_full[stage], phase)
            t.issue_pv(wg, st, kv, stage, False)
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(st.acc_o, num_regs=t.o_regs)
            t.release(kv.v_empty, stage)

    return Mainloop(tile=mainloop)


def operand_key(a):
    """The score column that FP8 P's column ``a`` takes (FA3's column permutation): within 16
    columns the fp32 accumulator gives a thread columns 2q, 2q+1, 2q+8, 2q+9 (q = lane % 4), the
    e4m3 A operand 4q … 4q+3, so P's column 4u + 2v + w holds score column 8v + 2u + w and no
    register moves between threads (notes/fp8.md, "Session 40")."""
    return a - a % 16 + (a % 4 // 2) * 8 + (a % 16 // 4) * 2 + a % 2


@T.macro
def copy_p_operand_order(acc_s, p):
    for i, a in T.Parallel(HALF, acc_s.shape[1]):
        p[i, a] = acc_s[i, operand_key(a)]


def pv_issuer(fp8: bool, cfg: Config, issue_pv, issue_pv_fp8, issue_pv_fp8_rs):
    """The PV GEMM's macro: RS on the input dtype; FP8 SS through P's tile, or RS."""
    if cfg.p_in_registers and not fp8:
        raise ValueError("p_in_registers is the FP8 kernel's option (bf16 / fp16 P is RS)")
    if not fp8:
        return issue_pv
    return issue_pv_fp8_rs if cfg.p_in_registers else issue_pv_fp8


def coop_fwd(batch, seq_len, heads, kv_heads, head_dim, head_dim_v, causal, dtype, softmax_scale,
             cfg: Config, mainloop_factory=serial_mainloop, num_ctas=H100_SMS,
             l2_bytes=H100_L2_BYTES):
    """q (B,S,Hq,D), k (B,S,Hkv,D), v (B,S,Hkv,Dv) -> out (B,S,Hq,Dv). The producer, consumer
    setup and epilogue are shared; ``mainloop_factory(MainloopContext)`` gives the consumer's
    KV loop."""
    bn, stages = cfg.block_n, cfg.num_stages
    group = heads // kv_heads
    fp8 = dtype == FP8_DTYPE
    scale_log2 = softmax_scale * LOG2E
    accum = "float"
    neg_inf = -T.infinity(accum)
    n_qtiles = (seq_len + BLOCK_M - 1) // BLOCK_M
    n_kblocks = (seq_len + bn - 1) // bn

    mask = score_mask(causal, seq_len, HALF, bn, accum)

    @T.macro
    def issue_qk(wg, q_s, slot, kv: KVStages, stage, phase, acc_s):
        """Wait for K, take this warpgroup's pingpong turn, issue S = Q Kᵀ (no wait)."""
        T.mbarrier_wait_parity(kv.k_full[stage], phase)
        if cfg.pingpong:
            T.sync_threads(WARP_SCHEDULERS[wg], CONSUMER_THREADS)
        T.wgmma_gemm(q_s[slot, wg, :, :], kv.k_s[stage, :, :], acc_s, transpose_B=True,
                     clear_accum=True)

    @T.macro
    def release(empty, stage):
        """A consumer thread frees a K/V stage. In a cluster the stage's next load lands in
        both CTAs, so lane 0 of each warp frees it in the peer CTA too."""
        T.mbarrier_arrive(empty[stage])
        if cfg.cluster > 1:
            if T.get_thread_binding() % 32 == 0:
                T.mbarrier_arrive(empty[stage], 1 - T.block_rank_in_cluster())

    @T.macro
    def issue_pv(wg, st: SoftmaxState, kv: KVStages, stage, clear):
        """O (+)= P V: P from registers (RS), V as stored."""
        T.wgmma_gemm(st.p, kv.v_s[stage, :, :], st.acc_o, clear_accum=clear)

    @T.macro
    def issue_pv_fp8(wg, st: SoftmaxState, kv: KVStages, stage, clear):
        """O (+)= P Vᵀᵀ on e4m3 wgmma: both operands K-major from shared memory (P's tile of
        this warpgroup, the stage's Vᵀ block)."""
        T.wgmma_gemm(kv.p_s[wg, :, :], kv.v_s[stage, :, :], st.acc_o, transpose_B=True,
                     clear_accum=clear)

    @T.macro
    def issue_pv_fp8_rs(wg, st: SoftmaxState, kv: KVStages, stage, clear):
        """O (+)= P Vᵀᵀ on e4m3 wgmma, P from registers: its columns and Vᵀ's keys are both in
        the operand key order, so the sum over keys is unchanged."""
        T.wgmma_gemm(st.p, kv.v_s[stage, :, :], st.acc_o, transpose_B=True, clear_accum=clear)

    @T.macro
    def commit_p_fp8(wg, st: SoftmaxState, kv: KVStages):
        """P (e4m3 registers) → this warpgroup's tile → fence.proxy.async → its 128 threads'
        barrier: only this warpgroup's PV GEMM reads the tile, so the other never waits."""
        T.copy(st.p, kv.p_s[wg, :, :])
        T.fence_proxy_async()
        T.sync_threads(FP8_P_BARRIERS[wg], 128)

    t = MainloopContext(bn=bn, ring=KVRing(stages), pingpong=cfg.pingpong, causal=causal,
                        seq_len=seq_len, s_regs=HALF * bn // 128, o_regs=HALF * head_dim_v // 128,
                        p_regs=HALF * bn * (1 if fp8 else 2) // 512, head_dim_v=head_dim_v,
                        scale_log2=scale_log2,
                        prob_log2_offset=FP8_PROB_LOG2_OFFSET if fp8 else 0.0, mask=mask,
                        issue_qk=issue_qk, release=release,
                        issue_pv=pv_issuer(fp8, cfg, issue_pv, issue_pv_fp8, issue_pv_fp8_rs),
                        commit_p=commit_p_fp8 if fp8 and not cfg.p_in_registers else None,
                        copy_p=copy_p_operand_order if cfg.p_in_registers else T.copy,
                        kv_descending=cfg.kv_descending)
    if cfg.kv_descending and (cfg.q_slots == 1 or cfg.transpose_v):
        raise ValueError("kv_descending runs without transpose_v and, persistent, with two Q "
                         "slots (the transposing and the one-slot producers load ascending)")
    loop = mainloop_factory(t)
    if cfg.q_slots not in (1, 2) or (cfg.q_slots == 1 and not cfg.persistent):
        raise ValueError(f"q_slots={cfg.q_slots}: the persistent kernel holds 1 or 2 Q slots; "
                         "the non-persistent grid 1 (leave it at its default)")
    if cfg.cluster not in (1, 2) or (cfg.cluster == 2 and not cfg.persistent):
        raise ValueError(f"cluster={cfg.cluster}: the persistent kernel runs CTA pairs (2) or "
                         "single CTAs (1); the non-persistent grid only single CTAs")
    if group % cfg.cluster:
        raise ValueError(f"cluster={cfg.cluster} pairs two Q heads of one KV head: the GQA group "
                         f"({heads} / {kv_heads} = {group}) must be even")
    if cfg.transpose_v and not (fp8 and cfg.p_in_registers and not cfg.persistent):
        raise ValueError("transpose_v is the non-persistent FP8 kernel's option with P in "
                         "registers (its Vᵀ keys come out in the operand key order)")
    if cfg.persistent and not loop.runs_persistent:
        raise ValueError("the persistent kernel needs a mainloop whose last PV can share an issue "
                         "turn with the next tile's first QK (kernels.coop_overlap)")
    v_given_transposed = fp8 and not cfg.transpose_v
    produce_kv = kv_producer(bn, stages, cluster=cfg.cluster, v_transposed=v_given_transposed,
                             descending=cfg.kv_descending)
    load_k, load_v = kv_loaders(bn, stages, cluster=cfg.cluster, v_transposed=v_given_transposed)
    produce_transposing = (transposing_producer(bn, stages, head_dim_v, load_k, load_v)
                           if cfg.transpose_v else None)

    @T.macro
    def epilogue(wg, st: SoftmaxState, q_s, slot, q_empty, out_tile, f8: Fp8Epilogue, kvh, b):
        """O / l → this warpgroup's half of the tile's Q slot (its last QK GEMM has retired)
        → TMA store; persistent: hand the slot back once the store has read it. FP8: O · V's
        descale → its own bf16 tile → TMA store, or (persistent at bn 256, no O tile) registers
        → global memory; the Q slot goes back at once."""
        normalize_o(st.acc_o, st.row_sum, st.row_rescale, HALF, head_dim_v)
        if fp8:
            for i, j in T.Parallel(HALF, head_dim_v):
                st.acc_o[i, j] *= f8.v_descale[b, kvh]
            if f8.o_s is None:  # persistent at bn 256: no room for O's tile
                T.copy(st.acc_o, out_tile)
            else:
                if cfg.persistent:  # the last tile's O store has read o_s (its thread waited)
                    T.sync_threads(EPILOGUES[wg], 128)
                store_o(st.acc_o, f8.o_s[wg, :, :], out_tile, EPILOGUES[wg])
        else:
            store_o(st.acc_o, q_s[slot, wg, :, :], out_tile, EPILOGUES[wg])
        if cfg.persistent:
            if not fp8:  # the store's TMA has read the slot (its issuing thread waited)
                T.sync_threads(EPILOGUES[wg], 128)
            T.mbarrier_arrive(q_empty[slot])

    @T.macro
    def reset_rows(st: SoftmaxState):
        """A tile's softmax starts from no rows seen (and, unless the mainloop's first PV
        overwrites it, from O = 0)."""
        if loop.fills_o:
            T.fill(st.acc_o, 0)
        T.fill(st.row_sum, 0)
        T.fill(st.row_max, neg_inf)

    def alloc_state():
        """A consumer's softmax state; FP8: with a run-time scale (``set_scale``)."""
        st = alloc_softmax_state(HALF, bn, head_dim_v, dtype)
        if fp8:
            st = dataclasses.replace(st, scale_log2=T.alloc_local([1], accum))
        return st

    @T.macro
    def set_scale(st: SoftmaxState, f8: Fp8Epilogue, head, b):
        """FP8: the scores' scale·log2 e with the tile's Q and K descales folded in (FA3's way)."""
        st.scale_log2[0] = scale_log2 * f8.q_descale[b, head // group] * f8.k_descale[
            b, head // group]

    @T.macro
    def consumer(wg, Out, q_s, kv: KVStages, q_full, qt, head, b, loop_range,
                 f8: Fp8Epilogue = None):
        """One consumer warpgroup's tile (the non-persistent grid)."""
        row0 = qt * BLOCK_M + wg * HALF  # first query row of this warpgroup
        st = alloc_state()
        if fp8:
            set_scale(st, f8, head, b)
        reset_rows(st)
        T.mbarrier_wait_parity(q_full[0], 0)
        if cfg.pingpong and wg == 1:
            # WG1 goes first: WG2 pre-pays its arrival on WG1's scheduler barrier.
            T.named_barrier_arrive(WARP_SCHEDULERS[0], CONSUMER_THREADS)
        loop.tile(wg, row0, q_s, kv, loop_range, st, 0, 0)
        epilogue(wg, st, q_s, 0, None, Out[b, row0:row0 + HALF, head, :], f8, head // group, b)

    @T.macro
    def load_q(Q, q_s, q_full, q_empty, qt, head, b, slot, use):
        """Both Q halves into the tile's slot (persistent: once the slot's last O store has
        read it)."""
        if cfg.persistent:
            T.mbarrier_wait_parity(q_empty[slot], (use % 2) ^ 1)
        for wg in T.unroll(2):
            T.tma_copy(Q[b, qt * BLOCK_M + wg * HALF:qt * BLOCK_M + (wg + 1) * HALF, head, :],
                       q_s[slot, wg, :, :], barrier=q_full[slot])
        T.mbarrier_arrive(q_full[slot])

    @T.macro
    def producer(Q, K, V, q_s, kv: KVStages, q_full, q_empty, qt, head, b, loop_range, slot=0,
                 use=0, it0=0):
        """The producer warp's tile: Q into the tile's slot, then the KV stream."""
        load_q(Q, q_s, q_full, q_empty, qt, head, b, slot, use)
        produce_kv(K, V, kv, b, head // group, loop_range, it0)

    @T.macro
    def producer_one_slot(Q, K, V, q_s, kv: KVStages, q_full, q_empty, qt, head, b,
                          loop_range, use, it0):
        """The producer warp's tile with one Q slot (FA3's order): K_0, then Q (the slot is
        free only once the previous tile's O store has read it; K_0 need not wait for that),
        then V_0 and the rest of the stream."""
        for kb in T.serial(loop_range):
            load_k(K, kv, b, head // group, kb, it0)
            if kb == 0:
                load_q(Q, q_s, q_full, q_empty, qt, head, b, 0, use)
            load_v(V, kv, b, head // group, kb, it0)

    def kv_blocks(qt):
        return T.min(n_kblocks, T.ceildiv((qt + 1) * BLOCK_M, bn)) if causal else n_kblocks

    @T.macro
    def regular_body(Q, K, V, Out, f8_descales):
        """One CTA a tile: the buffers, the roles and their register budgets. FP8: V is Vᵀ,
        each warpgroup has a P tile and O a bf16 tile of its own."""
        grid, tile_of = qtile_grid(n_qtiles, heads, batch, cfg.heavy_first)
        with T.Kernel(*grid, threads=CONSUMER_THREADS + 128) as (gx, gy, b):
            qt, head = tile_of(gx, gy)
            q_s = T.alloc_shared([1, 2, HALF, head_dim], dtype)
            k_s = T.alloc_shared([stages, bn, head_dim], dtype)
            v_s = T.alloc_shared([stages, head_dim_v, bn] if fp8 else [stages, bn, head_dim_v],
                                 dtype)
            # transpose_v: V's blocks as stored, the transposing warps' source
            vsrc_s = T.alloc_shared([stages, bn, head_dim_v], dtype) if cfg.transpose_v else None
            T.annotate_layout(swizzled(q_s, k_s, v_s, vsrc_s))
            q_full = T.alloc_barrier(PRODUCER_WARP)
            k_full = T.alloc_barrier([PRODUCER_WARP] * stages)
            v_full = T.alloc_barrier([TRANSPOSE_THREADS if cfg.transpose_v else PRODUCER_WARP]
                                     * stages)
            k_empty = T.alloc_barrier([CONSUMER_THREADS] * stages)
            v_empty = T.alloc_barrier([CONSUMER_THREADS] * stages)
            if fp8:
                p_s = None if cfg.p_in_registers else T.alloc_shared([2, HALF, bn], dtype)
                o_s = T.alloc_shared([2, HALF, head_dim_v], "bfloat16")
                kv = KVStages(k_s, v_s, k_full, k_empty, v_full, v_empty, p_s)
                f8 = Fp8Epilogue(*f8_descales, o_s)
            else:
                kv = KVStages(k_s, v_s, k_full, k_empty, v_full, v_empty)
                f8 = None
            if cfg.transpose_v:  # what the TMA warp fills: K's ring and V's source ring
                vsrc_full = T.alloc_barrier([PRODUCER_WARP] * stages)
                vsrc_empty = T.alloc_barrier([TRANSPOSE_THREADS] * stages)
                loaded = KVStages(k_s, vsrc_s, k_full, k_empty, vsrc_full, vsrc_empty)
            loop_range = kv_blocks(qt)
            tx = T.get_thread_binding()
            if tx >= CONSUMER_THREADS:
                T.set_max_nreg(24, 0)
                if cfg.transpose_v:
                    if tx < CONSUMER_THREADS + PRODUCER_WARP:
                        load_q(Q, q_s, q_full, None, qt, head, b, 0, 0)
                    produce_transposing(K, V, loaded, kv, b, head // group, loop_range,
                                        (tx - CONSUMER_THREADS) // 32, tx % 32)
                elif tx < CONSUMER_THREADS + PRODUCER_WARP:
                    producer(Q, K, V, q_s, kv, q_full, None, qt, head, b, loop_range)
            elif tx < 128:
                T.set_max_nreg(240, 1)
                consumer(0, Out, q_s, kv, q_full, qt, head, b, loop_range, f8)
            else:
                T.set_max_nreg(240, 1)
                consumer(1, Out, q_s, kv, q_full, qt, head, b, loop_range, f8)

    def prim_func(body):
        """The kernel's entry: ``body(Q, K, V, Out, descales)`` under the bf16 signature or
        the FP8 one (Vᵀ, the three descales, bf16 O)."""
        if fp8:
            return prim_func_fp8(body)

        @T.prim_func
        def main(
            Q: T.Tensor([batch, seq_len, heads, head_dim], dtype),
            K: T.Tensor([batch, seq_len, kv_heads, head_dim], dtype),
            V: T.Tensor([batch, seq_len, kv_heads, head_dim_v], dtype),
            Out: T.Tensor([batch, seq_len, heads, head_dim_v], dtype),
        ):
            body(Q, K, V, Out, None)

        return main

    def prim_func_fp8(body):
        seq_pad = (seq_len + bn - 1) // bn * bn

        # a fresh annotation per parameter (tests/upstream/test_shared_annotation.py)
        def descale_t():
            return T.Tensor([batch, kv_heads], accum)

        # V as stored when the kernel transposes it, else Vᵀ from the wrapper's pass
        v_shape = ([batch, seq_len, kv_heads, head_dim_v] if cfg.transpose_v else
                   [batch, kv_heads, head_dim_v, seq_pad])

        @T.prim_func
        def main_fp8(
            Q: T.Tensor([batch, seq_len, heads, head_dim], dtype),
            K: T.Tensor([batch, seq_len, kv_heads, head_dim], dtype),
            Vt: T.Tensor(v_shape, dtype),
            QDescale: descale_t(),
            KDescale: descale_t(),
            VDescale: descale_t(),
            Out: T.Tensor([batch, seq_len, heads, head_dim_v], "bfloat16"),
        ):
            body(Q, K, Vt, Out, (QDescale, KDescale, VDescale))

        return main_fp8

    def persistent_kernel(num_ctas):
        """One CTA per SM (``num_ctas``) walks the ``PersistentScheduler``'s tiles (heads
        fastest, or RANK_GROUP Q tiles of one head when the K/V exceed half of L2). Q is
        double-buffered (slot = tile parity), so the next tile's Q loads while this tile's O is
        stored from the other slot."""
        lanes = cfg.cluster  # CTAs walking one list together (a cluster), on adjacent heads
        big = kv_exceed_half_l2(batch, seq_len, kv_heads, head_dim, head_dim_v, l2_bytes,
                                1 if fp8 else 2)
        sched = PersistentScheduler(n_qtiles, heads, batch, num_ctas, lanes,
                                    RANK_GROUP if big else 1, cfg.heavy_first)

        @T.macro
        def consumer_tiles_one_slot(wg, Out, q_s, kv: KVStages, q_full, q_empty, cta, my_tiles,
                                    f8: Fp8Epilogue = None):
            """One consumer warpgroup's tiles with one Q slot (FA3's): each tile whole
            (``loop.tile``: its first QK, its blocks, its last PV drained), then its epilogue,
            which hands the slot back for the next tile's Q."""
            st = alloc_state()
            it0 = T.alloc_var("int32", init=0)  # KV blocks consumed for earlier tiles
            if cfg.pingpong and wg == 1:
                # WG1 goes first: WG2 pre-pays its arrival on WG1's scheduler barrier.
                T.named_barrier_arrive(WARP_SCHEDULERS[0], CONSUMER_THREADS)
            for i in T.serial(my_tiles):
                qt, head, b = sched.tile_coords(i, cta)
                row0 = qt * BLOCK_M + wg * HALF
                if fp8:
                    set_scale(st, f8, head, b)
                reset_rows(st)
                T.mbarrier_wait_parity(q_full[0], i % 2)
                loop.tile(wg, row0, q_s, kv, kv_blocks(qt), st, 0, it0)
                epilogue(wg, st, q_s, 0, q_empty, Out[b, row0:row0 + HALF, head, :], f8,
                         head // group, b)
                it0 += kv_blocks(qt)

        @T.macro
        def consumer_tiles(wg, Out, q_s, kv: KVStages, q_full, q_empty, cta, my_tiles,
                           f8: Fp8Epilogue = None):
            """One consumer warpgroup's tiles. Each tile's last PV shares an issue turn with
            the next tile's first QK (``loop.drain_into_next``), so the epilogue runs beside a
            GEMM; the state lives across tiles because that QK writes acc_s for the next."""
            st = alloc_state()
            part_sum = loop.alloc_row_sums()
            it0 = T.alloc_var("int32", init=0)  # KV blocks consumed for earlier tiles
            T.mbarrier_wait_parity(q_full[0], 0)
            if cfg.pingpong and wg == 1:
                # WG1 goes first: WG2 pre-pays its arrival on WG1's scheduler barrier.
                T.named_barrier_arrive(WARP_SCHEDULERS[0], CONSUMER_THREADS)
            loop.first_qk(wg, q_s, 0, kv, st.acc_s, 0)
            for i in T.serial(my_tiles):
                qt, head, b = sched.tile_coords(i, cta)
                row0 = qt * BLOCK_M + wg * HALF
                if fp8:
                    set_scale(st, f8, head, b)
                reset_rows(st)
                loop.blocks(wg, row0, q_s, kv, kv_blocks(qt), st, part_sum, i % 2, it0)
                loop.drain_into_next(wg, q_s, q_full, kv, kv_blocks(qt), st, part_sum, it0,
                                     i + 1 < my_tiles, (i + 1) % 2, (i + 1) // 2)
                epilogue(wg, st, q_s, i % 2, q_empty, Out[b, row0:row0 + HALF, head, :], f8,
                         head // group, b)
                it0 += kv_blocks(qt)
            T.wait_wgmma(0)  # the throwaway QK after the last tile

        def alloc_kv_empty():
            if lanes == 1:
                return (T.alloc_barrier([CONSUMER_THREADS] * stages),
                        T.alloc_barrier([CONSUMER_THREADS] * stages))
            counts = [CONSUMER_THREADS + (lanes - 1) * CONSUMER_THREADS // 32] * stages
            return T.alloc_cluster_barrier(counts), T.alloc_cluster_barrier(counts)

        slots = cfg.q_slots
        tiles = consumer_tiles_one_slot if slots == 1 else consumer_tiles

        @T.macro
        def persistent_body(Q, K, V, Out, f8_descales):
            """One CTA per SM: the buffers, the roles and their register budgets. FP8: V is
            Vᵀ; each warpgroup has a P tile and O leaves from registers, or (P in registers)
            O leaves through a tile of its own."""
            cluster = {"cluster_dims": lanes} if lanes > 1 else {}
            with T.Kernel(sched.ctas, threads=CONSUMER_THREADS + 128, **cluster) as cta:
                q_s = T.alloc_shared([slots, 2, HALF, head_dim], dtype)
                k_s = T.alloc_shared([stages, bn, head_dim], dtype)
                v_s = T.alloc_shared([stages, head_dim_v, bn] if fp8 else
                                     [stages, bn, head_dim_v], dtype)
                T.annotate_layout(swizzled(q_s, k_s, v_s))
                q_full = T.alloc_barrier([PRODUCER_WARP] * slots)
                q_empty = T.alloc_barrier([CONSUMER_THREADS] * slots)
                k_full = T.alloc_barrier([PRODUCER_WARP] * stages)
                v_full = T.alloc_barrier([PRODUCER_WARP] * stages)
                k_empty, v_empty = alloc_kv_empty()
                if fp8:  # P in a tile, or (in registers) O in one: not both (227 KB)
                    p_s = None if cfg.p_in_registers else T.alloc_shared([2, HALF, bn], dtype)
                    o_s = (T.alloc_shared([2, HALF, head_dim_v], "bfloat16")
                           if cfg.p_in_registers else None)
                    kv = KVStages(k_s, v_s, k_full, k_empty, v_full, v_empty, p_s)
                    f8 = Fp8Epilogue(*f8_descales, o_s)
                else:
                    kv = KVStages(k_s, v_s, k_full, k_empty, v_full, v_empty)
                    f8 = None
                my_tiles = sched.tiles_of(cta)
                tx = T.get_thread_binding()
                if tx >= CONSUMER_THREADS:
                    T.set_max_nreg(24, 0)
                    if tx < CONSUMER_THREADS + PRODUCER_WARP:
                        it0 = T.alloc_var("int32", init=0)
                        for i in T.serial(my_tiles):
                            qt, head, b = sched.tile_coords(i, cta)
                            if slots == 1:
                                producer_one_slot(Q, K, V, q_s, kv, q_full, q_empty, qt, head,
                                                  b, kv_blocks(qt), i, it0)
                            else:
                                producer(Q, K, V, q_s, kv, q_full, q_empty, qt, head, b,
                                         kv_blocks(qt), i % 2, i // 2, it0)
                            it0 += kv_blocks(qt)
                elif tx < 128:
                    T.set_max_nreg(240, 1)
                    tiles(0, Out, q_s, kv, q_full, q_empty, cta, my_tiles, f8)
                else:
                    T.set_max_nreg(240, 1)
                    tiles(1, Out, q_s, kv, q_full, q_empty, cta, my_tiles, f8)
                if lanes > 1:
                    T.cluster_sync()  # no CTA exits while its peer may still signal or load into it

        return prim_func(persistent_body)

    return persistent_kernel(num_ctas) if cfg.persistent else prim_func(regular_body)


def supports(shape: Shape, pingpong: bool = True, persistent: bool = False) -> Support:
    # persistent double-buffers Q: at D 256 that is 128 KB of Q beside 128 KB of K/V
    return head_dims_supported(shape.head_dim, shape.head_dim_v,
                               PERSISTENT_HEAD_DIMS if persistent else HEAD_DIMS)


def prim_func_for(shape: Shape, pingpong: bool = True, mainloop_factory=serial_mainloop,
                  persistent: bool = False, cluster: int | None = None,
                  kv_descending: bool = False):
    """The prim_func the lab runs for a named shape (used by ``ws_lab.emit``; a persistent walk
    is planned for the H100's 132 SMs and 50 MB of L2)."""
    if persistent and cluster is None:
        cluster = cluster_for(shape.batch, shape.seq_len, shape.heads, shape.kv_heads,
                              shape.head_dim, shape.head_dim_v, H100_L2_BYTES)
    return coop_fwd(shape.batch, shape.seq_len, shape.heads, shape.kv_heads, shape.head_dim,
                    shape.head_dim_v, shape.causal, shape.dtype, 1.0 / math.sqrt(shape.head_dim),
                    config_for(shape.head_dim, shape.causal, pingpong, persistent, cluster or 1,
                               kv_descending),
                    mainloop_factory)


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
                 persistent=False, cluster=None, device=None, kv_descending=False):
    """The compiled kernel ``attention`` launches for these arguments (``cluster`` None: the
    persistent walk's ``cluster_for`` on ``device``'s L2; the grid sized to its SMs)."""
    extra = persistent_device_args(device) if persistent else ()
    if persistent and cluster is None:
        cluster = cluster_for(batch, seq_len, heads, kv_heads, head_dim, head_dim_v, extra[1])
    cfg = config_for(head_dim, bool(causal), pingpong, persistent, cluster or 1, kv_descending)
    return compiled(batch, seq_len, heads, kv_heads, head_dim, head_dim_v, bool(causal), dtype,
                    softmax_scale, cfg, mainloop_factory, *extra)


def attention(q, k, v, causal=False, softmax_scale=None, out=None, pingpong: bool = True,
              mainloop_factory=serial_mainloop, persistent: bool = False,
              cluster: int | None = None, kv_descending: bool = False):
    """BSHD GQA forward. q (B,S,Hq,D), k (B,S,Hkv,D), v (B,S,Hkv,D) fp16/bf16 on CUDA; D 64/128/256
    (64/128 when persistent). ``cluster`` (persistent): 2 forces the K/V-multicast CTA pair, 1
    single CTAs, None picks by ``cluster_for``. ``kv_descending``: ``Config.kv_descending``
    (the IntraWGOverlap mainloop on the non-persistent grid)."""
    dims = validate_attention_inputs(
        q, k, v, supported_head_dims=PERSISTENT_HEAD_DIMS if persistent else HEAD_DIMS, out=out,
        softmax_scale=softmax_scale, causal=causal)
    kernel = compiled_for(dims.batch, dims.seq_len, dims.heads, dims.kv_heads, dims.head_dim,
                          dims.head_dim_v, causal, dims.tl_dtype, dims.softmax_scale, pingpong,
                          mainloop_factory, persistent, cluster, q.device, kv_descending)
    if out is None:
        out = torch.empty(*q.shape[:3], dims.head_dim_v, dtype=q.dtype, device=q.device)
    kernel(q, k, v, out)
    return out
