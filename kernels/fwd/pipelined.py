"""Pipelined GQA forward — the lab's TileLang baseline.

FA3 counterpart: none by hand; this is TileLang's own ``T.Pipelined`` flash-attention
(TileLang ``examples/flash_attention`` GQA BSHD), which on sm_90a the compiler turns into a
producer warpgroup (TMA, ``setmaxnreg`` 24) plus ``threads / 128`` consumer warpgroups
(``setmaxnreg`` 240) by itself. Every warp-specialized kernel in the lab is measured against it.

Roles (after TileLang's automatic warp specialization, 2 consumer WGs at ``threads=256``):
  WG0..WGn-1  consumers: S = Q Kᵀ (SS wgmma), online softmax (exp2, scale·log2 e), O += P V.
  WGn         producer: TMA loads of K/V into a ``num_stages`` ring (full/empty mbarriers).
Shared memory (2-byte elements): Q bm·D + stages·bn·(D + Dv), O bm·Dv reusing Q's bytes —
  D 128: 32 + 64 = 96 KB at stages 1 (160 KB at 2); D 256: 192 KB; D 64 / Dv 512: 8 + 72 KB.

Masking: causal KV blocks above the diagonal are skipped (``loop_range``); only the blocks that
straddle the diagonal, and the ragged last KV block (S not a multiple of bn), get -inf scores.
Rows past S are computed on TMA's zero fill and clipped by the TMA store. Causal grids launch
the heaviest Q tiles first (``Config.heavy_first``: +13 % on llama8b-4k, NOTES.md).

``attention(..., return_lse=True)`` also returns each row's log-sum-exp (B, Hq, S), fp32: the
backward's input (kernels/bwd; ``torch.ops.ws_lab.attention`` trains through it). Without it the
emitted CUDA is byte for byte what it was before the option existed.
"""

import functools
import math
from dataclasses import dataclass

import tilelang.language as T
import torch

from ws_lab.kernels import DYNAMIC_BATCH, LOG2E, batch_extent
from ws_lab.kernels.fwd.softmax import alloc_softmax_state, normalize_o, online_softmax
from ws_lab.kernels.fwd.tile_scheduler import qtile_grid
from ws_lab.check import Support, head_dims_supported, validate_attention_inputs
from ws_lab.shapes import Shape
from ws_lab.target import compile_sm90a



@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    threads: int
    num_stages: int
    # Heaviest Q tiles first (FA3's LPT order for causal): the grid is (heads, q-tiles, batch)
    # and tile y is ceil(S/bm) - 1 - blockIdx.y, so the last wave holds the short diagonal tiles.
    heavy_first: bool = False


# (D, Dv, causal) -> Config, from `python bench/pipelined.py --tune` on the H100 (notes/pipelined.md,
# 2026-11-22). Measured winners: D 64/128/256 non-causal, D 128 causal. The D 64/256 causal rows
# take the D 128 causal rule (heavy_first); the Dv 512 row is the lab's earlier measurement
# (bm64 bn64 t128 s1, 77 TFLOPS on largehdv-2k) and Dv 256 follows it.
CONFIGS: dict[tuple[int, int, bool], Config] = {
    (64, 64, False): Config(128, 128, 256, 1),
    (64, 64, True): Config(128, 128, 256, 1, heavy_first=True),
    (128, 128, False): Config(128, 128, 256, 1),
    (128, 128, True): Config(128, 128, 256, 1, heavy_first=True),
    (256, 256, False): Config(128, 128, 256, 1),
    (256, 256, True): Config(128, 128, 256, 1, heavy_first=True),
    (64, 512, False): Config(64, 64, 128, 1),
    (64, 512, True): Config(64, 64, 128, 1, heavy_first=True),
    (64, 256, False): Config(64, 64, 128, 1),
    (64, 256, True): Config(64, 64, 128, 1, heavy_first=True),
}
HEAD_DIMS = sorted({(d, dv) for d, dv, _ in CONFIGS})


def config_for(head_dim: int, head_dim_v: int, causal: bool) -> Config:
    return CONFIGS[(head_dim, head_dim_v, causal)]


def flash_fwd(batch, seq_len, heads, kv_heads, head_dim, head_dim_v, causal, dtype, softmax_scale,
              cfg: Config, with_lse: bool = False):
    """The TileLang prim_func: q (B,S,Hq,D), k (B,S,Hkv,D), v (B,S,Hkv,Dv) -> out (B,S,Hq,Dv),
    and with ``with_lse`` the rows' log-sum-exp of the scaled scores, LSE (B,Hq,S) fp32, natural
    log: what the backward (kernels/bwd) reads. ``batch`` may be ``DYNAMIC_BATCH``."""
    batch = batch_extent(batch)
    bm, bn = cfg.block_m, cfg.block_n
    group = heads // kv_heads
    scale_log2 = softmax_scale * LOG2E
    accum = "float"
    neg_inf = -T.infinity(accum)

    @T.macro
    def body(Q, K, V, Out, LSE):
        n_qtiles = T.ceildiv(seq_len, bm)
        grid, tile_of = qtile_grid(n_qtiles, heads, batch, cfg.heavy_first)
        with T.Kernel(*grid, threads=cfg.threads) as (gx, gy, bz):
            bx, by = tile_of(gx, gy)  # Q tile, query head
            q_s = T.alloc_shared([bm, head_dim], dtype)
            k_s = T.alloc_shared([bn, head_dim], dtype)
            v_s = T.alloc_shared([bn, head_dim_v], dtype)
            o_s = T.alloc_shared([bm, head_dim_v], dtype)
            acc_s, p, acc_o, row_max, row_max_prev, row_rescale, block_sum, row_sum = \
                alloc_softmax_state(bm, bn, head_dim_v, dtype).registers()

            T.copy(Q[bz, bx * bm:(bx + 1) * bm, by, :], q_s)
            T.fill(acc_o, 0)
            T.fill(row_sum, 0)
            T.fill(row_max, neg_inf)

            n_blocks = T.ceildiv(seq_len, bn)
            loop_range = T.min(n_blocks, T.ceildiv((bx + 1) * bm, bn)) if causal else n_blocks
            for kb in T.Pipelined(loop_range, num_stages=cfg.num_stages):
                T.copy(K[bz, kb * bn:(kb + 1) * bn, by // group, :], k_s)
                # Scores start at -inf where the key is in the future (causal) or past the end
                # (ragged tail), and at 0 elsewhere; the GEMM accumulates onto them. Only the
                # blocks that straddle the diagonal (or the ragged last block) pay for the mask.
                if causal:
                    if (kb + 1) * bn > bx * bm:
                        for i, j in T.Parallel(bm, bn):
                            acc_s[i, j] = T.if_then_else(bx * bm + i >= kb * bn + j, 0, neg_inf)
                    else:
                        T.clear(acc_s)
                elif seq_len % bn:
                    if kb == n_blocks - 1:
                        for i, j in T.Parallel(bm, bn):
                            acc_s[i, j] = T.if_then_else(kb * bn + j < seq_len, 0, neg_inf)
                    else:
                        T.clear(acc_s)
                else:
                    T.clear(acc_s)
                T.gemm(q_s, k_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)

                online_softmax(acc_s, p, acc_o, row_max, row_max_prev, row_rescale, block_sum,
                               row_sum, bm, bn, head_dim_v, scale_log2)
                T.copy(V[bz, kb * bn:(kb + 1) * bn, by // group, :], v_s)
                T.gemm(p, v_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

            normalize_o(acc_o, row_sum, row_rescale, bm, head_dim_v)
            T.copy(acc_o, o_s)
            T.copy(o_s, Out[bz, bx * bm:(bx + 1) * bm, by, :])
            if with_lse:  # ln Σ exp(s·scale) = (max·scale·log2 e + log2 Σ) / log2 e
                for i in T.Parallel(bm):
                    block_sum[i] = (row_max[i] * scale_log2 + T.log2(row_sum[i])) / LOG2E
                T.copy(block_sum, LSE[bz, by, bx * bm:(bx + 1) * bm])

    q_t = T.Tensor([batch, seq_len, heads, head_dim], dtype)
    kv_t = T.Tensor([batch, seq_len, kv_heads, head_dim], dtype)
    v_t = T.Tensor([batch, seq_len, kv_heads, head_dim_v], dtype)
    o_t = T.Tensor([batch, seq_len, heads, head_dim_v], dtype)
    if with_lse:
        @T.prim_func
        def main_lse(Q: q_t, K: kv_t, V: v_t, Out: o_t,
                     LSE: T.Tensor([batch, heads, seq_len], accum)):
            body(Q, K, V, Out, LSE)

        return main_lse

    @T.prim_func
    def main(Q: q_t, K: kv_t, V: v_t, Out: o_t):
        body(Q, K, V, Out, None)

    return main


def supports(shape: Shape) -> Support:
    return head_dims_supported(shape.head_dim, shape.head_dim_v, HEAD_DIMS)


def prim_func_for(shape: Shape, config: "Config | None" = None):
    """The prim_func the lab runs for a named shape (used by ``ws_lab.emit``)."""
    cfg = config or config_for(shape.head_dim, shape.head_dim_v, shape.causal)
    return flash_fwd(shape.batch, shape.seq_len, shape.heads, shape.kv_heads, shape.head_dim,
                     shape.head_dim_v, shape.causal, shape.dtype, 1.0 / math.sqrt(shape.head_dim), cfg)


@functools.lru_cache(maxsize=None)
def compiled(*args):
    """The compiled kernel for ``flash_fwd``'s arguments (thread-safe: tests compile in parallel)."""
    return compile_sm90a(flash_fwd(*args))


def attention(q, k, v, causal=False, softmax_scale=None, out=None, config: "Config | None" = None,
              return_lse: bool = False, dynamic_batch: bool = False):
    """BSHD GQA forward. q (B,S,Hq,D), k (B,S,Hkv,D), v (B,S,Hkv,Dv) fp16/bf16 on CUDA. With
    ``return_lse``: (out, lse), lse (B,Hq,S) fp32, the natural log-sum-exp of each row's
    scaled scores. ``dynamic_batch``: one kernel for every batch (B a launch argument)."""
    dims = validate_attention_inputs(q, k, v, supported_head_dims=HEAD_DIMS, out=out,
                                     softmax_scale=softmax_scale, causal=causal)
    cfg = config or config_for(dims.head_dim, dims.head_dim_v, bool(causal))
    kernel = compiled(DYNAMIC_BATCH if dynamic_batch else dims.batch, dims.seq_len, dims.heads, dims.kv_heads, dims.head_dim,
                      dims.head_dim_v, bool(causal), dims.tl_dtype, dims.softmax_scale, cfg,
                      *((True,) if return_lse else ()))  # the same cache key as precompiles
    if out is None:
        out = torch.empty(*q.shape[:3], dims.head_dim_v, dtype=q.dtype, device=q.device)
    if not return_lse:
        kernel(q, k, v, out)
        return out
    lse = torch.empty(dims.batch, dims.heads, dims.seq_len, dtype=torch.float32, device=q.device)
    kernel(q, k, v, out, lse)
    return out, lse
