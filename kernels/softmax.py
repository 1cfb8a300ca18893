"""Online softmax of one score tile in registers, shared by every forward kernel of the lab.

FA3 counterpart: ``hopper/softmax.h`` (``max_get_scale`` + ``online_softmax`` + ``rescale_o``).
Scores are scaled inside exp2 (``scale · log2 e``), so one FFMA per element does scale and shift.
"""
import tilelang.language as T

LOG2E = 1.4426950408889634


@T.macro
def online_softmax(acc_s, p, acc_o, row_max, row_max_prev, row_rescale, block_sum, row_sum,
                   rows, cols, head_dim_v, scale_log2):
    """acc_s (rows × cols fp32 scores) -> p (probabilities in the input dtype); the running max
    and sum advance, and acc_o (rows × head_dim_v) is rescaled to the new max."""
    T.copy(row_max, row_max_prev)
    T.reduce_max(acc_s, row_max, dim=1, clear=False)
    for i in T.Parallel(rows):
        row_rescale[i] = T.exp2(row_max_prev[i] * scale_log2 - row_max[i] * scale_log2)
    for i, j in T.Parallel(rows, cols):
        acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - row_max[i] * scale_log2)
    T.reduce_sum(acc_s, block_sum, dim=1)
    for i in T.Parallel(rows):
        row_sum[i] = row_sum[i] * row_rescale[i] + block_sum[i]
    T.copy(acc_s, p)
    for i, j in T.Parallel(rows, head_dim_v):
        acc_o[i, j] *= row_rescale[i]
