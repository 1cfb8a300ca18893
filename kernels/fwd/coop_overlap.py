"""Coop with IntraWGOverlap: inside each consumer warpgroup the softmax of block n runs while
the PV GEMM of block n-1 is still in flight.

FA3 counterpart: ``hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp`` ``mma()`` with IntraWGOverlap
(``fwd_step``) and ``hopper/utils.h`` ``flash::gemm`` / ``warpgroup_wait``. Roles, barriers,
register budgets, shared memory, producer and epilogue: ``kernels/fwd/coop.py`` (shared, not copied);
only the consumer's KV loop differs. Per KV block n ≥ 1 of a warpgroup:

  wait K_n → [pingpong sync] → issue S_n = Q K_nᵀ (SS) → wait V_{n-1} → issue O += P_{n-1} V_{n-1}
  (RS, P in registers) → [pingpong arrive] → wait<1> (S_n retired) → fence S → release K_n →
  mask + softmax stats of S_n → wait<0> (PV retired) → fence O, P → release V_{n-1} →
  P_n = S_n in the input dtype, O rescaled.

Block 0 is peeled (S_0 and its softmax, nothing to overlap) and the last PV is drained after the
loop, so no wgmma group stays in flight across the loop's back edge — ptxas serializes every
HGMMA when one does (remark C7515, NOTES.md). The fences after each wait are written here; TileLang
0.1.15 emits its own only before the wait (``ws_lab/upstream/wgmma_fence_before_wait.py``).

Row sums are deferred (16-column per-thread partial sums, one quad reduction per tile, under the
last PV), a causal or ragged KV loop is split at its first masked block, as in FA3 / TileOPs
(``coop.Config.kv_descending``: FA3's downward walk, the masked blocks first; the diagonal
one, the prologue's, may mask a warpgroup's whole row, so its softmax checks for -inf), and
each block's row max and first 4 probabilities a thread are stored to ``wait_anchor`` (a
write-only 64 × 8 fp32 buffer per warpgroup, 2 KB each) before wait<0>: ptxas otherwise puts
the PV wait above all of the block's exp2; a tile's first PV overwrites O (wgmma's scale-d
off), so O is never zero-filled and block 0 has no O rescale (switches of
``overlap_mainloop``, all on). The persistent kernel uses the loop in pieces: a tile's last PV
and the next tile's S_0 share one issue turn (``drain_into_next``), so the epilogue runs beside
a GEMM.

K/V stages are freed through ``t.release`` (a remote arrive too when the persistent kernel
runs as a CTA pair that multicasts K/V, ``coop.cluster_for``).

Shared memory: coop's plus the two anchors (4 KB): D 128 164 KB, persistent 196 KB.
"""
import functools

import tilelang.language as T

from ws_lab.kernels.fwd import coop
from ws_lab.kernels.fwd.coop import (CONSUMER_THREADS, HALF, PASS_CONFIGS,  # noqa: F401  (emit reads PASS_CONFIGS)
                                     KVStages)
from ws_lab.kernels.fwd.softmax import (LAZY_RESCALE_LOG2, SoftmaxState, add_partial_sums,
                                        alloc_partial_sums, commit_probs, first_masked_block,
                                        first_unmasked_iteration, rescale_partial_sums,
                                        score_mask, softmax_probs, softmax_stats)
from ws_lab.postproc import drop_anchor_fences, skip_unit_rescale
from ws_lab.shapes import Shape


def overlap_mainloop(deferred_sums: bool = True, split_mask: bool = True,
                     anchor_probs: bool = True, clear_first_pv: bool = True,
                     lazy_rescale: bool = False, exp2_fma_every: int = 0):
    """The mainloop factory (one object per variant, so ``coop.compiled``'s cache hits).

    deferred_sums: each thread keeps 16-column partial row sums (``add_partial_sums``) and the
      row reduction runs once per tile, not once per block between the two waits.
    split_mask: the KV loop runs as an unmasked part and a masked tail (``first_masked_block``),
      so no block tests whether it needs the mask.
    anchor_probs: each thread stores 4 probabilities of a block to a shared buffer nothing
      reads (``wait_anchor``) before the PV wait, so ptxas keeps the row max and those exp2s
      above the wait (TileOPs' anchor); compiled under ``postproc.anchors``, which drops the
      proxy fences TileLang adds for the store
      (``ws_lab/upstream/fence_proxy_for_unrelated_smem.py``).
    clear_first_pv: a tile's first PV GEMM overwrites O (wgmma's scale-d predicate off for
      that block), so O is never zero-filled and block 0 has no O rescale (TileOPs' form).
    lazy_rescale: FA4's conditional rescale: a row's max moves only when a block raises it by
      more than ``softmax.LAZY_RESCALE_LOG2`` (probabilities stay below 2^8), and the O and
      partial-sum rescales are skipped by a thread whose factors are all 1
      (``postproc.skip_unit_rescale``). Off until measured (notes/coop_overlap.md
      "Session 45").
    exp2_fma_every: every n-th 8-column group of a block's exp2s on the FMA pipe
      (``softmax.exp2_fma``, FA4's emulation) to unload MUFU; 0: all on MUFU. Off until
      measured (notes/fp8.md "Session 58")."""
    return _mainloop_factory(bool(deferred_sums), bool(split_mask), bool(anchor_probs),
                             bool(clear_first_pv), bool(lazy_rescale), int(exp2_fma_every))


ANCHOR_COLS = 8  # a 64 × 8 stripe of the score tile: 4 elements a thread (wgmma layout)
POSTPROC_PASSES = (drop_anchor_fences,)  # what the family compiles under (ws_lab.emit reads it)


@functools.lru_cache(maxsize=None)
def _mainloop_factory(deferred_sums: bool, split_mask: bool, anchor_probs: bool,
                      clear_first_pv: bool, lazy_rescale: bool = False, exp2_fma_every: int = 0):
    threshold = LAZY_RESCALE_LOG2 if lazy_rescale else None

    def factory(t: coop.MainloopContext) -> coop.Mainloop:
        if lazy_rescale and t.prob_log2_offset:  # P up to 2^16: past e4m3's 448
            raise ValueError("lazy_rescale lets P reach 2^8 before the FP8 offset's 2^8: the "
                             "FP8 forward takes no lazy rescale")
        unchecked_mask = score_mask(t.causal, t.seq_len, HALF, t.bn, checked=False)
        ring = t.ring

        def first_pv(block):
            """wgmma's scale-d off (O = P V) for the PV of the tile's block 0 (a run-time
            predicate: the loops and the drain do not know which of them holds it)."""
            return block == 0 if clear_first_pv else False

        def key_block(kb, loop_range):
            """The key block iteration kb holds (``coop.Config.kv_descending``: downward)."""
            return loop_range - 1 - kb if t.kv_descending else kb

        @T.macro
        def row_stats(st: SoftmaxState, part_sum, check_inf=False):
            if deferred_sums:
                softmax_probs(st.acc_s, st.row_max, st.row_max_prev, st.row_rescale, HALF, t.bn,
                              t.scale(st), threshold, t.prob_log2_offset, exp2_fma_every,
                              check_inf)
                rescale_partial_sums(part_sum, st.row_rescale, HALF)
                add_partial_sums(st.acc_s, part_sum, HALF, t.bn)
            else:
                softmax_stats(st.acc_s, st.row_max, st.row_max_prev, st.row_rescale,
                              st.block_sum, st.row_sum, HALF, t.bn, t.scale(st), threshold,
                              t.prob_log2_offset, exp2_fma_every, check_inf)

        @T.macro
        def step(wg, kb, row0, mask, q_s, kv: KVStages, st: SoftmaxState, part_sum, slot, it0,
                 wait_anchor, loop_range):
            """Block kb ≥ 1: S_kb and PV_{kb-1} in flight together, S_kb's stats under PV."""
            stage = ring.stage(it0 + kb)
            prev = ring.stage(it0 + kb - 1)
            t.issue_qk(wg, q_s, slot, kv, stage, ring.phase(it0 + kb), st.acc_s)
            T.mbarrier_wait_parity(kv.v_full[prev], ring.phase(it0 + kb - 1))
            t.issue_pv(wg, st, kv, prev, first_pv(kb - 1))
            if t.pingpong:
                T.named_barrier_arrive(t.schedulers[1 - wg], CONSUMER_THREADS)
            T.wait_wgmma(1)
            T.warpgroup_fence_operand(st.acc_s, num_regs=t.s_regs)
            t.release(kv.k_empty, stage)
            if mask is not None:
                mask(st.acc_s, key_block(kb, loop_range), row0)
            row_stats(st, part_sum)
            if anchor_probs:  # the store keeps the row max and 4 exp2s above the PV wait
                for i, j in T.Parallel(HALF, ANCHOR_COLS):
                    wait_anchor[i, j] = st.acc_s[i, j]
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(st.acc_o, num_regs=t.o_regs)
            T.warpgroup_fence_operand(st.p, num_regs=t.p_regs)
            t.release(kv.v_empty, prev)
            commit_probs(st.acc_s, st.p, st.acc_o, st.row_rescale, HALF, t.head_dim_v, t.copy_p)
            if t.commit_p is not None:  # PV_{kb-1} has retired: P's tile is free
                t.commit_p(wg, st, kv)

        @T.macro
        def first_qk(wg, q_s, slot, kv: KVStages, acc_s, it0):
            """Issue S_0 of a tile in this warpgroup's turn (no wait)."""
            stage0 = ring.stage(it0)  # it0: blocks the CTA streamed for earlier tiles (persistent)
            t.issue_qk(wg, q_s, slot, kv, stage0, ring.phase(it0), acc_s)
            if t.pingpong:
                T.named_barrier_arrive(t.schedulers[1 - wg], CONSUMER_THREADS)

        @T.macro
        def blocks(wg, row0, q_s, kv: KVStages, loop_range, st: SoftmaxState, part_sum, slot,
                   it0):
            """S_0 in flight → its softmax, then blocks 1 … n-1 with S_kb beside PV_{kb-1};
            the last PV is left to ``drain`` / ``drain_into_next``."""
            stage0 = ring.stage(it0)
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(st.acc_s, num_regs=t.s_regs)
            t.release(kv.k_empty, stage0)
            t.mask(st.acc_s, key_block(0, loop_range), row0)
            if deferred_sums:
                T.fill(part_sum, 0)  # row_max is -inf: the rescale below multiplies zeros
            # descending: the diagonal block comes first and can mask a warpgroup's whole row
            row_stats(st, part_sum, t.kv_descending and t.causal)
            if clear_first_pv:
                t.copy_p(st.acc_s, st.p)  # O holds nothing yet: P_0's PV overwrites it
            else:
                commit_probs(st.acc_s, st.p, st.acc_o, st.row_rescale, HALF, t.head_dim_v,
                             t.copy_p)
            if t.commit_p is not None:
                t.commit_p(wg, st, kv)
            wait_anchor = T.alloc_shared([HALF, ANCHOR_COLS], "float") if anchor_probs else None
            if split_mask and t.kv_descending:  # FA3's order: the masked blocks first
                unmasked = first_unmasked_iteration(t.causal, t.seq_len, t.bn, row0, loop_range)
                for kb in T.serial(1, unmasked):
                    step(wg, kb, row0, unchecked_mask, q_s, kv, st, part_sum, slot, it0,
                         wait_anchor, loop_range)
                for kb in T.serial(unmasked, loop_range):
                    step(wg, kb, row0, None, q_s, kv, st, part_sum, slot, it0, wait_anchor,
                         loop_range)
            elif split_mask:
                unmasked = first_masked_block(t.causal, t.seq_len, t.bn, row0, loop_range)
                for kb in T.serial(1, unmasked):
                    step(wg, kb, row0, None, q_s, kv, st, part_sum, slot, it0, wait_anchor,
                         loop_range)
                for kb in T.serial(unmasked, loop_range):
                    step(wg, kb, row0, unchecked_mask, q_s, kv, st, part_sum, slot, it0,
                         wait_anchor, loop_range)
            else:
                for kb in T.serial(1, loop_range):
                    step(wg, kb, row0, t.mask, q_s, kv, st, part_sum, slot, it0, wait_anchor,
                         loop_range)

        @T.macro
        def drain(wg, kv: KVStages, loop_range, st: SoftmaxState, part_sum, it0):
            """The tile's last PV, alone: issue, finish the row sums under it, wait."""
            last = ring.stage(it0 + loop_range - 1)
            T.mbarrier_wait_parity(kv.v_full[last], ring.phase(it0 + loop_range - 1))
            t.issue_pv(wg, st, kv, last, first_pv(loop_range - 1))
            if deferred_sums:
                T.reduce_sum(part_sum, st.row_sum, dim=1)  # under the last PV GEMM
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(st.acc_o, num_regs=t.o_regs)
            t.release(kv.v_empty, last)

        @T.macro
        def drain_into_next(wg, q_s, q_full, kv: KVStages, loop_range, st: SoftmaxState,
                            part_sum, it0, has_next, next_slot, next_use):
            """Persistent: the tile's last PV and the next tile's S_0 in one issue turn, then
            wait<1> (PV retired): the epilogue that follows runs beside S_0. After the CTA's
            last tile S_0 is a throwaway product of the stale next slot and stage (no loads
            are pending then), so every entry to the tile loop has one QK in flight; the
            kernel waits for it before exit."""
            last = ring.stage(it0 + loop_range - 1)
            nxt = it0 + loop_range
            T.mbarrier_wait_parity(kv.v_full[last], ring.phase(it0 + loop_range - 1))
            if t.pingpong:
                T.sync_threads(t.schedulers[wg], CONSUMER_THREADS)
            t.issue_pv(wg, st, kv, last, first_pv(loop_range - 1))
            if has_next:
                T.mbarrier_wait_parity(q_full[next_slot], next_use % 2)
                T.mbarrier_wait_parity(kv.k_full[ring.stage(nxt)], ring.phase(nxt))
            T.wgmma_gemm(q_s[next_slot, wg, :, :], kv.k_s[ring.stage(nxt), :, :], st.acc_s,
                         transpose_B=True, clear_accum=True)
            if t.pingpong:
                T.named_barrier_arrive(t.schedulers[1 - wg], CONSUMER_THREADS)
            if deferred_sums:
                T.reduce_sum(part_sum, st.row_sum, dim=1)  # under the two GEMMs
            T.wait_wgmma(1)
            T.warpgroup_fence_operand(st.acc_o, num_regs=t.o_regs)
            t.release(kv.v_empty, last)

        @T.macro
        def tile(wg, row0, q_s, kv: KVStages, loop_range, st: SoftmaxState, slot, it0):
            """One tile on its own: S_0, the blocks, the last PV drained."""
            part_sum = alloc_partial_sums(HALF, t.bn) if deferred_sums else None
            first_qk(wg, q_s, slot, kv, st.acc_s, it0)
            blocks(wg, row0, q_s, kv, loop_range, st, part_sum, slot, it0)
            drain(wg, kv, loop_range, st, part_sum, it0)

        return coop.Mainloop(
            tile=tile, fills_o=not clear_first_pv, first_qk=first_qk, blocks=blocks,
            drain_into_next=drain_into_next,
            alloc_row_sums=lambda: alloc_partial_sums(HALF, t.bn) if deferred_sums else None)

    factory.postproc_passes = ((POSTPROC_PASSES if anchor_probs else ())
                               + ((skip_unit_rescale,) if lazy_rescale else ()))
    return factory


def supports(shape: Shape, pingpong: bool = True, persistent: bool = False, **ablation):
    return coop.supports(shape, pingpong, persistent)


def prim_func_for(shape: Shape, pingpong: bool = True, persistent: bool = False,
                  cluster: int | None = None, kv_descending: bool = False, **ablation):
    """``ablation``: ``overlap_mainloop``'s switches (deferred_sums, split_mask), default on;
    ``cluster`` and ``kv_descending`` as in ``coop.attention``."""
    return coop.prim_func_for(shape, pingpong, overlap_mainloop(**ablation), persistent, cluster,
                              kv_descending)


def attention(q, k, v, causal=False, softmax_scale=None, out=None, pingpong: bool = True,
              persistent: bool = False, cluster: int | None = None, kv_descending: bool = False,
              **ablation):
    """BSHD GQA forward (as ``kernels.coop.attention``) with the IntraWGOverlap mainloop;
    ``ablation`` as in ``prim_func_for``."""
    return coop.attention(q, k, v, causal, softmax_scale, out, pingpong,
                          overlap_mainloop(**ablation), persistent, cluster, kv_descending)
