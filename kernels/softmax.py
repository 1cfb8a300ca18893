"""Online softmax of one score tile in registers, shared by every forward kernel of the lab.

FA3 counterpart: ``hopper/softmax.h`` (``max_get_scale`` + ``online_softmax``, then ``rescale_o``).
Scores are scaled inside exp2 (``scale · log2 e``), so one FFMA per element does scale and shift.
"""
import tilelang.language as T


def alloc_softmax_state(rows, cols, head_dim_v, dtype, accum="float"):
    """One warpgroup's online-softmax registers: S (fp32), P (input dtype), O (fp32) and the
    per-row max, previous max, rescale factor, block sum and running sum."""
    return (T.alloc_fragment([rows, cols], accum), T.alloc_fragment([rows, cols], dtype),
            T.alloc_fragment([rows, head_dim_v], accum),
            *(T.alloc_fragment([rows], accum) for _ in range(5)))


def score_mask(causal: bool, seq_len: int, rows: int, block_n: int, accum="float"):
    """The mask macro of a forward kernel: ``mask(acc_s, kb, row0)`` sets -inf where key
    kb·block_n + j is in the future of query row0 + i (causal) or past S (ragged S); only the
    blocks that need it pay (the diagonal ones, the ragged last one)."""
    neg_inf = -T.infinity(accum)
    n_kblocks = (seq_len + block_n - 1) // block_n

    @T.macro
    def mask(acc_s, kb, row0):
        if causal:
            if (kb + 1) * block_n > row0:  # the block reaches past the tile's first row
                for i, j in T.Parallel(rows, block_n):
                    acc_s[i, j] = T.if_then_else(row0 + i >= kb * block_n + j, acc_s[i, j],
                                                 neg_inf)
        elif seq_len % block_n:
            if kb == n_kblocks - 1:
                for i, j in T.Parallel(rows, block_n):
                    acc_s[i, j] = T.if_then_else(kb * block_n + j < seq_len, acc_s[i, j], neg_inf)

    return mask


@T.macro
def softmax_stats(acc_s, row_max, row_max_prev, row_rescale, block_sum, row_sum, rows, cols,
                  scale_log2):
    """acc_s (rows × cols fp32 scores) -> exp2 of the scaled, max-shifted scores, in place; the
    running max and sum advance and row_rescale holds the factor for the old O."""
    T.copy(row_max, row_max_prev)
    T.reduce_max(acc_s, row_max, dim=1, clear=False)
    for i in T.Parallel(rows):
        row_rescale[i] = T.exp2(row_max_prev[i] * scale_log2 - row_max[i] * scale_log2)
    for i, j in T.Parallel(rows, cols):
        acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - row_max[i] * scale_log2)
    T.reduce_sum(acc_s, block_sum, dim=1)
    for i in T.Parallel(rows):
        row_sum[i] = row_sum[i] * row_rescale[i] + block_sum[i]


@T.macro
def rescale_o(acc_o, row_rescale, rows, head_dim_v):
    """O *= the factor that moves it to the new running max."""
    for i, j in T.Parallel(rows, head_dim_v):
        acc_o[i, j] *= row_rescale[i]


@T.macro
def commit_probs(acc_s, p, acc_o, row_rescale, rows, head_dim_v):
    """P in the input dtype for the PV GEMM, and O rescaled to the new max. Split from
    softmax_stats so IntraWGOverlap can run the stats while the previous PV GEMM still reads
    P and accumulates into O."""
    T.copy(acc_s, p)
    rescale_o(acc_o, row_rescale, rows, head_dim_v)


@T.macro
def online_softmax(acc_s, p, acc_o, row_max, row_max_prev, row_rescale, block_sum, row_sum,
                   rows, cols, head_dim_v, scale_log2):
    """softmax_stats then commit_probs: one score tile in, P and the rescaled O out."""
    softmax_stats(acc_s, row_max, row_max_prev, row_rescale, block_sum, row_sum, rows, cols,
                  scale_log2)
    commit_probs(acc_s, p, acc_o, row_rescale, rows, head_dim_v)
