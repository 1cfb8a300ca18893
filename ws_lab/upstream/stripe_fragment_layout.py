"""A fragment for a column stripe of a wgmma accumulator gets the whole accumulator's layout,
and ``T.reduce_max`` over it reads registers nothing wrote.

``stripe`` (64 × 16 fp32, one warpgroup) is filled by a ``T.Parallel`` copy of the first 16
columns of a 64 × 128 wgmma accumulator. Each thread owns 8 of its elements (2 rows × 4
columns, the accumulator's pattern), but TileLang 0.1.15 lays it out like the accumulator: 64
registers a thread, the copy writes 8 of them under an ``if (i < 2)`` guard, and the reduction
over the stripe's rows walks 32 registers a row, 28 of them never written. nvcc 13.0 turns
those reads into reads of R1 (the stack pointer) in the SASS, so each row max comes out as
max(true max, R1's bits as a float ≈ +0): right when the row's maximum is positive, wrong
(≈ 0) when every score of the row is negative. The control fills the same stripe from global
memory: TileLang gives it 8 registers a thread.
"""
import re

import tilelang.language as T

from ws_lab.upstream import lower_sm90a, verdict

TITLE = "a fragment for a column stripe of a wgmma accumulator takes the accumulator's layout; reduce_max reads unwritten registers"
TRIAGE = "wrong code"
IMPACT = ("wrong values, H100 (sm_90a, nvcc 13.0): 0 of 64 row maxima wrong for random scores, "
          "64 of 64 wrong (≈ 0) when every score of a row is negative")
LINKS = ("https://github.com/tile-ai/tilelang/pull/3180 — open PR reworking layout inference "
         "for fragment slicing and partial visits in T.Parallel (this is a partial visit of "
         "acc); check it against this kernel",
         "https://github.com/tile-ai/tilelang/issues/2957 — same family: a T.Parallel loop's "
         "layout taken from another loop over the same fragment")
PASS_CONFIGS = {}
EXPECTED = ("`float stripe[8]` (64·16 fp32 over 128 threads) and a reduction over the 4 registers "
            "a row that the copy wrote")
WORKAROUND = ("reduce over the whole accumulator instead of a stripe, or annotate the stripe "
              "with a T.Fragment (first warpgroup only: see the annotated-fragment report)")
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


def control():
    @T.prim_func
    def stripe_from_global(S: T.Tensor([64, 16], "float"), M: T.Tensor([64], "float")):
        with T.Kernel(1, threads=128) as _:
            stripe = T.alloc_fragment([64, 16], "float")
            row_max = T.alloc_fragment([64], "float")
            T.copy(S, stripe)
            T.reduce_max(stripe, row_max, dim=1)
            T.copy(row_max, M)

    return stripe_from_global


def _registers(source: str):
    declared = re.search(r"float stripe\[(\d+)\];", source)
    return int(declared.group(1)) if declared else None


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
    reduce = re.search(r"for \(int (\w+) = 0; \1 < (\d+); \+\+\1\) \{\s*\n\s*\w+\[\w+\] = max\(", src)
    regs, control_regs = _registers(src), _registers(lower_sm90a(control(), PASS_CONFIGS))
    per_row = int(reduce.group(2)) if reduce else None
    control_ok = control_regs == REGS_PER_THREAD
    return verdict(control_ok and regs is not None and regs != REGS_PER_THREAD,
                   control_ok and regs == REGS_PER_THREAD,
                   f"`float stripe[{regs}]`; the reduction walks {per_row} registers a row of "
                   f"the {REGS_PER_THREAD // 2} the copy wrote; control (stripe from global): "
                   f"`float stripe[{control_regs}]`")
