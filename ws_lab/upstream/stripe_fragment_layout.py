"""A fragment for a column stripe of a wgmma accumulator gets the whole accumulator's layout,
and ``T.reduce_max`` over it reads registers nothing wrote.

``stripe`` (64 × 16 fp32, one warpgroup) is filled by a ``T.Parallel`` copy of the first 16
columns of a 64 × 128 wgmma accumulator. Each thread owns 8 of its elements (2 rows × 4
columns, the accumulator's pattern), but TileLang 0.1.15 lays it out like the accumulator: 64
registers a thread, the copy writes 8 of them under an ``if (i < 2)`` guard, and the reduction
over the stripe's rows walks 32 registers a row, 28 of them never written. nvcc 13.0 turns
those reads into reads of R1 (the stack pointer) in the SASS, so each row max comes out as
max(true max, R1's bits as a float ≈ +0): right when the row's maximum is positive, wrong
(≈ 0) when every score of the row is negative. Found writing the softmax row max as a
two-level tree (NOTES.md, coop_overlap, session 8).
"""
import re

import tilelang.language as T

from ws_lab.upstream import lower_sm90a, verdict

TITLE = "a fragment for a column stripe of a wgmma accumulator takes the accumulator's layout; reduce_max reads unwritten registers"
UPSTREAM = "to be filed (bundle: python -m ws_lab.repro stripe_fragment_layout)"
PASS_CONFIGS = {}
EXPECTED = ("`float stripe[8]` (64·16 fp32 over 128 threads) and a reduction over the 4 registers "
            "a row that the copy wrote")
WORKAROUND = ("none needed in the kernels: the softmax keeps T.reduce_max over the whole "
              "accumulator (one FMNMX chain of 32 a row; a tree measured no faster, NOTES.md). "
              "Annotating the stripe with a T.Fragment fixes the first warpgroup only "
              "(annotated_fragment_second_warpgroup)")
EXCERPT = r"stripe|row_max|i_2|rv <"
REGS_PER_THREAD = 64 * 16 // 128


def kernel():
    @T.prim_func
    def stripe_max(A: T.Tensor([64, 64], "float16"), B: T.Tensor([128, 64], "float16"),
                   M: T.Tensor([64], "float")):
        with T.Kernel(1, threads=128) as _:
            a_s = T.alloc_shared([64, 64], "float16")
            b_s = T.alloc_shared([128, 64], "float16")
            acc = T.alloc_fragment([64, 128], "float")
            stripe = T.alloc_fragment([64, 16], "float")
            row_max = T.alloc_fragment([64], "float")
            T.copy(A, a_s)
            T.copy(B, b_s)
            T.wgmma_gemm(a_s, b_s, acc, transpose_B=True, clear_accum=True)
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(acc, num_regs=64)
            for i, j in T.Parallel(64, 16):
                stripe[i, j] = acc[i, j]
            T.reduce_max(stripe, row_max, dim=1)
            T.copy(row_max, M)

    return stripe_max


def lower():
    return lower_sm90a(kernel(), PASS_CONFIGS)


def run() -> str:
    """On a GPU: the kernel's row maxima against torch's, for random scores and for scores that
    are all negative (the unwritten registers show in the second)."""
    import torch

    from ws_lab.target import compile_sm90a

    kernel_fn = compile_sm90a(kernel(), PASS_CONFIGS)
    a = torch.randn(64, 64, device="cuda").abs().half()
    b = torch.randn(128, 64, device="cuda").half()
    counts = []
    for sign in (1, -1):  # b and -|b|: random scores, then every score negative
        bb = b if sign == 1 else -b.abs()
        m = torch.full((64,), float("nan"), device="cuda")
        kernel_fn(a, bb, m)
        ref = (a.float() @ bb.float().T)[:, :16].amax(dim=1)
        counts.append(int((~torch.isclose(m, ref, rtol=1e-3, atol=1e-3)).sum()))
    return (f"{counts[0]} of 64 row maxima differ from torch's for random scores, {counts[1]} of "
            "64 when every score is negative")


def check():
    """Fixed when the stripe holds REGS_PER_THREAD registers a thread; the bug, any other count."""
    src = lower()
    declared = re.search(r"float stripe\[(\d+)\];", src)
    reduce = re.search(r"for \(int (\w+) = 0; \1 < (\d+); \+\+\1\) \{\s*\n\s*\w+\[\w+\] = max\(", src)
    regs = int(declared.group(1)) if declared else None
    per_row = int(reduce.group(2)) if reduce else None
    return verdict(regs is not None and regs != REGS_PER_THREAD, regs == REGS_PER_THREAD,
                   f"`float stripe[{regs}]`; the reduction walks {per_row} registers a row of "
                   f"the {REGS_PER_THREAD // 2} the copy wrote")
