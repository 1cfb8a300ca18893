"""The two small kernels around a backward's main kernel, shared by the lab's backwards.

FA3 counterparts: ``hopper/flash_bwd_preprocess_kernel.h`` and
``hopper/flash_bwd_postprocess_kernel.h``, without their warp roles (one warpgroup, no
barriers beyond TileLang's own):

- ``preprocess``: Δ = rowsum(dO ∘ O) in fp32 (B, Hq, S), and (``clear_dq``) the zeroed fp32
  dQ accumulator the main kernel's bulk reduce-adds add into. A CTA takes ``ROWS`` rows of one
  head; shared memory: none (fragments only).
- ``postprocess``: the accumulator cast to q's dtype, ``ROWS`` rows of one head a CTA, through a
  (ROWS, D) shared tile for a TMA store.

The accumulator (``dq_accum_shape``) is (B, Hq, S rounded up to ``DQ_ROW_ALIGN``, D +
``DQ_PAD``): a Q tile of one head is one contiguous run, added by one bulk reduce-add from the
main kernel's staging tile, whose rows the pad keeps on distinct shared-memory banks. Rows past
S and the pad columns only ever receive zeros' sums and are never read.
"""
import functools

import tilelang.language as T

from ws_lab.kernels import batch_extent
from ws_lab.target import compile_sm90a

ROWS = 64  # rows of one head a CTA: 64 × 128 fp32 accumulator elements, 64 a thread
THREADS = 128
DQ_PAD = 8  # fp32 columns after D: a staging row starts 8 banks after the one above it
DQ_ROW_ALIGN = 128  # the accumulator's rows: S rounded up to this (a multiple of every block_q)


def dq_accum_shape(batch, seq_len, heads, head_dim):
    """The fp32 dQ accumulator's shape (see the module docstring)."""
    rows = -(-seq_len // DQ_ROW_ALIGN) * DQ_ROW_ALIGN
    return batch, heads, rows, head_dim + DQ_PAD


def preprocess(batch, seq_len, heads, head_dim, dtype, clear_dq: bool = True):
    """Δ from O and dO; with ``clear_dq`` (the main kernel's dQ path) also the zeroed
    accumulator. ``batch`` may be ``DYNAMIC_BATCH``."""
    batch = batch_extent(batch)
    accum = "float"

    @T.macro
    def body(O, dO, Delta, dQ):
        with T.Kernel(T.ceildiv(seq_len, ROWS), heads, batch, threads=THREADS) as (bx, h, bz):
            o = T.alloc_fragment([ROWS, head_dim], dtype)
            do = T.alloc_fragment([ROWS, head_dim], dtype)
            prod = T.alloc_fragment([ROWS, head_dim], accum)
            delta = T.alloc_fragment([ROWS], accum)
            T.copy(O[bz, bx * ROWS:(bx + 1) * ROWS, h, :], o)
            T.copy(dO[bz, bx * ROWS:(bx + 1) * ROWS, h, :], do)
            for i, d in T.Parallel(ROWS, head_dim):
                prod[i, d] = T.Cast(accum, o[i, d]) * T.Cast(accum, do[i, d])
            T.reduce_sum(prod, delta, dim=1)
            T.copy(delta, Delta[bz, h, bx * ROWS:(bx + 1) * ROWS])
            if clear_dq:
                T.clear(prod)
                T.copy(prod, dQ[bz, h, bx * ROWS:(bx + 1) * ROWS, 0:head_dim])

    def o_t():  # one per parameter: a shared T.Tensor object makes O and dO one buffer
        return T.Tensor([batch, seq_len, heads, head_dim], dtype)

    delta_t = T.Tensor([batch, heads, seq_len], accum)
    if clear_dq:
        @T.prim_func
        def main(O: o_t(), dO: o_t(), Delta: delta_t,
                 dQ: T.Tensor(dq_accum_shape(batch, seq_len, heads, head_dim), accum)):
            body(O, dO, Delta, dQ)

        return main

    @T.prim_func
    def main_delta(O: o_t(), dO: o_t(), Delta: delta_t):
        body(O, dO, Delta, None)

    return main_delta


def postprocess(batch, seq_len, heads, head_dim, dtype):
    """dQ in q's dtype from the fp32 accumulator. ``batch`` may be ``DYNAMIC_BATCH``."""
    batch = batch_extent(batch)
    accum = "float"

    @T.prim_func
    def main(
        dQaccum: T.Tensor(dq_accum_shape(batch, seq_len, heads, head_dim), accum),
        dQ: T.Tensor([batch, seq_len, heads, head_dim], dtype),
    ):
        with T.Kernel(T.ceildiv(seq_len, ROWS), heads, batch, threads=THREADS) as (bx, h, bz):
            acc = T.alloc_fragment([ROWS, head_dim], accum)
            cast = T.alloc_fragment([ROWS, head_dim], dtype)
            tile = T.alloc_shared([ROWS, head_dim], dtype)
            T.copy(dQaccum[bz, h, bx * ROWS:(bx + 1) * ROWS, 0:head_dim], acc)
            T.copy(acc, cast)
            T.copy(cast, tile)
            T.copy(tile, dQ[bz, bx * ROWS:(bx + 1) * ROWS, h, :])

    return main


@functools.lru_cache(maxsize=None)
def compiled_preprocess(*args, clear_dq=True):
    return compile_sm90a(preprocess(*args, clear_dq=clear_dq))


@functools.lru_cache(maxsize=None)
def compiled_postprocess(*args):
    return compile_sm90a(postprocess(*args))
