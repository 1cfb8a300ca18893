"""Online softmax of one score tile in registers, shared by every forward kernel of the lab.

FA3 counterpart: ``hopper/softmax.h`` (``max_get_scale`` + ``online_softmax``, then ``rescale_o``).
Scores are scaled inside exp2 (``scale · log2 e``), so one FFMA per element does scale and shift.
``exp2_fma`` is 2^x without MUFU (FA4's emulation), for a share of a block's exp2s
(``scaled_exp2``'s ``fma_every``; notes/fp8.md "Session 58").
"""
from dataclasses import dataclass

import tilelang.language as T


# FA4's conditional rescale: a row's running max moves only when a block raises it by more
# than this (log2 units), so P stays below 2^8 (in range for bf16 and fp16)
LAZY_RESCALE_LOG2 = 8.0
# FP8: P = exp2(s - max + 8) lies in [0, 256], so e4m3 P keeps normal precision down to 2^-14
# of the row max (2^-6 with P in [0, 1]); the 2^8 cancels in O / rowsum (FA3's Max_offset;
# notes/fp8.md, "Session 51")
FP8_PROB_LOG2_OFFSET = 8.0
# exp2 on the FMA pipe (FA4's emulation, for the MUFU-bound FP8 loop): round to nearest by
# adding 1.5·2^23, a cubic for 2^f on f in [-1/2, 1/2] (Chebyshev fit, relative error 1.1e-4,
# far below e4m3's 2^-4), the integer part added into the exponent bits
EXP2_ROUND_MAGIC = 12582912.0
EXP2_CUBIC = (0.99992448, 0.69312103, 0.24264008, 0.05592204)
EXP2_GROUP_COLS = 8  # wgmma's accumulator: a thread's columns of one 8-column group


@dataclass(frozen=True)
class SoftmaxState:
    """One warpgroup's online-softmax registers (FA3's ``Softmax`` object): S (fp32), P (input
    dtype), O (fp32) and the per-row max, previous max, rescale factor, block sum and running
    sum. Macros take the state whole; ``registers()`` unpacks it where a kernel names them."""
    acc_s: object
    p: object
    acc_o: object
    row_max: object
    row_max_prev: object
    row_rescale: object
    block_sum: object
    row_sum: object
    # FP8: a local holding scale·log2 e with the tile's Q and K descales folded in (a run-time
    # value); None: the kernel's trace-time scale
    scale_log2: object = None

    def registers(self) -> tuple:
        return tuple(getattr(self, f) for f in self.__dataclass_fields__ if f != "scale_log2")


@T.macro
def alloc_softmax_state(rows, cols, head_dim_v, dtype, accum="float") -> SoftmaxState:
    """Allocates one warpgroup's ``SoftmaxState`` (a macro, so the emitted CUDA names each
    register array as the fields do)."""
    acc_s = T.alloc_fragment([rows, cols], accum)
    p = T.alloc_fragment([rows, cols], dtype)
    acc_o = T.alloc_fragment([rows, head_dim_v], accum)
    row_max = T.alloc_fragment([rows], accum)
    row_max_prev = T.alloc_fragment([rows], accum)
    row_rescale = T.alloc_fragment([rows], accum)
    block_sum = T.alloc_fragment([rows], accum)
    row_sum = T.alloc_fragment([rows], accum)
    return SoftmaxState(acc_s, p, acc_o, row_max, row_max_prev, row_rescale, block_sum, row_sum)


def score_mask(causal: bool, seq_len: int, rows: int, block_n: int, accum="float",
               checked: bool = True):
    """The mask macro of a forward kernel: ``mask(acc_s, kb, row0)`` sets -inf where key
    kb·block_n + j is in the future of query row0 + i (causal) or past S (ragged S). Checked:
    only the blocks that need it pay (the diagonal ones, the ragged last one); unchecked: every
    block it is called on (a loop that holds only such blocks, see ``first_masked_block``)."""
    neg_inf = -T.infinity(accum)
    n_kblocks = (seq_len + block_n - 1) // block_n

    def needs_mask(kb, row0):
        if not checked:
            return True  # a trace-time constant: the macro below emits no test
        if causal:
            return (kb + 1) * block_n > row0  # the block reaches past the tile's first row
        return kb == n_kblocks - 1

    @T.macro
    def mask(acc_s, kb, row0):
        if causal:
            if needs_mask(kb, row0):
                # both sides less the thread's first column in a wgmma accumulator: the
                # simplifier cancels it on the left, leaving each key an immediate against a
                # per-row limit, FA3's form (notes/fp8.md, "Session 65")
                col0 = T.get_thread_binding() % 4 * 2
                for i, j in T.Parallel(rows, block_n):
                    acc_s[i, j] = T.if_then_else(j - col0 <= row0 + i - kb * block_n - col0,
                                                 acc_s[i, j], neg_inf)
        elif seq_len % block_n:
            if needs_mask(kb, row0):
                col0 = T.get_thread_binding() % 4 * 2  # as above
                for i, j in T.Parallel(rows, block_n):
                    acc_s[i, j] = T.if_then_else(j - col0 < seq_len - kb * block_n - col0,
                                                 acc_s[i, j], neg_inf)

    return mask


def first_unmasked_iteration(causal: bool, seq_len: int, block_n: int, row0, loop_range):
    """The descending walk's (``coop.Config.kv_descending``: iteration kb holds key block
    loop_range − 1 − kb) counterpart of ``first_masked_block``: iterations [1, it) hold blocks
    ``score_mask`` masks for rows from row0 on, [it, loop_range) none (iteration 0, the
    diagonal or the ragged last block, is the caller's)."""
    # causal: key block n is masked ⟺ n ≥ row0 // block_n ⟺ kb < loop_range − row0 // block_n
    if causal:
        return T.max(1, T.min(loop_range, loop_range - row0 // block_n))
    return 1  # ragged: only the last key block, iteration 0


def first_masked_block(causal: bool, seq_len: int, block_n: int, row0, loop_range):
    """The first KV block ≥ 1 that ``score_mask`` masks for rows from row0 on; loop_range when
    none does. Blocks [1, it) need no mask, [it, loop_range) all do (block 0 is the caller's)."""
    if causal:  # (kb + 1)·block_n > row0  ⟺  kb ≥ row0 // block_n
        return T.max(1, T.min(loop_range, row0 // block_n))
    if seq_len % block_n:
        return T.max(1, loop_range - 1)
    return loop_range


def exp2_fma(x):
    """2^x from FADD / FFMA / integer ops only (no MUFU): x below -126 (−inf included) gives
    2^-126, which is 0 to e4m3 and nothing to a row sum of at least 1."""
    x = T.max(x, -126.0)
    # round(x) sits in the low mantissa bits; the bit view keeps TVM's simplifier from folding
    # (x + M) − M back to x
    rounded = T.reinterpret("int32", x + EXP2_ROUND_MAGIC)
    frac = x - (T.reinterpret("float32", rounded) - EXP2_ROUND_MAGIC)
    c0, c1, c2, c3 = EXP2_CUBIC
    poly = ((c3 * frac + c2) * frac + c1) * frac + c0
    return T.reinterpret("float32", T.reinterpret("int32", poly) + T.shift_left(rounded, 23))


@T.macro
def scaled_exp2(acc_s, row_max, rows, cols, scale_log2, prob_log2_offset, fma_every):
    """acc_s = exp2(acc_s·scale − max·scale + offset); every ``fma_every``-th 8-column group
    by ``exp2_fma`` (0: none), the rest on MUFU."""
    if fma_every:
        for g in T.unroll(cols // EXP2_GROUP_COLS):
            for i, j in T.Parallel(rows, EXP2_GROUP_COLS):
                x = acc_s[i, g * EXP2_GROUP_COLS + j] * scale_log2 - (
                    row_max[i] * scale_log2 - prob_log2_offset)
                acc_s[i, g * EXP2_GROUP_COLS + j] = T.if_then_else(
                    g % fma_every == fma_every - 1, exp2_fma(x), T.exp2(x))
    elif prob_log2_offset != 0.0:  # a branch, so the bf16 kernels' CUDA carries no "- 0"
        for i, j in T.Parallel(rows, cols):
            acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - (row_max[i] * scale_log2
                                                               - prob_log2_offset))
    else:
        for i, j in T.Parallel(rows, cols):
            acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - row_max[i] * scale_log2)


@T.macro
def softmax_probs(acc_s, row_max, row_max_prev, row_rescale, rows, cols, scale_log2,
                  rescale_threshold=None, prob_log2_offset=0.0, fma_every=0, check_inf=False):
    """acc_s (rows × cols fp32 scores) -> exp2 of the scaled, max-shifted scores, in place; the
    running max advances and row_rescale holds the factor for the old O and row sums.
    ``rescale_threshold`` (log2 units; FA4's conditional rescale): a row's max moves only when
    the block raises it by more than that, so most blocks rescale by exactly 1 and the
    probabilities stay below 2^threshold; O / rowsum is unchanged, since both use one max.
    ``prob_log2_offset``: P = exp2(s·scale − max·scale + offset) (FP8_PROB_LOG2_OFFSET), the
    offset folded into the per-row shift, so each element still costs one FFMA and one exp2.
    ``fma_every``: every n-th 8-column group's exp2 on the FMA pipe (``exp2_fma``).
    ``check_inf`` (FA3's Check_inf, for a block that can mask a whole row): a row whose max is
    still -inf is shifted by 0, so its exp2s and rescale are 0, not NaN."""
    T.copy(row_max, row_max_prev)
    T.reduce_max(acc_s, row_max, dim=1, clear=False)
    if rescale_threshold is not None:
        for i in T.Parallel(rows):  # -inf to a finite max: +inf > threshold, the max moves
            row_max[i] = T.if_then_else(
                (row_max[i] - row_max_prev[i]) * scale_log2 > rescale_threshold, row_max[i],
                row_max_prev[i])
    if check_inf:
        safe_max = T.alloc_fragment([rows], "float")
        for i in T.Parallel(rows):
            safe_max[i] = T.if_then_else(row_max[i] == -T.infinity("float"), 0.0, row_max[i])
        shifted_exp2(acc_s, row_max_prev, safe_max, row_rescale, rows, cols, scale_log2,
                     prob_log2_offset, fma_every)
    else:
        shifted_exp2(acc_s, row_max_prev, row_max, row_rescale, rows, cols, scale_log2,
                     prob_log2_offset, fma_every)


@T.macro
def shifted_exp2(acc_s, row_max_prev, shift, row_rescale, rows, cols, scale_log2,
                 prob_log2_offset, fma_every):
    """softmax_probs' tail: the old O's factor, exp2(prev·scale − shift·scale), and the block's
    exp2s against ``shift`` (the row max, or 0 where it is -inf under check_inf)."""
    for i in T.Parallel(rows):
        row_rescale[i] = T.exp2(row_max_prev[i] * scale_log2 - shift[i] * scale_log2)
    scaled_exp2(acc_s, shift, rows, cols, scale_log2, prob_log2_offset, fma_every)


@T.macro
def softmax_stats(acc_s, row_max, row_max_prev, row_rescale, block_sum, row_sum, rows, cols,
                  scale_log2, rescale_threshold=None, prob_log2_offset=0.0, fma_every=0,
                  check_inf=False):
    """softmax_probs, then the running row sums advance (one full row reduction per block)."""
    softmax_probs(acc_s, row_max, row_max_prev, row_rescale, rows, cols, scale_log2,
                  rescale_threshold, prob_log2_offset, fma_every, check_inf)
    T.reduce_sum(acc_s, block_sum, dim=1)
    for i in T.Parallel(rows):
        row_sum[i] = row_sum[i] * row_rescale[i] + block_sum[i]


PARTIAL_SUM_COLS = 16  # wgmma's accumulator repeats its thread pattern every 8 columns


def alloc_partial_sums(rows, cols, accum="float"):
    """Deferred row sums: a fragment shaped like the score tile (so it takes the score tile's
    register layout) whose first PARTIAL_SUM_COLS columns hold per-thread partial sums."""
    return T.alloc_fragment([rows, cols], accum)


@T.macro
def add_partial_sums(acc_s, part_sum, rows, cols):
    """part_sum[i, j] += acc_s[i, j + 16 t] over t: every term lives in the thread that holds
    part_sum[i, j], so a block's row sums cost cols/16 independent FADD chains per row and no
    shuffle; ``T.reduce_sum(part_sum, ...)`` once per tile finishes them."""
    for t in T.unroll(cols // PARTIAL_SUM_COLS):
        for i, j in T.Parallel(rows, PARTIAL_SUM_COLS):
            part_sum[i, j] += acc_s[i, j + t * PARTIAL_SUM_COLS]


@T.macro
def rescale_partial_sums(part_sum, row_rescale, rows):
    for i, j in T.Parallel(rows, PARTIAL_SUM_COLS):
        part_sum[i, j] *= row_rescale[i]


@T.macro
def rescale_o(acc_o, row_rescale, rows, head_dim_v):
    """O *= the factor that moves it to the new running max."""
    for i, j in T.Parallel(rows, head_dim_v):
        acc_o[i, j] *= row_rescale[i]


@T.macro
def normalize_o(acc_o, row_sum, inv_sum, rows, head_dim_v):
    """O /= row sums, as one reciprocal per row and FMULs. A division per element costs a
    MUFU.RCP + FMUL each with --use_fast_math, and without it (pipelined) an IEEE div.rn.f32
    with its FCHK slow-path check each."""
    for i in T.Parallel(rows):
        inv_sum[i] = 1.0 / row_sum[i]
    for i, j in T.Parallel(rows, head_dim_v):
        acc_o[i, j] *= inv_sum[i]


@T.macro
def commit_probs(acc_s, p, acc_o, row_rescale, rows, head_dim_v, copy_p=T.copy):
    """P in the input dtype for the PV GEMM (``copy_p``: FP8 RS's key order), and O rescaled
    to the new max. Split from softmax_stats so IntraWGOverlap can run the stats while the
    previous PV GEMM still reads P and accumulates into O."""
    copy_p(acc_s, p)
    rescale_o(acc_o, row_rescale, rows, head_dim_v)


@T.macro
def online_softmax(acc_s, p, acc_o, row_max, row_max_prev, row_rescale, block_sum, row_sum,
                   rows, cols, head_dim_v, scale_log2, copy_p=T.copy, prob_log2_offset=0.0):
    """softmax_stats then commit_probs: one score tile in, P and the rescaled O out."""
    softmax_stats(acc_s, row_max, row_max_prev, row_rescale, block_sum, row_sum, rows, cols,
                  scale_log2, None, prob_log2_offset)
    commit_probs(acc_s, p, acc_o, row_rescale, rows, head_dim_v, copy_p)
