"""The two small kernels around a backward's main kernel, shared by the lab's backwards.

FA3 counterparts: ``hopper/flash_bwd_preprocess_kernel.h`` and
``hopper/flash_bwd_postprocess_kernel.h``, without their warp roles (one warpgroup, no
barriers beyond TileLang's own):

- ``preprocess``: Δ·scale = rowsum(dO ∘ O)·scale and lse·log2 e in fp32 (B, Hq, S), the
  forms the main kernels use (P = exp2(S·scale·log2 e − lse·log2 e) and dS = P ∘ (dP·scale −
  Δ·scale) are one FFMA an element each: FA3's ``softmax_lse_log2``), and (``clear_dq``) the
  zeroed fp32 dQ accumulator the main kernel's bulk reduce-adds add into. A CTA takes ``ROWS``
  rows of one head; shared memory: none (fragments only).
- ``postprocess``: the accumulator cast to q's dtype, ``ROWS`` rows of one head a CTA, through a
  (ROWS, D) shared tile for a TMA store.

The accumulator (``dq_accum_shape``) is (B, Hq, planes, S rounded up to ``DQ_ROW_ALIGN``,
D / planes + ``DQ_PAD``): one plane by default; with ``pipelined.Config.dq_planes = 2`` plane
p holds columns p·D/2 … of dQ, the part consumer warpgroup p of the main kernel computes
(FA3's per-warpgroup dQaccum). A Q tile of one head is one contiguous run a plane, added by
one bulk reduce-add from a staging tile whose rows the pad keeps on distinct shared-memory
banks. Rows past S and the pad columns only ever receive zeros' sums and are never read.
The "swizzled" layout (``ws.Config.dq_layout``'s default, 64-column planes) has no pad: each row's
8-column groups are XORed by the row mod 8 (``stored_column``), which keeps the staging stores
on distinct banks and the runs 1/9 shorter; the postprocess reads it back through the same map.
"""
import functools

import tilelang.language as T

from ws_lab.kernels import LOG2E, batch_extent
from ws_lab.target import compile_sm90a

ROWS = 64  # rows of one head a CTA: 64 × 128 fp32 accumulator elements, 64 a thread
THREADS = 128
DQ_PAD = 8  # fp32 columns after D: a staging row starts 8 banks after the one above it
DQ_ROW_ALIGN = 128  # the accumulator's rows: S rounded up to this (a multiple of every block_q)
DQ_LAYOUTS = ("padded", "swizzled")
SWIZZLED_WIDTH = 64  # a swizzled plane's columns: 8 groups of 8, one per row mod 8


def dq_accum_shape(batch, seq_len, heads, head_dim, planes=1, layout="padded"):
    """The fp32 dQ accumulator's shape (see the module docstring)."""
    if planes < 1 or head_dim % (4 * planes):
        raise ValueError(f"the dQ accumulator's {planes} planes must split head_dim {head_dim} "
                         "into multiples of 4 columns")
    if layout not in DQ_LAYOUTS or (layout == "swizzled"
                                    and head_dim // planes != SWIZZLED_WIDTH):
        raise ValueError(f"dQ layout {layout!r}: one of {DQ_LAYOUTS}, swizzled on planes of "
                         f"{SWIZZLED_WIDTH} columns (head_dim {head_dim}, {planes} planes)")
    rows = -(-seq_len // DQ_ROW_ALIGN) * DQ_ROW_ALIGN
    return batch, heads, planes, rows, head_dim // planes + (DQ_PAD if layout == "padded" else 0)


def kv_accum_shape(batch, seq_len, kv_heads, head_dim):
    """Split heads' fp32 dK and dV accumulators, one tensor: (2, …) of the one-plane padded
    dQ accumulator's shape over the KV heads (0: dK, 1: dV)."""
    return (2, *dq_accum_shape(batch, seq_len, kv_heads, head_dim))


def stored_column(layout, row, col):
    """The column of an accumulator plane that holds dQ's column ``col`` of row ``row``:
    swizzled, col's 8-column group XORed by row mod 8, written so that col mod 8 stays an
    addend (TileLang then keeps the staging stores vectorized)."""
    return (col // 8 ^ row % 8) * 8 + col % 8 if layout == "swizzled" else col


def preprocess(batch, seq_len, heads, head_dim, dtype, softmax_scale, clear_dq: bool = True,
               planes: int = 1, layout: str = "padded", pdl: bool = False,
               flip_parity: bool = False, clear_kv_heads: int = 0):
    """(O, dO, LSE) -> Δ·scale and lse·log2 e (the module docstring); with ``clear_dq`` (the
    main kernel's dQ path) also the zeroed accumulator of ``planes`` planes. ``pdl``: each CTA
    lets the next kernel launch at its start (that kernel waits before it reads any of this).
    ``flip_parity`` (instead of ``clear_dq``): one thread flips the int32 parity that picks
    which of a pair of accumulators this call's main kernel adds into (``ws.Config.zero_next``:
    the last call's main kernel zeroed it). ``clear_kv_heads`` (with ``clear_dq``): also zero
    the (2, …) dK / dV accumulator of that many KV heads (``kv_accum_shape``) that split heads
    add into, in the same launch. ``batch`` may be ``DYNAMIC_BATCH``."""
    if clear_dq and flip_parity:
        raise ValueError("flip_parity replaces clear_dq: the main kernel zeroed the accumulator")
    if clear_kv_heads and not clear_dq:
        raise ValueError("clear_kv_heads clears beside clear_dq (the split-heads path)")
    batch = batch_extent(batch)
    accum = "float"
    accum_shape = dq_accum_shape(batch, seq_len, heads, head_dim, planes, layout)
    width = head_dim // planes

    @T.macro
    def clear_kv(zeros, KVaccum, h, bx, bz):
        """The first KV heads' CTAs clear their rows of dK's and dV's accumulators too."""
        if h < clear_kv_heads:
            for grad in range(2):
                for p in range(head_dim // width):
                    T.copy(zeros, KVaccum[grad, bz, h, 0, bx * ROWS:(bx + 1) * ROWS,
                                          p * width:(p + 1) * width])

    @T.macro
    def body(O, dO, LSE, DeltaScaled, LSElog2, dQ, Parity, KVaccum):
        with T.Kernel(T.ceildiv(seq_len, ROWS), heads, batch, threads=THREADS) as (bx, h, bz):
            if pdl:
                T.pdl_trigger()
            if flip_parity:
                if bx == 0 and h == 0 and bz == 0 and T.get_thread_binding() == 0:
                    Parity[0] = 1 - Parity[0]
            o = T.alloc_fragment([ROWS, head_dim], dtype)
            do = T.alloc_fragment([ROWS, head_dim], dtype)
            prod = T.alloc_fragment([ROWS, head_dim], accum)
            delta = T.alloc_fragment([ROWS], accum)
            lse = T.alloc_fragment([ROWS], accum)
            T.copy(O[bz, bx * ROWS:(bx + 1) * ROWS, h, :], o)
            T.copy(dO[bz, bx * ROWS:(bx + 1) * ROWS, h, :], do)
            T.copy(LSE[bz, h, bx * ROWS:(bx + 1) * ROWS], lse)
            for i, d in T.Parallel(ROWS, head_dim):
                prod[i, d] = T.Cast(accum, o[i, d]) * T.Cast(accum, do[i, d])
            T.reduce_sum(prod, delta, dim=1)
            for i in T.Parallel(ROWS):
                delta[i] = delta[i] * softmax_scale
                lse[i] = lse[i] * LOG2E
            T.copy(delta, DeltaScaled[bz, h, bx * ROWS:(bx + 1) * ROWS])
            T.copy(lse, LSElog2[bz, h, bx * ROWS:(bx + 1) * ROWS])
            if clear_dq:
                zeros = T.alloc_fragment([ROWS, width], accum)
                T.clear(zeros)
                for p in range(planes):
                    T.copy(zeros, dQ[bz, h, p, bx * ROWS:(bx + 1) * ROWS, 0:width])
                if clear_kv_heads:
                    clear_kv(zeros, KVaccum, h, bx, bz)

    def o_t():  # one per parameter: a shared T.Tensor object makes O and dO one buffer
        return T.Tensor([batch, seq_len, heads, head_dim], dtype)

    def row_t():
        return T.Tensor([batch, heads, seq_len], accum)

    if clear_kv_heads:
        @T.prim_func
        def main_kv(O: o_t(), dO: o_t(), LSE: row_t(), DeltaScaled: row_t(), LSElog2: row_t(),
                    dQ: T.Tensor(accum_shape, accum),
                    KVaccum: T.Tensor(kv_accum_shape(batch, seq_len, clear_kv_heads, head_dim),
                                      accum)):
            body(O, dO, LSE, DeltaScaled, LSElog2, dQ, None, KVaccum)

        return main_kv

    if clear_dq:
        @T.prim_func
        def main(O: o_t(), dO: o_t(), LSE: row_t(), DeltaScaled: row_t(), LSElog2: row_t(),
                 dQ: T.Tensor(accum_shape, accum)):
            body(O, dO, LSE, DeltaScaled, LSElog2, dQ, None, None)

        return main

    if flip_parity:
        @T.prim_func
        def main_flip(O: o_t(), dO: o_t(), LSE: row_t(), DeltaScaled: row_t(), LSElog2: row_t(),
                      Parity: T.Tensor([1], "int32")):
            body(O, dO, LSE, DeltaScaled, LSElog2, None, Parity, None)

        return main_flip

    @T.prim_func
    def main_rows(O: o_t(), dO: o_t(), LSE: row_t(), DeltaScaled: row_t(), LSElog2: row_t()):
        body(O, dO, LSE, DeltaScaled, LSElog2, None, None, None)

    return main_rows


def postprocess(batch, seq_len, heads, head_dim, dtype, planes: int = 1, layout: str = "padded",
                pdl: bool = False, paired: bool = False, kv_heads: int = 0):
    """dQ in q's dtype from the fp32 accumulator of ``planes`` planes in ``layout``. ``pdl``:
    launched as the main kernel's programmatic dependent, it waits for it before any read.
    ``paired``: the accumulator is a pair and the kernel takes the int32 parity that picks the
    one this call added into (``preprocess``' ``flip_parity``). ``kv_heads``: also dK and dV
    from split heads' accumulator (``kv_accum_shape``), in the same launch (the grid's heads
    past ``heads``). ``batch`` may be ``DYNAMIC_BATCH``."""
    if kv_heads and (paired or layout != "padded"):
        raise ValueError("kv_heads casts beside a single padded dQ accumulator (split heads)")
    batch = batch_extent(batch)
    accum = "float"
    width = head_dim // planes
    accum_shape = dq_accum_shape(batch, seq_len, heads, head_dim, planes, layout)

    @T.macro
    def cast_dq(dQaccum, dQ, Parity, acc, cast, tile, h, bx, bz):
        """One dQ rows block: each plane → its columns of the tile → TMA store."""
        for p in range(planes):
            plane = (Parity[0], bz, h, p) if paired else (bz, h, p)
            if layout == "swizzled":  # ROWS is a multiple of 8: row mod 8 is i mod 8
                for i, d in T.Parallel(ROWS, width):
                    acc[i, d] = dQaccum[(*plane, bx * ROWS + i, stored_column(layout, i, d))]
            else:
                T.copy(dQaccum[(*plane, slice(bx * ROWS, (bx + 1) * ROWS), slice(0, width))],
                       acc)
            T.copy(acc, cast)
            T.copy(cast, tile[:, p * width:(p + 1) * width])
        T.copy(tile, dQ[bz, bx * ROWS:(bx + 1) * ROWS, h, :])

    @T.macro
    def cast_kv(KVaccum, dK, dV, acc, cast, tile, kvh, bx, bz):
        """One dK (kvh < kv_heads) or dV rows block, the accumulator read a plane's width at a
        time."""
        grad = kvh // kv_heads
        for p in range(head_dim // width):
            T.copy(KVaccum[grad, bz, kvh % kv_heads, 0, bx * ROWS:(bx + 1) * ROWS,
                           p * width:(p + 1) * width], acc)
            T.copy(acc, cast)
            T.copy(cast, tile[:, p * width:(p + 1) * width])
        if grad == 0:
            T.copy(tile, dK[bz, bx * ROWS:(bx + 1) * ROWS, kvh, :])
        else:
            T.copy(tile, dV[bz, bx * ROWS:(bx + 1) * ROWS, kvh - kv_heads, :])

    @T.macro
    def body(dQaccum, dQ, Parity, KVaccum, dK, dV):
        with T.Kernel(T.ceildiv(seq_len, ROWS), heads + 2 * kv_heads, batch,
                      threads=THREADS) as (bx, h, bz):
            acc = T.alloc_fragment([ROWS, width], accum)
            cast = T.alloc_fragment([ROWS, width], dtype)
            tile = T.alloc_shared([ROWS, head_dim], dtype)
            if pdl:
                T.pdl_sync()
            if not kv_heads:
                cast_dq(dQaccum, dQ, Parity, acc, cast, tile, h, bx, bz)
            elif h < heads:
                cast_dq(dQaccum, dQ, Parity, acc, cast, tile, h, bx, bz)
            else:
                cast_kv(KVaccum, dK, dV, acc, cast, tile, h - heads, bx, bz)

    def dq_t(n_heads=heads):
        return T.Tensor([batch, seq_len, n_heads, head_dim], dtype)

    if kv_heads:
        @T.prim_func
        def main_kv(dQaccum: T.Tensor(accum_shape, accum), dQ: dq_t(),
                    KVaccum: T.Tensor(kv_accum_shape(batch, seq_len, kv_heads, head_dim), accum),
                    dK: dq_t(kv_heads), dV: dq_t(kv_heads)):
            body(dQaccum, dQ, None, KVaccum, dK, dV)

        return main_kv

    if paired:
        @T.prim_func
        def main_pair(dQaccum: T.Tensor((2, *accum_shape), accum), dQ: dq_t(),
                      Parity: T.Tensor([1], "int32")):
            body(dQaccum, dQ, Parity, None, None, None)

        return main_pair

    @T.prim_func
    def main(dQaccum: T.Tensor(accum_shape, accum), dQ: dq_t()):
        body(dQaccum, dQ, None, None, None, None)

    return main


@functools.lru_cache(maxsize=None)
def compiled_preprocess(*args, clear_dq=True, planes=1, layout="padded", pdl=False,
                        flip_parity=False, clear_kv_heads=0):
    return compile_sm90a(preprocess(*args, clear_dq=clear_dq, planes=planes, layout=layout,
                                    pdl=pdl, flip_parity=flip_parity,
                                    clear_kv_heads=clear_kv_heads))


@functools.lru_cache(maxsize=None)
def compiled_postprocess(*args, pdl=False, paired=False, kv_heads=0):
    return compile_sm90a(postprocess(*args, pdl=pdl, paired=paired, kv_heads=kv_heads))
