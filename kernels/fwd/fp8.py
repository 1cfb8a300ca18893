"""FP8 (e4m3) GQA forward (issue #48): e4m3 Q, K, V with FA3's descales, bf16 O and fp32 LSE.
Correct on the H100 (tests/ws/test_fp8.py: its error and its quantisation error equal FA3
FP8's); 0.88–0.94 × FA3 FP8's speed on the rows where FA3's timing is stable and level with
TileOPs' FP8 op (notes/fp8.md, "Session 38").

FA3 counterpart: ``hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp``'s FP8 path in what it computes
(S = Q Kᵀ and O = P V on e4m3 wgmma, fp32 accumulators, the descales folded into the softmax
scale and O's epilogue), not yet in how it feeds the PV GEMM. FP8 wgmma takes both operands
K-major from shared memory, and TileLang 0.1.15 neither transposes V in shared memory nor
lays P's e4m3 registers out as an RS operand (notes/upstream.md, "Session 35, later"), so here:
  - V is transposed in global memory by the wrapper's Triton pass (``transpose_v``: Vᵀ (B,
    Hkv, Dv, S rounded up to ``block_n``), zeros past S), read K-major by TMA (FA3: LDSM.T /
    STSM in the producer);
  - P goes to the PV GEMM through shared memory (SS; FA3: RS from registers with V's columns
    permuted).

Roles: TileLang's automatic warp specialization of the ``T.Pipelined`` loop, as
``kernels/fwd/pipelined.py``: 2 consumer warpgroups (setmaxnreg 240; S = Q Kᵀ SS, online
softmax with exp2 of the descaled scale·log2 e, P to shared memory, O += P Vᵀᵀ SS) and a
producer warpgroup (setmaxnreg 24; TMA of K and Vᵀ into the ring).
Barriers: the pipeline's mbarriers; TileLang's own shared-memory syncs are off
(``PASS_CONFIGS``), so P's and O's tiles are ordered by ``NamedBarrier``:
  FP8_P_WG1 / FP8_P_WG2  a warpgroup's 128 threads wrote its 64 rows of P (each warpgroup's
                         PV GEMM reads only its own rows, so the two never wait for each other;
                         TileLang's 256-thread syncs ran them in lockstep: 1.16–1.22 × slower)
  FP8_O_TILE             both warpgroups (256) wrote O, before its TMA store
Shared memory at D 128 (bm 128, bn 256, 2 stages, 1-byte elements, no reuse): Q 16 KB, K and
Vᵀ rings 128 KB, P 32 KB, O (bf16) 32 KB: 208 KB.

A second design, ``design="coop-overlap"`` (registered as ``fp8-coop``): kernels/fwd/coop.py's
explicit roles (FA3's: producer warp, two consumer warpgroups with pingpong) and
coop_overlap.py's IntraWGOverlap mainloop on e4m3, P through a tile per warpgroup as here
(coop.py's docstring has its barriers and shared memory). Correct on the H100 (the grid and
both sanitizers at bn 256); 0.93–0.98 × FA3 FP8, the fastest design here (notes/fp8.md,
"Session 40"). A third, ``design="coop-overlap-persistent"`` (``fp8-coop-persistent``), runs
it on the persistent walk at bn 256, O stored from registers: correct, slower than the second.
A fourth, ``design="coop-overlap-rs"`` (``fp8-coop-rs``), is the second with FA3's PV operand:
P stays in registers, its columns in ``coop.operand_key``'s order (no register moves between
threads) and Vᵀ's keys in the same order from the Triton pass, at FA3's bn 224: correct on
the H200, ahead of the second on the 8k rows and behind it on the 4k ones, where the ragged
224-key block computes 3.9 % more keys (0.942–0.989 × FA3 FP8; notes/fp8.md, "Session 42").
A fifth, ``design="coop-overlap-rs-vt"`` (``fp8-coop-rs-vt``), is the fourth reading V as
stored: its producer warpgroup makes Vᵀ in shared memory, FA3's way
(``kernels/fwd/v_transpose.py``), so no Triton pass runs before it: correct on the H100,
0.964–0.971 × the fourth, also with its STSM bank conflicts fixed (notes/fp8.md, "Session 57").
A sixth, ``design="coop-overlap-rs-persistent"`` (``fp8-coop-rs-persistent``), runs the fourth
on the persistent walk; with P in registers O keeps its tile and TMA store (180 KB): level
with the fourth on llama8b-4k, 1 % behind on train8b-4k (notes/fp8.md, "Session 57").
A seventh, ``design="coop-overlap-rs-desc"`` (``fp8-coop-rs-desc``), is the fourth walking
K/V downward as FA3 does (``coop.Config.kv_descending``): a causal tile's diagonal block is
its first, whose softmax has no PV to overlap anyway, and fewer masked blocks remain in the
loop. Correct on the grid (H100); timed call by call, 0.909 / 0.938 / 0.987 / 1.008 × FA3 FP8
on llama8b-4k / -8k, train8b-4k / -8k, 1.00–1.05 × the fourth (notes/fp8.md, "Session 60").
An eighth, ``design="coop-overlap-rs-persistent-desc"`` (``fp8-coop-rs-persistent-desc``), is
the sixth walking downward: correct on the grid and both sanitizers (H100), 0.994 / 0.952 /
0.938 × FA3 FP8 on train8b-4k, llama8b-8k and llama8b-4k (notes/fp8.md, "Session 62"); with
FA3's mask form (each key an immediate) 0.960 / 0.947 on llama8b-8k / -4k ("Session 66").
``attention_fp8``'s default, ``design="auto"``, runs ``heuristics.fp8_design``'s pick: the
seventh where e4m3 K / V exceed half of L2 (train8b-8k: 1.007 × FA3 FP8), the eighth elsewhere,
the first when the lse is asked for.

``quantize(q, k, v, hadamard=)`` makes the inputs from bf16 / fp16 ones: per-(batch, KV head)
descales, and optionally FA3's incoherent processing (q and k rotated by one random-sign
Hadamard matrix; notes/fp8.md has its measured effect on the quantisation error).
"""
import functools
import math
from dataclasses import dataclass

import tilelang
import tilelang.language as T
import torch
import triton
import triton.language as tl

from ws_lab.check import Support, head_dims_supported, require_device, validate_attention_inputs
from ws_lab.kernels import LOG2E
from ws_lab.kernels.fwd import coop, coop_overlap, heuristics
from ws_lab.kernels.fwd.barriers import NamedBarrier
from ws_lab.kernels.fwd.pipelined import Config  # its tile fields and launch order
from ws_lab.kernels.fwd.softmax import (FP8_PROB_LOG2_OFFSET, alloc_softmax_state, normalize_o,
                                        online_softmax, score_mask)
from ws_lab.kernels.fwd.tile_scheduler import cluster_for, persistent_device_args, qtile_grid
from ws_lab.target import H100_L2_BYTES, compile_sm90a

FP8 = torch.float8_e4m3fn
TL_FP8 = "float8_e4m3fn"
INPUT_DTYPE = TL_FP8  # what ``python -m ws_lab.emit fp8`` reports (the shape's dtype is unused)
OUT_DTYPE = torch.bfloat16
HEAD_DIMS = ((64, 64), (128, 128))
DESIGNS = ("pipelined", "coop-overlap", "coop-overlap-persistent", "coop-overlap-rs",
           "coop-overlap-rs-vt", "coop-overlap-rs-persistent", "coop-overlap-rs-desc",
           "coop-overlap-rs-persistent-desc")
RS_DESIGNS = DESIGNS[3:]  # P from registers, Vᵀ's keys in coop.operand_key's order
PERSISTENT_DESIGNS = ("coop-overlap-persistent", "coop-overlap-rs-persistent",
                      "coop-overlap-rs-persistent-desc")
DESCENDING_DESIGNS = ("coop-overlap-rs-desc", "coop-overlap-rs-persistent-desc")
# TileLang's shared-memory syncs off (the kernel's named barriers order P and O; notes/fp8.md,
# "Session 38"), reuse off with them (tilelang #2416), and fast math (bare ex2.approx)
PASS_CONFIGS = {tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,
                tilelang.PassConfigKey.TL_DISABLE_SHARED_MEMORY_REUSE: True,
                tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}


def config_for(causal: bool) -> Config:
    """128 query rows, 256 keys a block, 2 stages: of bn 128 / 192 / 224 / 256 (2 stages) and
    bn 128 (3 stages) the fastest on all four hd128 rows: 1.10–1.15 × bn 128 on the full
    ones, 1.00–1.04 × on the causal ones (notes/fp8.md, "Session 38"). D 64 takes the same
    tiles, not measured."""
    return Config(128, 256, 256, 2, heavy_first=causal)


def padded_len(seq_len: int, block_n: int) -> int:
    """Vᵀ's key columns: S rounded up to a whole K/V block (TMA also needs 16-byte rows)."""
    return -(-seq_len // block_n) * block_n


def flash_fwd_fp8(batch, seq_len, heads, kv_heads, head_dim, causal, softmax_scale,
                  cfg: Config, with_lse: bool = False):
    """Q (B, S, Hq, D), K (B, S, Hkv, D) e4m3, Vt (B, Hkv, D, S_pad) e4m3, descales (B, Hkv)
    fp32 -> O (B, S, Hq, D) bf16 (and LSE (B, Hq, S) fp32, natural log of the descaled scaled
    scores)."""
    bm, bn = cfg.block_m, cfg.block_n
    group = heads // kv_heads
    accum = "float"
    seq_pad = padded_len(seq_len, bn)
    mask = score_mask(causal, seq_len, bm, bn, accum)

    @T.macro
    def body(Q, K, Vt, QDescale, KDescale, VDescale, Out, LSE):
        grid, tile_of = qtile_grid(T.ceildiv(seq_len, bm), heads, batch, cfg.heavy_first)
        with T.Kernel(*grid, threads=cfg.threads) as (gx, gy, bz):
            bx, by = tile_of(gx, gy)  # Q tile, query head
            kvh = by // group
            q_s = T.alloc_shared([bm, head_dim], TL_FP8)
            k_s = T.alloc_shared([bn, head_dim], TL_FP8)
            vt_s = T.alloc_shared([head_dim, bn], TL_FP8)
            p_s = T.alloc_shared([bm, bn], TL_FP8)
            o_s = T.alloc_shared([bm, head_dim], "bfloat16")
            acc_s, p, acc_o, row_max, row_max_prev, row_rescale, block_sum, row_sum = \
                alloc_softmax_state(bm, bn, head_dim, TL_FP8).registers()
            # the scores' scale·log2 e, with Q's and K's descales folded in (FA3's way)
            scale_log2 = T.alloc_local([1], accum)
            scale_log2[0] = softmax_scale * LOG2E * QDescale[bz, kvh] * KDescale[bz, kvh]

            T.copy(Q[bz, bx * bm:(bx + 1) * bm, by, :], q_s)
            T.fill(acc_o, 0)
            T.fill(row_sum, 0)
            T.fill(row_max, -T.infinity(accum))
            n_blocks = T.ceildiv(seq_len, bn)
            loop_range = T.min(n_blocks, T.ceildiv((bx + 1) * bm, bn)) if causal else n_blocks
            for kb in T.Pipelined(loop_range, num_stages=cfg.num_stages):
                T.copy(K[bz, kb * bn:(kb + 1) * bn, kvh, :], k_s)
                T.clear(acc_s)
                T.gemm(q_s, k_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                mask(acc_s, kb, bx * bm)
                online_softmax(acc_s, p, acc_o, row_max, row_max_prev, row_rescale, block_sum,
                               row_sum, bm, bn, head_dim, scale_log2[0],
                               prob_log2_offset=FP8_PROB_LOG2_OFFSET)
                # P through shared memory: TileLang lays e4m3 P out as no RS operand (module
                # docstring); Vᵀ is K-major, as FP8 wgmma needs
                T.copy(p, p_s)
                T.fence_proxy_async()
                T.sync_threads(NamedBarrier.FP8_P_WG1 + T.get_thread_binding() // 128, 128)
                T.copy(Vt[bz, kvh, :, kb * bn:(kb + 1) * bn], vt_s)
                T.gemm(p_s, vt_s, acc_o, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)

            normalize_o(acc_o, row_sum, row_rescale, bm, head_dim)
            for i, j in T.Parallel(bm, head_dim):
                acc_o[i, j] *= VDescale[bz, kvh]
            T.copy(acc_o, o_s)
            T.fence_proxy_async()
            T.sync_threads(NamedBarrier.FP8_O_TILE, 256)
            T.copy(o_s, Out[bz, bx * bm:(bx + 1) * bm, by, :])
            if with_lse:  # ln Σ exp(s·scale) = (max·scale·log2 e + log2 Σ − offset) / log2 e
                for i in T.Parallel(bm):
                    block_sum[i] = (row_max[i] * scale_log2[0] + T.log2(row_sum[i])
                                    - FP8_PROB_LOG2_OFFSET) / LOG2E
                T.copy(block_sum, LSE[bz, by, bx * bm:(bx + 1) * bm])

    # a fresh annotation per parameter: parameters sharing one T.Tensor object become one
    # buffer (tests/upstream/test_shared_annotation.py)
    def qo_t(dtype):
        return T.Tensor([batch, seq_len, heads, head_dim], dtype)

    def descale_t():
        return T.Tensor([batch, kv_heads], accum)

    k_t = T.Tensor([batch, seq_len, kv_heads, head_dim], TL_FP8)
    vt_t = T.Tensor([batch, kv_heads, head_dim, seq_pad], TL_FP8)
    if with_lse:
        @T.prim_func
        def main_lse(Q: qo_t(TL_FP8), K: k_t, Vt: vt_t, QDescale: descale_t(),
                     KDescale: descale_t(), VDescale: descale_t(), Out: qo_t("bfloat16"),
                     LSE: T.Tensor([batch, heads, seq_len], accum)):
            body(Q, K, Vt, QDescale, KDescale, VDescale, Out, LSE)

        return main_lse

    @T.prim_func
    def main(Q: qo_t(TL_FP8), K: k_t, Vt: vt_t, QDescale: descale_t(), KDescale: descale_t(),
             VDescale: descale_t(), Out: qo_t("bfloat16")):
        body(Q, K, Vt, QDescale, KDescale, VDescale, Out, None)

    return main


@functools.lru_cache(maxsize=None)
def compiled(*args):
    return compile_sm90a(flash_fwd_fp8(*args), PASS_CONFIGS)


def coop_config_for(causal: bool, persistent: bool = False, cluster: int = 1,
                    p_in_registers: bool = False, transpose_v: bool = False,
                    kv_descending: bool = False, pingpong: bool = True) -> coop.Config:
    """The coop-overlap designs' tiles: bn 256, 2 stages, pingpong unless ``pingpong`` is False
    (``heuristics.fp8_pingpong``). bn 256 measured 1.06–1.10 × bn 128 and the grid and
    sanitizers pass at it (notes/fp8.md, "Session 39", "Session 40").
    Shared memory at D 128: non-persistent 212 KB (Q, K / Vᵀ rings, P, the bf16 O tile);
    persistent 196 KB (Q's two slots, no O tile: O leaves from registers).
    ``p_in_registers`` ("coop-overlap-rs"): FA3's FP8 tile, bn 224, P from registers (S, P
    and O in flight at bn 256 pass the consumers' 240 registers: ptxas serialises the wgmmas;
    notes/fp8.md, "Session 41"); 164 KB, no P tile; persistent ("coop-overlap-rs-persistent")
    176 KB, O keeping its tile. ``transpose_v`` ("coop-overlap-rs-vt"): the same with Vᵀ made
    in the kernel (kernels/fwd/v_transpose.py): 220 KB. ``kv_descending``
    ("coop-overlap-rs-desc"): the fourth walking K/V downward, FA3's order."""
    if p_in_registers:
        return coop.Config(224, 2, pingpong, heavy_first=causal, p_in_registers=True,
                           transpose_v=transpose_v, persistent=persistent, cluster=cluster,
                           kv_descending=kv_descending)
    return coop.Config(256, 2, pingpong, heavy_first=causal,
                       persistent=persistent, cluster=cluster)


def coop_mainloop(cfg: coop.Config):
    """The IntraWGOverlap mainloop; with P in registers without deferred row sums (their
    partial sums are 8 registers a thread, which put bn 224 into 304 B of spills at S 8192;
    notes/fp8.md, "Session 41")."""
    return coop_overlap.overlap_mainloop(deferred_sums=not cfg.p_in_registers)


def design_config(design: str, causal: bool) -> coop.Config:
    """The tiles of a non-persistent coop-overlap design."""
    return coop_config_for(causal, p_in_registers=design in RS_DESIGNS,
                           transpose_v=design == "coop-overlap-rs-vt",
                           kv_descending=design in DESCENDING_DESIGNS,
                           pingpong=heuristics.fp8_pingpong(design, causal))


def postproc_passes_for(design: str = "pipelined") -> tuple:
    """The post-processor passes ``design`` compiles under (``ws_lab.emit`` shows its kernel
    through them): the IntraWGOverlap mainloop's for the coop-overlap designs, none for the
    pipelined one."""
    if design == "pipelined":
        return ()
    return coop_mainloop(design_config(design, False)).postproc_passes


def compiled_coop(batch, seq_len, heads, kv_heads, head_dim, causal, softmax_scale,
                  cfg: coop.Config, *persistent_args):
    """``coop.coop_fwd`` on e4m3 (Q, K, Vᵀ, the descales, bf16 O) with the IntraWGOverlap
    mainloop, compiled under its post-processor passes (``persistent_args``: the persistent
    walk's SM count and L2 bytes)."""
    return coop.compiled(batch, seq_len, heads, kv_heads, head_dim, head_dim, causal,
                         coop.FP8_DTYPE, softmax_scale, cfg, coop_mainloop(cfg),
                         *persistent_args)


def coop_kernel(problem, design: str, cluster, device):
    """(Config, compiled kernel) of a coop-overlap design for ``problem`` (batch, S, Hq, Hkv,
    D, causal, scale); the persistent walk sized to ``device`` and, ``cluster`` None, paired by
    ``cluster_for`` on e4m3 K / V."""
    if design not in PERSISTENT_DESIGNS:
        cfg = design_config(design, problem[5])
        return cfg, compiled_coop(*problem, cfg)
    sms, l2 = persistent_device_args(device)
    cfg = persistent_config(design, problem, l2, cluster)
    return cfg, compiled_coop(*problem, cfg, sms, l2)


def persistent_config(design: str, problem, l2_bytes: int, cluster=None) -> coop.Config:
    """A persistent design's tiles for ``problem``; ``cluster`` None: paired by ``cluster_for``
    on e4m3 K / V."""
    if cluster is None:
        cluster = cluster_for(*problem[:4], problem[4], problem[4], l2_bytes, elem_bytes=1)
    return coop_config_for(problem[5], persistent=True, cluster=cluster,
                           p_in_registers=design in RS_DESIGNS,
                           kv_descending=design in DESCENDING_DESIGNS,
                           pingpong=heuristics.fp8_pingpong(design, problem[5]))


TRANSPOSE_KEYS = 64  # keys a program of ``transpose_v`` moves (all Dv of them)


@triton.jit
def _transpose_v_kernel(V, Vt, seq_len, seq_pad, kv_heads, stride_b, stride_s, stride_h,
                        DV: tl.constexpr, KEYS: tl.constexpr, OPERAND_ORDER: tl.constexpr):
    """Vᵀ[b, h, :, s0:s0 + KEYS] = V[b, s0:s0 + KEYS, h, :]ᵀ, bytes (e4m3 viewed as uint8);
    zeros for keys in [S, S_pad). Loads run along Dv, stores along the keys. OPERAND_ORDER:
    Vᵀ's column a holds key ``coop.operand_key(a)``, P's order when it stays in registers."""
    s0 = tl.program_id(0) * KEYS
    bh = tl.program_id(1).to(tl.int64)  # 64-bit: the batch offsets may pass 2^31
    b, h = bh // kv_heads, bh % kv_heads
    cols = tl.arange(0, KEYS)
    keys = s0 + cols
    if OPERAND_ORDER:  # coop.operand_key, within each 16 keys
        src = s0 + cols - cols % 16 + (cols % 4 // 2) * 8 + (cols % 16 // 4) * 2 + cols % 2
    else:
        src = keys
    dims = tl.arange(0, DV)
    tile = tl.load(V + b * stride_b + h * stride_h + src[:, None] * stride_s + dims[None, :],
                   mask=src[:, None] < seq_len, other=0)
    tl.store(Vt + bh * DV * seq_pad + dims[:, None] * seq_pad + keys[None, :], tl.trans(tile),
             mask=keys[None, :] < seq_pad)


def transpose_v(v: torch.Tensor, block_n: int, operand_order: bool = False) -> torch.Tensor:
    """v (B, S, Hkv, Dv), Dv contiguous -> Vᵀ (B, Hkv, Dv, S_pad), the key columns past S zero:
    one Triton pass, no zero-fill (torch's zero-fill and strided e4m3 copy ran at ~0.1 TB/s,
    5–15 % of the call; notes/fp8.md, "Session 38"). ``operand_order``: the keys of each 16 in
    ``coop.operand_key``'s order (for P in registers)."""
    batch, seq_len, kv_heads, head_dim_v = v.shape
    seq_pad = padded_len(seq_len, block_n)
    vt = torch.empty(batch, kv_heads, head_dim_v, seq_pad, dtype=v.dtype, device=v.device)
    src = v.view(torch.uint8)
    grid = (triton.cdiv(seq_pad, TRANSPOSE_KEYS), batch * kv_heads)
    _transpose_v_kernel[grid](src, vt.view(torch.uint8), seq_len, seq_pad, kv_heads,
                              src.stride(0), src.stride(1), src.stride(2), DV=head_dim_v,
                              KEYS=TRANSPOSE_KEYS, OPERAND_ORDER=operand_order)
    return vt


def attention_fp8(q, k, v, causal=False, softmax_scale=None, *, q_descale=None, k_descale=None,
                  v_descale=None, out=None, return_lse=False, design: str = "auto",
                  cluster: int | None = None):
    """BSHD GQA forward on e4m3 inputs: q (B, S, Hq, D), k / v (B, S, Hkv, D) float8_e4m3fn,
    descales (B, Hkv) fp32 as FA3's interface takes them (None: 1), the true q is q · q_descale
    of its KV head's group. Returns bf16 out (B, S, Hq, D) (``out``: written in place), and with
    ``return_lse`` the fp32 lse (B, Hq, S) of the descaled, scaled scores. ``design``: "auto"
    (the default: the fastest measured design for the call, ``heuristics.fp8_design``),
    "pipelined" (this file's kernel), "coop-overlap" (kernels/fwd/coop.py's explicit roles
    with coop_overlap's IntraWGOverlap mainloop, e4m3; no lse yet) or
    "coop-overlap-persistent" (the same on the persistent walk; ``cluster``: 2 forces CTA
    pairs multicasting K / Vᵀ, 1 single CTAs, None picks by ``cluster_for``) or
    "coop-overlap-rs" (the second with P from registers at bn 224) or "coop-overlap-rs-vt"
    (the fourth reading V as stored: its producer warpgroup transposes it) or
    "coop-overlap-rs-persistent" (the fourth on the persistent walk, O through its own tile;
    ``cluster`` as the third's) or "coop-overlap-rs-desc" (the fourth walking K/V downward,
    FA3's order) or "coop-overlap-rs-persistent-desc" (the sixth walking downward)."""
    if design != "auto" and design not in DESIGNS:
        raise ValueError(f"design must be 'auto' or one of {DESIGNS}, got {design!r}")
    if return_lse and design not in ("auto", "pipelined"):
        raise ValueError(f"return_lse needs design='pipelined' (the {design} kernel has no lse "
                         "output yet)")
    if cluster not in (None, 1, 2) or (cluster is not None and design not in PERSISTENT_DESIGNS):
        raise ValueError(f"cluster must be None, 1 or 2 with a persistent design "
                         f"{PERSISTENT_DESIGNS}, got cluster={cluster!r} with design={design!r}")
    dims = validate_attention_inputs(q, k, v, supported_head_dims=HEAD_DIMS, causal=causal,
                                     softmax_scale=softmax_scale, dtypes=(FP8,), devices="any")
    want = (dims.batch, dims.kv_heads)
    descales = []
    for name, d in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if d is None:
            d = torch.ones(want, dtype=torch.float32, device=q.device)
        if (not isinstance(d, torch.Tensor) or tuple(d.shape) != want
                or d.dtype != torch.float32 or d.device != q.device):
            raise ValueError(f"{name} must be a float32 tensor of shape (B, Hkv) = {want} on "
                             f"{q.device}")
        descales.append(d.contiguous())
    if out is not None and (not isinstance(out, torch.Tensor) or out.shape != q.shape
                            or out.dtype != OUT_DTYPE or not out.is_contiguous()
                            or out.device != q.device):
        raise ValueError(f"out must be a contiguous {OUT_DTYPE} tensor of q's shape "
                         f"{tuple(q.shape)} on {q.device}")
    require_device(q.device, "cuda")
    if design == "auto":
        design = heuristics.fp8_design(dims.batch, dims.seq_len, dims.kv_heads, dims.head_dim,
                                       return_lse, persistent_device_args(q.device)[1])
    problem = (dims.batch, dims.seq_len, dims.heads, dims.kv_heads, dims.head_dim, bool(causal),
               dims.softmax_scale)
    if design == "pipelined":
        cfg = config_for(bool(causal))
        kernel = compiled(*problem, cfg, *((True,) if return_lse else ()))
    else:
        cfg, kernel = coop_kernel(problem, design, cluster, q.device)
    out = torch.empty(q.shape, dtype=OUT_DTYPE, device=q.device) if out is None else out
    if design == "coop-overlap-rs-vt":
        v_arg = v  # contiguous BSHD (validated), TMA reads its blocks as stored
    else:
        v_arg = transpose_v(v, cfg.block_n, operand_order=design in RS_DESIGNS)
    args = [q, k, v_arg, *descales, out]
    if not return_lse:
        kernel(*args)
        return out
    lse = torch.empty(dims.batch, dims.heads, dims.seq_len, dtype=torch.float32, device=q.device)
    kernel(*args, lse)
    return out, lse


E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


@dataclass(frozen=True)
class Quantized:
    """e4m3 q, k, v and their (B, Hkv) fp32 descales: the true x is x.float() · descale."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_descale: torch.Tensor
    k_descale: torch.Tensor
    v_descale: torch.Tensor

    def descales(self) -> dict:
        return dict(q_descale=self.q_descale, k_descale=self.k_descale, v_descale=self.v_descale)

    def dequantised(self) -> tuple:
        """The float64 (q, k, v) these stand for: each element times its KV head's descale
        (what the float64 oracle compares an FP8 kernel's own error against)."""
        return tuple(dequantise(x, d) for x, d in ((self.q, self.q_descale),
                                                    (self.k, self.k_descale),
                                                    (self.v, self.v_descale)))


def dequantise(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """e4m3 x (B, S, H, D) times its (B, Hkv) descale, each KV head's group of heads by its
    own, as float64."""
    batch, seq_len, heads, head_dim = x.shape
    kv_heads = descale.shape[1]
    grouped = x.to(torch.float64).view(batch, seq_len, kv_heads, heads // kv_heads, head_dim)
    return (grouped * descale.double()[:, None, :, None, None]).view(x.shape)


def hadamard_rotation(head_dim: int, seed: int, device=None) -> torch.Tensor:
    """diag(random signs) · H / sqrt(D), H the Sylvester Hadamard matrix: orthogonal, so
    (q R)(k R)ᵀ = q kᵀ while an outlier channel's mass spreads over all D (FA3's incoherent
    processing)."""
    if head_dim & (head_dim - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two head dim, got {head_dim}")
    hadamard = torch.ones(1, 1, dtype=torch.float64)
    while hadamard.shape[0] < head_dim:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1),
                              torch.cat([hadamard, -hadamard], 1)], 0)
    generator = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (head_dim,), generator=generator).double() * 2 - 1
    return (signs[:, None] * hadamard / head_dim ** 0.5).to(device=device)


def _quantize(x: torch.Tensor, kv_heads: int):
    """x (B, S, H, D) -> (e4m3 x / descale, descale (B, Hkv)): one scale a KV head's group, its
    largest |x| mapped to E4M3_MAX."""
    batch, seq_len, heads, head_dim = x.shape
    grouped = x.float().view(batch, seq_len, kv_heads, heads // kv_heads, head_dim)
    descale = grouped.abs().amax(dim=(1, 3, 4)).clamp_min(1e-12) / E4M3_MAX
    scaled = grouped / descale[:, None, :, None, None]
    return scaled.view(x.shape).to(FP8), descale.contiguous()


def quantize(q, k, v, *, hadamard: bool = False, seed: int = 0) -> Quantized:
    """bf16 / fp16 BSHD q, k, v -> e4m3 with per-(batch, KV head) descales, as
    ``attention_fp8`` takes them. ``hadamard``: q and k rotated first by the same random-sign
    Hadamard matrix (``hadamard_rotation``), which leaves every score as it was and cuts the
    quantisation error where a few channels carry outliers (notes/fp8.md)."""
    if hadamard:
        rotation = hadamard_rotation(q.shape[-1], seed, q.device).to(torch.float32)
        q, k = (x.float() @ rotation for x in (q, k))
    kv_heads = k.shape[2]
    (q8, qd), (k8, kd), (v8, vd) = (_quantize(x, kv_heads) for x in (q, k, v))
    return Quantized(q8, k8, v8, qd, kd, vd)


def supports(shape, design: str = "pipelined") -> Support:
    """Every design runs the same head dims (``design`` is the registry variant's option)."""
    return head_dims_supported(shape.head_dim, shape.head_dim_v, HEAD_DIMS)


def prim_func_for(shape, config=None, design: str = "pipelined"):
    """The prim_func for a named shape (``python -m ws_lab.emit`` and the CPU codegen checks);
    ``config``: the design's Config (``config_for`` / ``coop_config_for`` by default)."""
    scale = 1.0 / math.sqrt(shape.head_dim)
    if design == "pipelined":
        return flash_fwd_fp8(shape.batch, shape.seq_len, shape.heads, shape.kv_heads,
                             shape.head_dim, shape.causal, scale,
                             config or config_for(shape.causal))
    if config is None and design in PERSISTENT_DESIGNS:  # paired as on an H100
        config = persistent_config(design, (shape.batch, shape.seq_len, shape.heads,
                                            shape.kv_heads, shape.head_dim, shape.causal),
                                   H100_L2_BYTES)
    config = config or design_config(design, shape.causal)
    return coop.coop_fwd(shape.batch, shape.seq_len, shape.heads, shape.kv_heads,
                         shape.head_dim, shape.head_dim, shape.causal, coop.FP8_DTYPE, scale,
                         config, coop_mainloop(config))
