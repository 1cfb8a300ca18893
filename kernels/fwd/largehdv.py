"""LargeHeadDimV warp-specialized forward: QK head dim 64, V head dim 256 or 512 (MLA-shaped).

FA3 counterpart: ``hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp`` with LargeHeadDimV (``mma()`` for
WG1, ``mma_pv()`` for WG2), barriers ``PFull`` / ``PEmpty`` of ``hopper/named_barrier.hpp``,
tile 64 × 64, registers 24 / 240 / 240. Both consumer warpgroups own the same 64 query rows and
split O by columns: with Dv 512 a single warpgroup would need 256 fp32 accumulator registers
per thread for O alone.

Roles (384 threads; as in ``kernels/fwd/coop.py`` the producer is the last warpgroup):
  threads   0..127  WG1: S = Q Kᵀ (SS wgmma), mask, online softmax; publishes P (64 × 64, input
                    dtype) and the per-row rescale factors to smem; O[:, :Dv/2] += P V[:, :Dv/2]
                    (RS wgmma, P in registers)                         setmaxnreg 240
  threads 128..255  WG2: waits for P, rescales its O, O[:, Dv/2:] += P_smem V[:, Dv/2:] (SS wgmma),
                    frees P                                             setmaxnreg 240
  threads 256..383  producer; its first warp TMA-loads Q once and K, V (V in its two column halves)
                    per block into the ring (``coop.kv_producer``)     setmaxnreg 24
Epilogue: each warpgroup divides its O half by the row sums (WG2 reads them from smem behind
``NamedBarrier.ROW_SUM``) and stores it through its own half of the last V stage
(``coop.store_o``: smem → fence.proxy.async → ``EPILOGUE_WG1/2`` → TMA store).

Barriers (mbarriers): q_full (32: the producer warp), k_full[s] / v_full[s] (32 + TMA bytes),
k_empty[s] (128: WG1, the only reader of K), v_empty[s] (256: both warpgroups), p_full[s] (128:
WG1 has written P_s and its rescale factors) and p_empty[s] (128: WG2's GEMM on P_s retired) —
FA3's PFull / PEmpty as an mbarrier ring, so WG1 runs up to ``stages`` blocks ahead of WG2.
Named barriers: ``barriers.NamedBarrier`` (EPILOGUE_WG1/2, ROW_SUM).

Shared memory (2-byte elements, stages s = 2, block_n 64): Q 64·64 + s·64·(64 + Dv) + P s·64·64
+ rescale s·64·4 B + row sums 256 B. Dv 512: 8 + 16 + 128 + 16 + 0.75 KB ≈ 169 KB;
Dv 256: 8 + 16 + 64 + 16 + 0.75 KB ≈ 105 KB. O reuses the last V stage (each warpgroup its half).
"""
import contextlib
import functools
import inspect
import math

import tilelang.language as T
import torch
from tilelang.layout import make_swizzled_layout

from ws_lab.kernels import LOG2E
from ws_lab.kernels.fwd.barriers import NamedBarrier
from ws_lab.kernels.fwd.coop import (CONSUMER_THREADS, PASS_CONFIGS, PRODUCER_WARP, KVStages,
                                     kv_producer, store_o)
from ws_lab.kernels.fwd.pipeline import KVRing
from ws_lab.kernels.fwd.softmax import (LAZY_RESCALE_LOG2, alloc_softmax_state, normalize_o,
                                        rescale_o, score_mask, softmax_stats)
from ws_lab.kernels.fwd.tile_scheduler import qtile_grid
from ws_lab import postproc
from ws_lab.postproc import skip_unit_rescale
from ws_lab.check import Support, head_dims_supported, validate_attention_inputs
from ws_lab.shapes import Shape
from ws_lab.target import compile_sm90a

BLOCK_M = 64  # both consumer warpgroups share these rows
BLOCK_N = 64
STAGES = 2
RING = KVRing(STAGES)
WG_THREADS = 128
HEAD_DIMS = [(64, 256), (64, 512)]


def largehdv_fwd(batch, seq_len, heads, kv_heads, head_dim, head_dim_v, causal, dtype,
                 softmax_scale, lazy_rescale: bool = False):
    """q (B,S,Hq,D), k (B,S,Hkv,D), v (B,S,Hkv,Dv) -> out (B,S,Hq,Dv). ``lazy_rescale``: FA4's
    conditional rescale (``softmax.LAZY_RESCALE_LOG2``); both warpgroups' O rescales, 128
    FMULs a thread a block at Dv 512, then run only where a factor is not 1
    (``postproc.skip_unit_rescale``, which ``compiled`` applies). Off until measured
    (notes/largehdv.md "Session 45")."""
    threshold = LAZY_RESCALE_LOG2 if lazy_rescale else None
    group = heads // kv_heads
    half_v = head_dim_v // 2  # O columns per consumer warpgroup
    scale_log2 = softmax_scale * LOG2E
    accum = "float"
    neg_inf = -T.infinity(accum)
    s_regs = BLOCK_M * BLOCK_N // WG_THREADS
    o_regs = BLOCK_M * half_v // WG_THREADS
    p_regs = BLOCK_M * BLOCK_N // (2 * WG_THREADS)  # 2 elements of the input dtype per register
    n_qtiles = (seq_len + BLOCK_M - 1) // BLOCK_M
    n_kblocks = (seq_len + BLOCK_N - 1) // BLOCK_N
    produce_kv = kv_producer(BLOCK_N, STAGES, v_parts=2)

    mask = score_mask(causal, seq_len, BLOCK_M, BLOCK_N, accum)

    @T.macro
    def publish_p(acc_s, row_rescale, p_s, rescale_s, p_full, p_empty, kb):
        """P_kb and its rows' rescale factors into smem stage kb % STAGES for WG2 (PFull).
        P is written from the fp32 accumulator, not from the RS operand fragment: copying a
        GEMM-operand fragment to smem writes wrong data (tilelang #2954)."""
        stage, phase = RING.at(kb)
        T.mbarrier_wait_parity(p_empty[stage], phase ^ 1)
        T.copy(acc_s, p_s[stage, :, :])
        for i in T.Parallel(BLOCK_M):
            rescale_s[stage, i] = row_rescale[i]
        T.fence_proxy_async()  # WG2's wgmma reads P through the async proxy
        T.mbarrier_arrive(p_full[stage])

    @T.macro
    def softmax_wg(Out, q_s, k_s, v_s, p_s, rescale_s, row_sum_s, q_full, k_full, k_empty,
                   v_full, v_empty, p_full, p_empty, row0, head, b, loop_range):
        """WG1, IntraWGOverlap as in coop_overlap: the QK GEMM and softmax of block n run while
        WG1's own PV GEMM of block n-1 is in flight; then P_n goes to WG2."""
        acc_s, p, acc_o, row_max, row_max_prev, row_rescale, block_sum, row_sum = \
            alloc_softmax_state(BLOCK_M, BLOCK_N, half_v, dtype).registers()
        T.fill(acc_o, 0)
        T.fill(row_sum, 0)
        T.fill(row_max, neg_inf)
        T.mbarrier_wait_parity(q_full, 0)
        T.mbarrier_wait_parity(k_full[0], 0)
        T.wgmma_gemm(q_s, k_s[0, :, :], acc_s, transpose_B=True, clear_accum=True)
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(acc_s, num_regs=s_regs)
        T.mbarrier_arrive(k_empty[0])
        mask(acc_s, 0, row0)
        softmax_stats(acc_s, row_max, row_max_prev, row_rescale, block_sum, row_sum, BLOCK_M,
                      BLOCK_N, scale_log2, threshold)
        publish_p(acc_s, row_rescale, p_s, rescale_s, p_full, p_empty, 0)
        T.copy(acc_s, p)
        for kb in T.serial(1, loop_range):
            stage = RING.stage(kb)
            prev = RING.stage(kb - 1)
            T.mbarrier_wait_parity(k_full[stage], RING.phase(kb))
            T.wgmma_gemm(q_s, k_s[stage, :, :], acc_s, transpose_B=True, clear_accum=True)
            rescale_o(acc_o, row_rescale, BLOCK_M, half_v)  # in the QK GEMM's shadow
            T.mbarrier_wait_parity(v_full[prev], RING.phase(kb - 1))
            T.wgmma_gemm(p, v_s[prev, 0, :, :], acc_o, clear_accum=False)
            T.wait_wgmma(1)
            T.warpgroup_fence_operand(acc_s, num_regs=s_regs)
            T.mbarrier_arrive(k_empty[stage])
            mask(acc_s, kb, row0)
            softmax_stats(acc_s, row_max, row_max_prev, row_rescale, block_sum, row_sum,
                          BLOCK_M, BLOCK_N, scale_log2, threshold)
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(acc_o, num_regs=o_regs)
            T.warpgroup_fence_operand(p, num_regs=p_regs)
            # After the wait, not in the PV GEMM's shadow: ptxas computes P's fp16 values once
            # for the smem copy and the next RS operand, and defining those registers while the
            # RS GEMM is in flight serializes every HGMMA (remark C7513).
            publish_p(acc_s, row_rescale, p_s, rescale_s, p_full, p_empty, kb)
            T.mbarrier_arrive(v_empty[prev])
            T.copy(acc_s, p)
        last = RING.stage(loop_range - 1)
        rescale_o(acc_o, row_rescale, BLOCK_M, half_v)
        T.mbarrier_wait_parity(v_full[last], RING.phase(loop_range - 1))
        T.wgmma_gemm(p, v_s[last, 0, :, :], acc_o, clear_accum=False)
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(acc_o, num_regs=o_regs)
        T.mbarrier_arrive(v_empty[last])
        for i in T.Parallel(BLOCK_M):
            row_sum_s[i] = row_sum[i]
        T.named_barrier_arrive(NamedBarrier.ROW_SUM, 2 * WG_THREADS)
        normalize_o(acc_o, row_sum, row_rescale, BLOCK_M, half_v)
        # this warpgroup's half of the last V stage is dead: O goes there
        store_o(acc_o, v_s[last, 0, :, :], Out[b, row0:row0 + BLOCK_M, head, 0:half_v],
                NamedBarrier.EPILOGUE_WG1)

    @T.macro
    def pv_wg(Out, p_s, v_s, rescale_s, row_sum_s, v_full, v_empty, p_full, p_empty, row0, head,
              b, loop_range):
        """WG2: O[:, Dv/2:] += P_smem V[:, Dv/2:] behind WG1's P."""
        acc_o = T.alloc_fragment([BLOCK_M, half_v], accum)
        row_rescale = T.alloc_fragment([BLOCK_M], accum) if lazy_rescale else None
        T.fill(acc_o, 0)
        for kb in T.serial(loop_range):
            stage, phase = RING.at(kb)
            T.mbarrier_wait_parity(p_full[stage], phase)
            if lazy_rescale:  # factors in registers: the rescale pass guards the loop by them
                for i in T.Parallel(BLOCK_M):
                    row_rescale[i] = rescale_s[stage, i]
                rescale_o(acc_o, row_rescale, BLOCK_M, half_v)
            else:
                for i, j in T.Parallel(BLOCK_M, half_v):
                    acc_o[i, j] *= rescale_s[stage, i]
            T.mbarrier_wait_parity(v_full[stage], phase)
            T.wgmma_gemm(p_s[stage, :, :], v_s[stage, 1, :, :], acc_o, clear_accum=False)
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(acc_o, num_regs=o_regs)
            T.mbarrier_arrive(p_empty[stage])
            T.mbarrier_arrive(v_empty[stage])
        T.sync_threads(NamedBarrier.ROW_SUM, 2 * WG_THREADS)
        inv_sum = T.alloc_fragment([BLOCK_M], accum)
        normalize_o(acc_o, row_sum_s, inv_sum, BLOCK_M, half_v)
        last = RING.stage(loop_range - 1)
        store_o(acc_o, v_s[last, 1, :, :], Out[b, row0:row0 + BLOCK_M, head, half_v:head_dim_v],
                NamedBarrier.EPILOGUE_WG2)

    @T.prim_func
    def main(
        Q: T.Tensor([batch, seq_len, heads, head_dim], dtype),
        K: T.Tensor([batch, seq_len, kv_heads, head_dim], dtype),
        V: T.Tensor([batch, seq_len, kv_heads, head_dim_v], dtype),
        Out: T.Tensor([batch, seq_len, heads, head_dim_v], dtype),
    ):
        grid, tile_of = qtile_grid(n_qtiles, heads, batch, heavy_first=causal)
        with T.Kernel(*grid, threads=CONSUMER_THREADS + 128) as (gx, gy, b):
            qt, head = tile_of(gx, gy)
            q_s = T.alloc_shared([BLOCK_M, head_dim], dtype)
            k_s = T.alloc_shared([STAGES, BLOCK_N, head_dim], dtype)
            v_s = T.alloc_shared([STAGES, 2, BLOCK_N, half_v], dtype)
            p_s = T.alloc_shared([STAGES, BLOCK_M, BLOCK_N], dtype)
            rescale_s = T.alloc_shared([STAGES, BLOCK_M], accum)
            row_sum_s = T.alloc_shared([BLOCK_M], accum)
            T.annotate_layout({q_s: make_swizzled_layout(q_s), k_s: make_swizzled_layout(k_s),
                               v_s: make_swizzled_layout(v_s), p_s: make_swizzled_layout(p_s)})
            q_full = T.alloc_barrier(PRODUCER_WARP)
            k_full = T.alloc_barrier([PRODUCER_WARP] * STAGES)
            v_full = T.alloc_barrier([PRODUCER_WARP] * STAGES)
            k_empty = T.alloc_barrier([WG_THREADS] * STAGES)
            v_empty = T.alloc_barrier([2 * WG_THREADS] * STAGES)
            p_full = T.alloc_barrier([WG_THREADS] * STAGES)
            p_empty = T.alloc_barrier([WG_THREADS] * STAGES)
            row0 = qt * BLOCK_M
            loop_range = T.min(n_kblocks, qt + 1) if causal else n_kblocks
            tx = T.get_thread_binding()
            if tx >= CONSUMER_THREADS:
                T.set_max_nreg(24, 0)
                if tx < CONSUMER_THREADS + PRODUCER_WARP:
                    T.tma_copy(Q[b, row0:row0 + BLOCK_M, head, :], q_s, barrier=q_full)
                    T.mbarrier_arrive(q_full)
                    produce_kv(K, V, KVStages(k_s, v_s, k_full, k_empty, v_full, v_empty), b,
                               head // group, loop_range)
            elif tx < WG_THREADS:
                T.set_max_nreg(240, 1)
                softmax_wg(Out, q_s, k_s, v_s, p_s, rescale_s, row_sum_s, q_full, k_full,
                           k_empty, v_full, v_empty, p_full, p_empty, row0, head, b, loop_range)
            else:
                T.set_max_nreg(240, 1)
                pv_wg(Out, p_s, v_s, rescale_s, row_sum_s, v_full, v_empty, p_full, p_empty, row0,
                      head, b, loop_range)

    return main


def supports(shape: Shape) -> Support:
    return head_dims_supported(shape.head_dim, shape.head_dim_v, HEAD_DIMS)


def prim_func_for(shape: Shape, lazy_rescale: bool = False):
    """The prim_func the lab runs for a named shape (used by ``ws_lab.emit``)."""
    return largehdv_fwd(shape.batch, shape.seq_len, shape.heads, shape.kv_heads, shape.head_dim,
                        shape.head_dim_v, shape.causal, shape.dtype,
                        1.0 / math.sqrt(shape.head_dim), lazy_rescale)


@functools.lru_cache(maxsize=None)
def compiled(*args):
    """The compiled kernel for ``largehdv_fwd``'s arguments (thread-safe)."""
    lazy = inspect.signature(largehdv_fwd).bind(*args).arguments.get("lazy_rescale", False)
    with postproc.active(passes=(skip_unit_rescale,)) if lazy else contextlib.nullcontext():
        return compile_sm90a(largehdv_fwd(*args), pass_configs=PASS_CONFIGS)


def attention(q, k, v, causal=False, softmax_scale=None, out=None, lazy_rescale: bool = False):
    """BSHD GQA forward. q (B,S,Hq,64), k (B,S,Hkv,64), v (B,S,Hkv,Dv) fp16/bf16 on CUDA;
    Dv 256 or 512. ``lazy_rescale`` as in ``largehdv_fwd``."""
    dims = validate_attention_inputs(q, k, v, supported_head_dims=HEAD_DIMS, out=out,
                                     softmax_scale=softmax_scale, causal=causal)
    kernel = compiled(dims.batch, dims.seq_len, dims.heads, dims.kv_heads, dims.head_dim,
                      dims.head_dim_v, bool(causal), dims.tl_dtype, dims.softmax_scale,
                      bool(lazy_rescale))
    if out is None:
        out = torch.empty(*q.shape[:3], dims.head_dim_v, dtype=q.dtype, device=q.device)
    kernel(q, k, v, out)
    return out
