"""Pipelined GQA backward — the lab's TileLang backward, on TileLang's automatic warp
specialization.

FA3 counterpart: ``hopper/mainloop_bwd_sm90_tma_gmma_ws.hpp`` in structure: each CTA holds one
K/V tile of one KV head and loops over the Q tiles of every query head of its group, so dK and
dV are summed over the group in registers (no atomics, no second pass), and written once in the
input dtype. dQ leaves each step FA3's way: the fp32 tile is staged in shared memory and one
thread adds it into the accumulator with one bulk reduce-add (``dq_stager``); ``prepost``
clears the accumulator (beside Δ·scale and lse·log2 e) and casts it to q's dtype (FA3's two
small kernels).

Roles (TileLang's automatic warp specialization of the ``T.Pipelined`` loop, sm_90a):
  2 consumer warpgroups, 64 K/V rows each               setmaxnreg 240
  1 producer warpgroup: TMA of the Q / dO tiles, lse, Δ  setmaxnreg 24
Barriers: the pipeline's mbarriers (TileLang's own: a full / empty pair a stage and buffer);
named barrier id 3 (TileLang's consumer syncs) and ``NamedBarrier.BWD_DQ_WG1`` (the consumers,
twice a step around dQ's staging tile, once after the loop; with ``Config.dq_planes = 2``,
``BWD_DQ_WG1`` / ``WG2``, a warpgroup's 128 threads each).

The five GEMMs of a step, with the K/V tile as the M side (rows i: keys; columns j: queries):
  Sᵀ = K Qᵀ (SS)            Pᵀ = exp2(Sᵀ·scale·log2 e − (lse·log2 e)_j), 0 past S or the diagonal
  dV += Pᵀ dO (RS)          dPᵀ = V dOᵀ (SS), issued after dV so Sᵀ, Pᵀ and dPᵀ are never
                            all live (the other order spilled at 64 Q rows a step)
  dSᵀ = Pᵀ ∘ (dPᵀ·scale − (Δ·scale)_j), Δ = rowsum(dO ∘ O); lse·log2 e and Δ·scale come
                            from ``prepost.preprocess`` so each is one FFMA an element
  dK += dSᵀ Q (SS)          dQ = dS K (SS, dSᵀ read transposed), issued just before dK;
                            staged → bulk reduce-add between their waits, under dK's GEMM
Shared memory at D 128 and the default tiles (bm 128 K/V rows, bn 64 Q rows, 2 stages): K and
  V 64 KB, the Q and dO rings 64 KB, dSᵀ 16 KB, dQ's staging 34 KB (64 × 136 fp32: 8 pad
  columns put each row on other banks), lse and Δ 1 KB: 184320 B as lowered (the dK / dV store
  buffer reuses K's bytes).
Grid (``kv_grid``): causal, every head's K/V tile 0 (the longest walk) launches first; full,
  a head's K/V tiles launch together. Where those CTAs cannot fill the SMs evenly
  (``heuristics.head_splits``: Qwen2.5-0.5B's 7-head groups; ``planned_config``, what
  ``attention_bwd`` runs unless given a config), ``Config.head_splits`` gives each K/V tile
  several CTAs, each walking a share of the group and adding its fp32 dK / dV into
  accumulators by bulk reduce-add (a (128, D + 8) fp32 staging tile in the loop's freed
  bytes), cast by ``prepost.postprocess``. Causal steps start at the first Q tile that sees
  the K/V tile; only the tiles that straddle the diagonal and the ragged last Q and K/V tiles
  are masked.
  Compiled with fast math (ex2.approx.ftz for Pᵀ). Correct on the H100 over the grid of
  tests/ws/test_bwd.py; 0.94–0.96 × TileOPs' backward on the full rows, 0.86–0.89 × on the
  causal ones (where ``attention_bwd`` now runs ``ws``, "Session 53"); on the Qwen row, its plan
  (split 7 ways, 128 Q rows a step at D 64, PDL) 1.033 × FA-CuTe's backward and 1.202 ×
  TileOPs' (notes/bwd.md, "Session 64"; the group whole 0.66 × TileOPs, "Session 51").

Deterministic mode (``attention_bwd(..., deterministic=True)``): the main kernel without dQ
(``with_dq=False``: four GEMMs), then ``flash_bwd_dq``, FA2's separate dQ pass in place of FA3's
semaphore-ordered atomics. A CTA holds 128 Q rows of one head (two consumer warpgroups, the
same producer split) and walks the 64-row K/V tiles in order: S = Q Kᵀ and dP = dO Vᵀ (SS,
recomputed), dQ += dS K (RS), written once in q's dtype. Shared memory at D 128: Q and dO
64 KB, the K and V rings (2 stages) 64 KB, lse and Δ: 133120 B as lowered (the dQ store buffer
reuses freed space). Bitwise repeatable over 20 runs on the H100 (tests/ws/test_bwd.py).
"""
import contextlib
import dataclasses
import functools
import math
import operator
from dataclasses import dataclass

import tilelang
import tilelang.language as T
import torch

from ws_lab import postproc
from ws_lab.check import (Support, head_dims_supported, require_device,
                          validate_attention_inputs)
from ws_lab.kernels import DYNAMIC_BATCH, LOG2E, batch_extent
from ws_lab.kernels.bwd import heuristics, prepost, ws
from ws_lab.kernels.bwd.tile_scheduler import kv_grid, kv_tile, q_walk, slot_heads
from ws_lab.kernels.fwd.barriers import NamedBarrier
from ws_lab.target import compile_sm90a

HEAD_DIMS = ((64, 64), (128, 128))
# ex2.approx.ftz: Pᵀ's exp2 without the subnormal range fix-up (an FSETP and an FMUL an
# element before the MUFU; notes/bwd.md, "Session 37")
PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}


@dataclass(frozen=True)
class Config:
    block_kv: int  # K/V rows a CTA holds (bm)
    block_q: int  # Q rows a step (bn)
    threads: int  # consumer threads (the producer warpgroup comes on top)
    num_stages: int
    # The walk: False, head by head, Q tiles first to last; True, Q tiles last to first with
    # the group's heads inner, so every CTA of a head reads the same Q / dO tile at the same
    # time (causal CTAs start at different tiles, so head by head they drift apart) and the
    # step's head and tile come from a division by the group, a constant. Off by default:
    # 1.03–1.04 × on llama8b-4k and the Qwen row, 0.93 × on llama8b-8k (notes/bwd.md,
    # "Session 37").
    heads_inner: bool = False
    # wgmma descriptors offset by a warp-uniform warpgroup index (``postproc.uniform_warpgroup``):
    # no R2UR before each wgmma, 670 -> 598 instructions a step of the main loop (train8b-4k,
    # lowered); off until measured on a GPU (notes/bwd.md, "Session 46, later").
    uniform_wg: bool = False
    # dQ's staging: 1, one tile for the CTA under 256-thread barriers; 2, each consumer
    # warpgroup stages the 64 columns of the dQ tile it computes and adds them into its own
    # plane of the accumulator under its own 128-thread barriers (FA3's per-warpgroup
    # dQaccum). 1 by default: 2 measured 0.94-0.97 x on every row (notes/bwd.md, "Session 49").
    dq_planes: int = 1
    # The query heads of a KV head's group split over this many CTAs a K/V tile (a divisor of
    # the group): 1, dK and dV summed over the group in registers and stored in the input
    # dtype; s > 1, each CTA walks group / s heads and adds its fp32 dK / dV into accumulators
    # by bulk reduce-add, cast afterwards (TileOPs' one head a CTA, for grids too small or too
    # uneven to fill the SMs; the rule is ``heuristics.head_splits``).
    head_splits: int = 1
    # Programmatic dependent launch: the main kernel starts while the preprocess ends and waits
    # for its outputs; the postprocess starts while the main kernel's last wave runs (short
    # launches pay their gaps most: on the Qwen row 1.036 × without, H100; ``planned_config``
    # turns it on; notes/bwd.md, "Session 64").
    pdl: bool = False


# 2 consumer warpgroups of 64 K/V rows each, 64 Q rows a step: Sᵀ, dPᵀ and dQ 32 registers a
# thread beside dK and dV's 64 each. dPᵀ is issued after dV so Sᵀ (fp32), Pᵀ and dPᵀ are never
# live at once: in the other order bn 64 spilled and serialized every wgmma (notes/bwd.md,
# "Session 36").
DEFAULT = Config(block_kv=128, block_q=64, threads=256, num_stages=2)
# The dQ kernel's tiles (deterministic mode): 128 Q rows over two consumer warpgroups, 64 K/V
# rows a step (dQ 64 + S 32 + dP 32 registers a thread at D 128).
DQ_DEFAULT = Config(block_kv=64, block_q=128, threads=256, num_stages=2)


def flash_bwd(batch, seq_len, heads, kv_heads, head_dim, causal, dtype, softmax_scale,
              cfg: Config = DEFAULT, with_dq: bool = True):
    """The main kernel: (Q, K, V, dO, lse·log2 e and Δ·scale (B, Hq, S), from
    ``prepost.preprocess``) -> dQ_accum
    (fp32, added to), dK, dV (dtype; with ``cfg.head_splits`` > 1, fp32 accumulators shaped as
    ``prepost.dq_accum_shape`` over the KV heads, added to). Without ``with_dq`` (the
    deterministic mode) it has no dQ parameter and computes dK and dV only: ``flash_bwd_dq``
    makes dQ. ``batch`` may be ``DYNAMIC_BATCH``."""
    batch = batch_extent(batch)
    bm, bn, group = cfg.block_kv, cfg.block_q, heads // kv_heads
    splits = cfg.head_splits
    if splits < 1 or group % splits:
        raise ValueError(f"head_splits {splits} must divide the query group {group}")
    walk_heads = group // splits  # query heads a CTA walks
    scale_log2 = softmax_scale * LOG2E
    accum = "float"
    n_qtiles = (seq_len + bn - 1) // bn
    n_kvtiles = (seq_len + bm - 1) // bm
    live = _live(seq_len, causal)
    stage_dq, drain_dq = dq_stager(bn, head_dim, cfg.threads, cfg.dq_planes)
    stage_kv, drain_kv = dq_stager(bm, head_dim, cfg.threads, 1)
    if prepost.DQ_ROW_ALIGN % bn:
        raise ValueError(f"block_q {bn} must divide the dQ accumulator's row alignment "
                         f"{prepost.DQ_ROW_ALIGN}")

    def masked(qt, bx):
        """Whether the (Q tile, K/V tile) step needs the mask: it straddles the diagonal, or
        one of its tiles is the ragged last one; False where no step ever does."""
        conds = [qt * bn < (bx + 1) * bm] if causal else []
        conds += [(qt + 1) * bn > seq_len] if seq_len % bn else []
        conds += [(bx + 1) * bm > seq_len] if seq_len % bm else []
        return functools.reduce(operator.or_, conds) if conds else False

    @T.macro
    def body(Q, K, V, dO, LSElog2, DeltaScaled, dQ, dK, dV):
        slots = kv_heads * splits  # (KV head, head split) pairs
        with T.Kernel(*kv_grid(n_kvtiles, slots, batch, causal), threads=cfg.threads) as (
                gx, gy):
            bx, slot, bz = kv_tile(gx, gy, n_kvtiles, slots, causal)
            kvh, first_head = slot_heads(slot, splits, group)
            k_s = T.alloc_shared([bm, head_dim], dtype)
            v_s = T.alloc_shared([bm, head_dim], dtype)
            q_s = T.alloc_shared([bn, head_dim], dtype)
            do_s = T.alloc_shared([bn, head_dim], dtype)
            ds_s = T.alloc_shared([bm, bn], dtype)
            lse_s = T.alloc_shared([bn], accum)
            delta_s = T.alloc_shared([bn], accum)
            st = T.alloc_fragment([bm, bn], accum)  # Sᵀ, then Pᵀ
            dpt = T.alloc_fragment([bm, bn], accum)
            pt = T.alloc_fragment([bm, bn], dtype)
            dst = T.alloc_fragment([bm, bn], dtype)
            dk = T.alloc_fragment([bm, head_dim], accum)
            dv = T.alloc_fragment([bm, head_dim], accum)
            if splits == 1:
                dkv_s = T.alloc_shared([bm, head_dim], dtype)
            else:  # dK's, then dV's staging for their reduce-adds
                dkv_s = T.alloc_shared([1, bm, head_dim + prepost.DQ_PAD], accum)
            if with_dq:
                stage_hold = T.alloc_local([1], dtype)
                dq_frag = T.alloc_fragment([bn, head_dim], accum)
                # dQ's staging: one plane for the CTA, or one a warpgroup (Config.dq_planes)
                dq_s = T.alloc_shared(
                    [cfg.dq_planes, bn, head_dim // cfg.dq_planes + prepost.DQ_PAD], accum)

            if cfg.pdl:
                T.pdl_trigger()  # the postprocess may launch once every CTA is here
                T.pdl_sync()  # lse·log2 e, Δ·scale and the cleared accumulators are the preprocess'
            T.copy(K[bz, bx * bm:(bx + 1) * bm, kvh, :], k_s)
            T.copy(V[bz, bx * bm:(bx + 1) * bm, kvh, :], v_s)
            T.clear(dk)
            T.clear(dv)
            first = (bx * bm) // bn if causal else 0  # Q tiles above it never see this K/V tile
            steps = n_qtiles - first
            for it in T.Pipelined(walk_heads * steps, num_stages=cfg.num_stages):
                h, qt = q_walk(it, steps, first, first_head, walk_heads, n_qtiles,
                               cfg.heads_inner)
                mask_step = masked(qt, bx)
                T.copy(Q[bz, qt * bn:(qt + 1) * bn, h, :], q_s)
                T.copy(dO[bz, qt * bn:(qt + 1) * bn, h, :], do_s)
                T.copy(LSElog2[bz, h, qt * bn:(qt + 1) * bn], lse_s)
                T.copy(DeltaScaled[bz, h, qt * bn:(qt + 1) * bn], delta_s)
                T.clear(st)
                _gemm(k_s, q_s, st, transpose_B=True)
                for i, j in T.Parallel(bm, bn):
                    st[i, j] = T.exp2(st[i, j] * scale_log2 - lse_s[j])
                if mask_step:
                    for i, j in T.Parallel(bm, bn):
                        st[i, j] = T.if_then_else(live(bx * bm + i, qt * bn + j), st[i, j], 0)
                T.copy(st, pt)
                _gemm(pt, do_s, dv)
                T.clear(dpt)
                _gemm(v_s, do_s, dpt, transpose_B=True)
                for i, j in T.Parallel(bm, bn):
                    dst[i, j] = st[i, j] * (dpt[i, j] * softmax_scale - delta_s[j])
                # no second mask: Pᵀ is 0 wherever the mask is, and past S the V, dO, lse and Δ
                # rows load as zeros (a TMA tile's fill or a guarded load), so dPᵀ and Δ are
                # finite and dSᵀ is 0 there too (notes/bwd.md, "Session 52")
                # dSᵀ goes through shared memory once and both GEMMs read it there: copying an
                # RS operand fragment to shared memory writes wrong data (tilelang #2954)
                T.copy(dst, ds_s)
                if with_dq:  # dQ, then dK; dQ staged under dK (notes/bwd.md, "Session 37")
                    T.wgmma_gemm(ds_s, k_s, dq_frag, transpose_A=True, clear_accum=True,
                                 policy=T.GemmWarpPolicy.FullRow)
                    T.wgmma_gemm(ds_s, q_s, dk, policy=T.GemmWarpPolicy.FullRow)
                    T.wait_wgmma(1)
                    # T.wgmma_gemm fences before the wait, not after (tests/upstream/
                    # test_wgmma_fences.py)
                    T.warpgroup_fence_operand(dq_frag, num_regs=bn * head_dim // cfg.threads)
                    stage_dq(dq_frag, dq_s, dQ, bz, h, qt * bn)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(dk, num_regs=bm * head_dim // cfg.threads)
                    # an issued wgmma is no finished read: reading its operands here holds the
                    # pipeline's stage, and keeps dSᵀ's bytes from dQ's staging tile where the
                    # walk is one step and TileLang's reuse merges them (notes/bwd.md, "Session 64")
                    stage_hold[0] = q_s[0, 0] + do_s[0, 0] + ds_s[0, 0]
                else:
                    _gemm(ds_s, q_s, dk)
            if with_dq:  # the last reduce-add has read dq_s before dkv_s may reuse its bytes
                drain_dq()
            if splits == 1:
                T.copy(dk, dkv_s)
                T.copy(dkv_s, dK[bz, bx * bm:(bx + 1) * bm, kvh, :])
                T.copy(dv, dkv_s)
                T.copy(dkv_s, dV[bz, bx * bm:(bx + 1) * bm, kvh, :])
            else:
                stage_kv(dk, dkv_s, dK, bz, kvh, bx * bm)
                stage_kv(dv, dkv_s, dV, bz, kvh, bx * bm)
                drain_kv()  # dV's reduce-add has read the tile before the CTA exits

    # A fresh annotation per parameter: parameters sharing one T.Tensor object become one
    # buffer (tests/upstream/test_shared_annotation.py)
    def q_t():
        return T.Tensor([batch, seq_len, heads, head_dim], dtype)

    def kv_t():
        return T.Tensor([batch, seq_len, kv_heads, head_dim], dtype)

    def dkv_t():
        if splits == 1:
            return kv_t()
        return T.Tensor(prepost.dq_accum_shape(batch, seq_len, kv_heads, head_dim), accum)

    def row_t():
        return T.Tensor([batch, heads, seq_len], accum)

    if with_dq:
        @T.prim_func
        def main(Q: q_t(), K: kv_t(), V: kv_t(), dO: q_t(), LSElog2: row_t(),
                 DeltaScaled: row_t(),
                 dQ: T.Tensor(prepost.dq_accum_shape(batch, seq_len, heads, head_dim,
                                                     cfg.dq_planes), accum),
                 dK: dkv_t(),
                 dV: dkv_t()):
            body(Q, K, V, dO, LSElog2, DeltaScaled, dQ, dK, dV)

        return main

    @T.prim_func
    def main_dkdv(Q: q_t(), K: kv_t(), V: kv_t(), dO: q_t(), LSElog2: row_t(),
                  DeltaScaled: row_t(), dK: dkv_t(), dV: dkv_t()):
        body(Q, K, V, dO, LSElog2, DeltaScaled, None, dK, dV)

    return main_dkdv


def dq_stager(block_q, head_dim, threads, planes):
    """dQ out of a step, FA3's way in place of one atomic per element: each group of
    ``threads / planes`` consumer threads (a warpgroup at 2 planes) stages the dQ columns it
    holds in its plane of shared memory, and one of its threads adds them into its plane's
    contiguous (block_q, D / planes + pad) run of the accumulator with one bulk reduce-add,
    waiting for it to have read the plane only a step later, before the next tile is staged
    (scalar atomics cost 24 % of the kernel: notes/bwd.md, "Session 36"). A group's fragment
    holds exactly its plane's columns: the dQ GEMM's M (block_q 64) fits one warpgroup, so
    ``FullRow`` splits its N (D) over the warpgroups (tests/cpu/test_bwd_codegen.py).
    With ``head_splits`` > 1 the main kernel stages dK and dV the same way, once a CTA, into
    their fp32 accumulators (``block_q`` then being the K/V tile's rows).
    Returns (stage_dq, drain_dq): drain_dq is that wait, for every consumer thread."""
    if planes not in (1, threads // 128) or (planes > 1 and block_q != 64):
        raise ValueError(f"dQ's staging takes 1 plane, or {threads // 128} (one a consumer "
                         f"warpgroup) at block_q 64; got {planes} planes at block_q {block_q}")
    group = threads // planes
    width = head_dim // planes
    run_bytes = block_q * (width + prepost.DQ_PAD) * 4

    @T.macro
    def drain_dq():
        tx = T.get_thread_binding()
        if tx % group == 0:
            T.tma_store_wait(0)  # the last reduce-add has read the group's plane
        T.sync_threads(barrier_id=NamedBarrier.BWD_DQ_WG1 + tx // group, arrive_count=group)

    @T.macro
    def stage_dq(dq_frag, dq_s, dq_accum, b, h, row):
        drain_dq()
        for j, d in T.Parallel(block_q, head_dim):
            dq_s[d // width, j, d % width] = dq_frag[j, d]
        T.fence_proxy_async()  # each thread's stores, before the bulk copy reads them
        tx = T.get_thread_binding()
        T.sync_threads(barrier_id=NamedBarrier.BWD_DQ_WG1 + tx // group, arrive_count=group)
        if tx % group == 0:
            plane = tx // group
            T.call_extern("handle", "tl::tma_store_add", T.access_ptr(dq_s[plane, 0, 0], "r"),
                          T.access_ptr(dq_accum[b, h, plane, row, 0], "w"), run_bytes)
            T.tma_store_arrive()

    return stage_dq, drain_dq


def _gemm(a, b, c, **kw):
    return T.gemm(a, b, c, policy=T.GemmWarpPolicy.FullRow, **kw)


def _live(seq_len, causal):
    def live(key, query):
        """(key, query) inside the sequence, and not in the future under the causal mask."""
        inside = (key < seq_len) & (query < seq_len)
        return inside & (key <= query) if causal else inside

    return live


def flash_bwd_dq(batch, seq_len, heads, kv_heads, head_dim, causal, dtype, softmax_scale,
                 cfg: Config = DQ_DEFAULT):
    """The deterministic mode's dQ kernel (FA2's separate dQ pass, in place of FA3's
    semaphore-ordered atomics): a CTA holds one Q tile of one head and walks the K/V tiles in
    order, S and dP recomputed (3 GEMMs a step: S = Q Kᵀ, dP = dO Vᵀ SS; dQ += dS K RS), dQ
    summed in registers and written once in q's dtype: bitwise repeatable. ``batch`` may be
    ``DYNAMIC_BATCH``."""
    batch = batch_extent(batch)
    bm, bn, group = cfg.block_q, cfg.block_kv, heads // kv_heads
    scale_log2 = softmax_scale * LOG2E
    accum = "float"
    n_ktiles = (seq_len + bn - 1) // bn
    live = _live(seq_len, causal)

    @T.prim_func
    def main(
        Q: T.Tensor([batch, seq_len, heads, head_dim], dtype),
        K: T.Tensor([batch, seq_len, kv_heads, head_dim], dtype),
        V: T.Tensor([batch, seq_len, kv_heads, head_dim], dtype),
        dO: T.Tensor([batch, seq_len, heads, head_dim], dtype),
        LSElog2: T.Tensor([batch, heads, seq_len], accum),
        DeltaScaled: T.Tensor([batch, heads, seq_len], accum),
        dQ: T.Tensor([batch, seq_len, heads, head_dim], dtype),
    ):
        with T.Kernel(T.ceildiv(seq_len, bm), heads, batch, threads=cfg.threads) as (bx, h, bz):
            q_s = T.alloc_shared([bm, head_dim], dtype)
            do_s = T.alloc_shared([bm, head_dim], dtype)
            k_s = T.alloc_shared([bn, head_dim], dtype)
            v_s = T.alloc_shared([bn, head_dim], dtype)
            lse_s = T.alloc_shared([bm], accum)
            delta_s = T.alloc_shared([bm], accum)
            s = T.alloc_fragment([bm, bn], accum)
            dp = T.alloc_fragment([bm, bn], accum)
            ds = T.alloc_fragment([bm, bn], dtype)
            dq = T.alloc_fragment([bm, head_dim], accum)
            dq_s = T.alloc_shared([bm, head_dim], dtype)

            T.copy(Q[bz, bx * bm:(bx + 1) * bm, h, :], q_s)
            T.copy(dO[bz, bx * bm:(bx + 1) * bm, h, :], do_s)
            T.copy(LSElog2[bz, h, bx * bm:(bx + 1) * bm], lse_s)
            T.copy(DeltaScaled[bz, h, bx * bm:(bx + 1) * bm], delta_s)
            T.clear(dq)
            # K/V tiles right of the diagonal never meet this Q tile
            steps = T.min(n_ktiles, T.ceildiv((bx + 1) * bm, bn)) if causal else n_ktiles
            for kt in T.Pipelined(steps, num_stages=cfg.num_stages):
                T.copy(K[bz, kt * bn:(kt + 1) * bn, h // group, :], k_s)
                T.copy(V[bz, kt * bn:(kt + 1) * bn, h // group, :], v_s)
                T.clear(s)
                T.gemm(q_s, k_s, s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.clear(dp)
                T.gemm(do_s, v_s, dp, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(bm, bn):
                    ds[i, j] = T.if_then_else(
                        live(kt * bn + j, bx * bm + i),
                        T.exp2(s[i, j] * scale_log2 - lse_s[i])
                        * (dp[i, j] * softmax_scale - delta_s[i]), 0)
                T.gemm(ds, k_s, dq, policy=T.GemmWarpPolicy.FullRow)
            T.copy(dq, dq_s)
            T.copy(dq_s, dQ[bz, bx * bm:(bx + 1) * bm, h, :])

    return main


def supports(shape, backend: str = "pipelined") -> Support:
    """Whether ``backend``'s main kernel runs the shape (``attention_bwd``'s ``backend``)."""
    support = head_dims_supported(shape.head_dim, shape.head_dim_v, HEAD_DIMS)
    if backend == "ws" and support:
        why = ws.supports_problem(shape.seq_len, shape.head_dim)
        return Support(f"bwd-ws does not run {why}") if why else support
    return support


def planned_config(batch, seq_len, heads, kv_heads, head_dim, causal, sms) -> Config:
    """``DEFAULT`` with ``heuristics.block_q``'s Q rows a step for ``head_dim``, the group
    split as ``heuristics.head_splits`` plans it on ``sms`` SMs (for a dynamic batch's
    kernels, which serve every batch, plan for batch 1) and the launches programmatic
    (``Config.pdl``)."""
    tiles = dataclasses.replace(DEFAULT, block_q=heuristics.block_q(head_dim), pdl=True)
    return dataclasses.replace(tiles, head_splits=heuristics.head_splits(
        batch, seq_len, kv_heads, heads // kv_heads, causal, tiles.block_kv, tiles.block_q, sms))


def prim_func_for(shape, config: Config = DEFAULT, backend: str = "pipelined"):
    """The main kernel's prim_func for a named shape (the CPU codegen checks and ``emit`` lower
    it)."""
    if backend == "ws":
        return ws.prim_func_for(shape)
    return flash_bwd(shape.batch, shape.seq_len, shape.heads, shape.kv_heads, shape.head_dim,
                     shape.causal, shape.dtype, 1.0 / math.sqrt(shape.head_dim), config)


def pass_configs_for(backend: str = "pipelined") -> dict:
    """The pass configs ``backend``'s main kernel compiles with (``registry``, ``emit``)."""
    return ws.PASS_CONFIGS if backend == "ws" else PASS_CONFIGS


def _compile(func, cfg: Config):
    """``func`` for sm_90a; with ``cfg.uniform_wg`` through ``postproc.uniform_warpgroup``."""
    passes = (postproc.uniform_warpgroup,) if cfg.uniform_wg else ()
    with postproc.active(passes=passes) if passes else contextlib.nullcontext():
        return compile_sm90a(func, PASS_CONFIGS)


@functools.lru_cache(maxsize=None)
def compiled(*args, with_dq=True):
    """The main kernel for ``flash_bwd``'s positional arguments (the Config last)."""
    return _compile(flash_bwd(*args, with_dq=with_dq), args[-1])


@functools.lru_cache(maxsize=None)
def compiled_dq(*args):
    """The deterministic mode's dQ kernel for ``flash_bwd_dq``'s arguments (the Config last)."""
    return _compile(flash_bwd_dq(*args), args[-1])


def attention_bwd(q, k, v, out, dout, lse, causal=False, softmax_scale=None, *, dq=None,
                  dk=None, dv=None, deterministic=False, config: Config | ws.Config | None = None,
                  dq_config: Config = DQ_DEFAULT, dynamic_batch: bool = False,
                  backend: str | None = None):
    """(dq, dk, dv) of BSHD GQA attention, in q's dtype: q (B, S, Hq, D), k / v (B, S, Hkv, D),
    the forward's out and the upstream dout (B, S, Hq, D), lse (B, Hq, S) fp32 natural log.
    Δ·scale = rowsum(dout ∘ out)·scale, lse·log2 e and the cleared fp32 dQ accumulator come
    from ``prepost.preprocess`` (ws' default ``zero_next``: a kept accumulator zeroed by the
    previous call instead), dQ's cast from ``prepost.postprocess`` (FA3's two small kernels).
    ``dq`` / ``dk`` / ``dv``: output buffers shaped as q / k / v (every element is written). ``deterministic``: dQ from ``flash_bwd_dq`` (a fixed order; bitwise repeatable)
    instead of the main kernel's reduce-adds, which land in no fixed order, at two recomputed
    GEMMs a step.
    ``dynamic_batch``: one set of kernels for every batch (B a launch argument). ``config``:
    the main kernel's; None: ``planned_config`` for this device's SMs (a dynamic batch plans
    for batch 1), or ``DEFAULT`` in the deterministic mode (notes/bwd.md, "Session 51").
    ``backend``: the main kernel, "pipelined" (``flash_bwd``; ``config`` a ``Config``) or "ws"
    (``ws.flash_bwd_ws``, explicit roles; S a multiple of 128, D 128, not ``deterministic``;
    ``config`` a ``ws.Config``); None: ``heuristics.backend``'s pick."""
    dims = validate_attention_inputs(q, k, v, supported_head_dims=HEAD_DIMS,
                                     softmax_scale=softmax_scale, causal=causal, devices="any")
    q_like = f"{q.dtype} tensor of q's shape {tuple(q.shape)}"
    want = (dims.batch, dims.heads, dims.seq_len)
    checks = [("out", out, q.shape, q.dtype, q_like), ("dout", dout, q.shape, q.dtype, q_like),
              ("lse", lse, want, torch.float32, f"float32 tensor of shape (B, Hq, S) = {want}")]
    checks += [(name, buf, like.shape, like.dtype, f"{like.dtype} tensor shaped {tuple(like.shape)}")
               for name, buf, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v))
               if buf is not None]
    for name, t, shape, dtype, what in checks:
        if (not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != dtype
                or t.device != q.device):
            raise ValueError(f"{name} must be a {what} on {q.device}")
    for name, buf in (("dq", dq), ("dk", dk), ("dv", dv)):  # written in place
        if buf is not None and not buf.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernel writes it in place)")
    if backend is None:  # a ws.Config names its backend
        backend = "ws" if isinstance(config, ws.Config) else heuristics.backend(
            ws.supports_problem(dims.seq_len, dims.head_dim) is None, config is not None,
            deterministic)
    _check_backend(backend, dims, config, deterministic)
    if deterministic and config is not None and config.head_splits > 1:
        raise ValueError("the deterministic mode takes head_splits 1: split heads add dK and "
                         "dV in no fixed order")
    require_device(q.device, "cuda")
    if config is None and backend == "pipelined":
        config = DEFAULT if deterministic else planned_config(
            1 if dynamic_batch else dims.batch, dims.seq_len, dims.heads, dims.kv_heads,
            dims.head_dim, causal, torch.cuda.get_device_properties(q.device).multi_processor_count)
    out, dout, lse = out.contiguous(), dout.contiguous(), lse.contiguous()
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    batch = DYNAMIC_BATCH if dynamic_batch else dims.batch  # the kernels' cache key
    problem = (batch, dims.seq_len, dims.heads, dims.kv_heads, dims.head_dim, bool(causal),
               dims.tl_dtype, dims.softmax_scale)
    dq = torch.empty_like(q) if dq is None else dq
    rows = (batch, dims.seq_len, dims.heads, dims.head_dim, dims.tl_dtype)
    pre_rows = (*rows, dims.softmax_scale)
    delta_scaled, lse_log2 = torch.empty((2, *want), dtype=torch.float32,
                                         device=q.device).unbind(0)
    if deterministic:
        prepost.compiled_preprocess(*pre_rows, clear_dq=False)(out, dout, lse, delta_scaled,
                                                               lse_log2)
        compiled(*problem, config, with_dq=False)(q, k, v, dout, lse_log2, delta_scaled, dk, dv)
        compiled_dq(*problem, dq_config)(q, k, v, dout, lse_log2, delta_scaled, dq)
        return dq, dk, dv
    if backend == "ws":
        return _run_ws(q, k, v, out, dout, lse, (dq, dk, dv), problem, delta_scaled, lse_log2,
                       config or ws.DEFAULT)
    planes = config.dq_planes
    dq_accum = torch.empty(prepost.dq_accum_shape(dims.batch, dims.seq_len, dims.heads,
                                                  dims.head_dim, planes),
                           dtype=torch.float32, device=q.device)
    pdl = config.pdl
    if config.head_splits == 1:
        prepost.compiled_preprocess(*pre_rows, planes=planes, pdl=pdl)(
            out, dout, lse, delta_scaled, lse_log2, dq_accum)
        compiled(*problem, config)(q, k, v, dout, lse_log2, delta_scaled, dq_accum, dk, dv)
        prepost.compiled_postprocess(*rows, planes, pdl=pdl)(dq_accum, dq)
        return dq, dk, dv
    # split heads add dK and dV into fp32 accumulators, cleared and cast beside dQ's in the
    # same two launches (notes/bwd.md "Session 61")
    kv_accum = torch.empty(prepost.kv_accum_shape(dims.batch, dims.seq_len, dims.kv_heads,
                                                  dims.head_dim),
                           dtype=torch.float32, device=q.device)
    prepost.compiled_preprocess(*pre_rows, planes=planes, pdl=pdl,
                                clear_kv_heads=dims.kv_heads)(
        out, dout, lse, delta_scaled, lse_log2, dq_accum, kv_accum)
    compiled(*problem, config)(q, k, v, dout, lse_log2, delta_scaled, dq_accum, *kv_accum)
    prepost.compiled_postprocess(*rows, planes, pdl=pdl, kv_heads=dims.kv_heads)(
        dq_accum, dq, kv_accum, dk, dv)
    return dq, dk, dv


@functools.lru_cache(maxsize=8)
def dq_accum_pair(device, stream, accum_shape):
    """``ws.Config.zero_next``'s two fp32 dQ accumulators and int32 parity for one device,
    stream and shape, kept between calls (a stream's backwards run in order; another stream
    gets its own pair). Zeroed here: the first call's preprocess flips the parity to 1, its
    main kernel adds into accumulator 1 and zeroes 0. Made outside a CUDA graph capture (a
    warm-up call), or the capture replays the zeroing too."""
    return (torch.zeros((2, *accum_shape), dtype=torch.float32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device))


def _check_backend(backend, dims, config, deterministic):
    if backend not in ("pipelined", "ws"):
        raise ValueError(f"backend must be 'pipelined' or 'ws', not {backend!r}")
    want = ws.Config if backend == "ws" else Config
    if config is not None and not isinstance(config, want):
        raise TypeError(f"backend {backend!r} takes a {want.__module__}.Config, not "
                        f"{type(config).__name__}")
    if backend != "ws":
        return
    why = ws.supports_problem(dims.seq_len, dims.head_dim)
    if why or deterministic:
        raise ValueError("backend 'ws' does not run " + (why or "the deterministic mode"))


def _run_ws(q, k, v, out, dout, lse, grads, problem, delta_scaled, lse_log2, cfg):
    """The non-deterministic path on ``ws``'s main kernel (its dQ accumulator in 2 planes):
    ``problem`` is ``flash_bwd``'s leading arguments, ``grads`` the (dq, dk, dv) buffers."""
    batch, seq_len, heads, kv_heads, head_dim, causal, dtype, scale = problem
    rows = (batch, seq_len, heads, head_dim, dtype)
    accum_shape = prepost.dq_accum_shape(q.shape[0], seq_len, heads, head_dim, ws.PLANES,
                                         cfg.dq_layout)
    if cfg.zero_next:  # the pair and its parity ride after dQ_accum in every kernel
        stream = torch.cuda.current_stream(q.device).cuda_stream
        dq_accum, *parity = dq_accum_pair(q.device, stream, accum_shape)
    else:
        dq_accum, parity = torch.empty(accum_shape, dtype=torch.float32, device=q.device), []
    pre_accum = parity if cfg.zero_next else [dq_accum]
    prepost.compiled_preprocess(*rows, scale, planes=ws.PLANES, layout=cfg.dq_layout,
                                pdl=cfg.pdl, clear_dq=not cfg.zero_next,
                                flip_parity=cfg.zero_next)(out, dout, lse, delta_scaled,
                                                           lse_log2, *pre_accum)
    fill = cfg.fill or heuristics.kv_fill(
        kv_heads, seq_len // ws.BLOCK_KV, causal,
        torch.cuda.get_device_properties(q.device).multi_processor_count)
    ws.compiled(*problem, fill, cfg.dq_layout, cfg.pdl, cfg.zero_next)(
        q, k, v, dout, lse_log2, delta_scaled, dq_accum, *grads[1:], *parity)
    prepost.compiled_postprocess(*rows, ws.PLANES, cfg.dq_layout, pdl=cfg.pdl,
                                 paired=cfg.zero_next)(dq_accum, grads[0], *parity)
    return grads
