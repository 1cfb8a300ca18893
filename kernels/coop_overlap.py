"""Coop with IntraWGOverlap: inside each consumer warpgroup the softmax of block n runs while
the PV GEMM of block n-1 is still in flight.

FA3 counterpart: ``hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp`` ``mma()`` with IntraWGOverlap
(``fwd_step``) and ``hopper/utils.h`` ``flash::gemm`` / ``warpgroup_wait``. Roles, barriers,
register budgets, shared memory, producer and epilogue: ``kernels/coop.py`` (shared, not copied);
only the consumer's KV loop differs. Per KV block n ≥ 1 of a warpgroup:

  wait K_n → [pingpong sync] → issue S_n = Q K_nᵀ (SS) → wait V_{n-1} → issue O += P_{n-1} V_{n-1}
  (RS, P in registers) → [pingpong arrive] → wait<1> (S_n retired) → fence S → release K_n →
  mask + softmax stats of S_n → wait<0> (PV retired) → fence O, P → release V_{n-1} →
  P_n = S_n in the input dtype, O rescaled.

Block 0 is peeled (S_0 and its softmax, nothing to overlap) and the last PV is drained after the
loop, so no wgmma group stays in flight across the loop's back edge — ptxas serializes every
HGMMA when one does (remark C7515, NOTES.md). The fences after each wait are written here; TileLang
0.1.15 emits its own only before the wait (``ws_lab/upstream/wgmma_fence_before_wait.py``).
"""
import tilelang.language as T

from kernels import coop
from kernels.coop import CONSUMER_THREADS, HALF, PASS_CONFIGS  # noqa: F401  (emit reads PASS_CONFIGS)
from kernels.softmax import commit_probs, online_softmax, softmax_stats
from ws_lab.shapes import Shape


def overlap_mainloop(t):
    @T.macro
    def mainloop(wg, row0, q_s, k_s, v_s, k_full, k_empty, v_full, v_empty, loop_range,
                 acc_s, p, acc_o, row_max, row_max_prev, row_rescale, block_sum, row_sum, slot,
                 it0):
        stage0 = it0 % t.stages  # it0: blocks the CTA streamed for earlier tiles (persistent)
        t.issue_qk(wg, q_s, slot, k_s, k_full, stage0, (it0 // t.stages) % 2, acc_s)
        if t.pingpong:
            T.named_barrier_arrive(t.schedulers[1 - wg], CONSUMER_THREADS)
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(acc_s, num_regs=t.s_regs)
        T.mbarrier_arrive(k_empty[stage0])
        t.mask(acc_s, 0, row0)
        online_softmax(acc_s, p, acc_o, row_max, row_max_prev, row_rescale, block_sum, row_sum,
                       HALF, t.bn, t.head_dim_v, t.scale_log2)
        for kb in T.serial(1, loop_range):
            stage = (it0 + kb) % t.stages
            prev = (it0 + kb - 1) % t.stages
            t.issue_qk(wg, q_s, slot, k_s, k_full, stage, ((it0 + kb) // t.stages) % 2, acc_s)
            T.mbarrier_wait_parity(v_full[prev], ((it0 + kb - 1) // t.stages) % 2)
            T.wgmma_gemm(p, v_s[prev, :, :], acc_o, clear_accum=False)
            if t.pingpong:
                T.named_barrier_arrive(t.schedulers[1 - wg], CONSUMER_THREADS)
            T.wait_wgmma(1)
            T.warpgroup_fence_operand(acc_s, num_regs=t.s_regs)
            T.mbarrier_arrive(k_empty[stage])
            t.mask(acc_s, kb, row0)
            softmax_stats(acc_s, row_max, row_max_prev, row_rescale, block_sum, row_sum, HALF,
                          t.bn, t.scale_log2)
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(acc_o, num_regs=t.o_regs)
            T.warpgroup_fence_operand(p, num_regs=t.p_regs)
            T.mbarrier_arrive(v_empty[prev])
            commit_probs(acc_s, p, acc_o, row_rescale, HALF, t.head_dim_v)
        last = (it0 + loop_range - 1) % t.stages
        T.mbarrier_wait_parity(v_full[last], ((it0 + loop_range - 1) // t.stages) % 2)
        T.wgmma_gemm(p, v_s[last, :, :], acc_o, clear_accum=False)
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(acc_o, num_regs=t.o_regs)
        T.mbarrier_arrive(v_empty[last])

    return mainloop


def supports(shape: Shape, pingpong: bool = True, persistent: bool = False) -> bool:
    return coop.supports(shape, persistent)


def prim_func_for(shape: Shape, pingpong: bool = True, persistent: bool = False):
    return coop.prim_func_for(shape, pingpong, overlap_mainloop, persistent)


def attention(q, k, v, causal=False, softmax_scale=None, out=None, pingpong: bool = True,
              persistent: bool = False):
    """BSHD GQA forward (as ``kernels.coop.attention``) with the IntraWGOverlap mainloop."""
    return coop.attention(q, k, v, causal, softmax_scale, out, pingpong, overlap_mainloop,
                          persistent)
