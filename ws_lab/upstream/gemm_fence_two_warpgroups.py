"""``T.gemm`` split over two warpgroups fences twice the accumulator registers a thread holds.

With 256 threads and ``GemmWarpPolicy.FullRow`` a 128×128 fp32 accumulator is 64 registers per
thread (each warpgroup owns 64 rows), and TileLang 0.1.15 declares ``float acc[64]`` — but the
``warpgroup_fence_operand`` calls around the wgmma pass 128, i.e. the whole tile over one
warpgroup. The fence's inline asm then names ``acc[64..127]``, past the end of the array
(undefined behaviour that nvcc happens to compile without spills today). In the source the
one line that computes the count, ``wgmma_accum_regs``, uses the CTA's ``m_dim`` where the
per-warpgroup row count belongs. The control is the same GEMM on one warpgroup (64 × 128):
``float acc[64]``, fenced with 64.
"""
import re

import tilelang.language as T

from ws_lab.upstream import lower_sm90a, verdict

TITLE = "T.gemm over two warpgroups fences 2x the accumulator registers each thread declares"
TRIAGE = "latent UB"
IMPACT = ("none today: a flash-attention forward built on such a T.gemm passes its "
          "correctness checks on an H100, and nvcc 13.0 compiles this kernel without spills "
          "(see the SASS facts); the inline asm still names acc[64..127] of a 64-element array")
LINKS = ("none found: no open issue or PR on the fence count of multi-warpgroup T.gemm",)
PASS_CONFIGS = {}
EXPECTED = "every warpgroup_fence_operand(acc, n) has n <= the declared size of acc (64)"
WORKAROUND = ("none needed so far; per-warpgroup accumulator fragments (one T.gemm per "
              "warpgroup) get the right count")


def kernel(warpgroups: int = 2):
    """A (64·warpgroups) × 128 fp32 accumulator over ``warpgroups`` warpgroups: 64 registers a
    thread either way; ``warpgroups=1`` is the control."""
    m = 64 * warpgroups

    @T.prim_func
    def two_warpgroups(A: T.Tensor([m, 64], "float16"), B: T.Tensor([128, 64], "float16"),
                       C: T.Tensor([m, 128], "float")):
        with T.Kernel(1, threads=128 * warpgroups) as _:
            a_s = T.alloc_shared([m, 64], "float16")
            b_s = T.alloc_shared([128, 64], "float16")
            acc = T.alloc_fragment([m, 128], "float")
            T.copy(A, a_s)
            T.copy(B, b_s)
            T.gemm(a_s, b_s, acc, transpose_B=True, clear_accum=True,
                   policy=T.GemmWarpPolicy.FullRow)
            T.copy(acc, C)

    return two_warpgroups


def control():
    return kernel(warpgroups=1)


def lower():
    return lower_sm90a(kernel(), PASS_CONFIGS)


def _reading(source: str):
    """(declared size of acc, the counts its fences name), or None where either is missing."""
    match = re.search(r"float acc\[(\d+)\];", source)
    fenced = [int(n) for n in re.findall(
        r"warpgroup_fence_operand\(reinterpret_cast<float\*>\(acc \+ 0\), (\d+)\)", source)]
    return (int(match.group(1)), sorted(set(fenced))) if match and fenced else None


def check():
    """Fixed when no fence names more registers than ``acc`` declares, as in the control; the
    bug, one that does."""
    reading, one_wg = _reading(lower()), _reading(lower_sm90a(control(), PASS_CONFIGS))
    control_ok = one_wg is not None and max(one_wg[1]) == one_wg[0]
    if reading is None or not control_ok:
        return verdict(False, False, f"kernel (declared, fenced) {reading}; control {one_wg}")
    declared, fenced = reading
    return verdict(max(fenced) > declared, max(fenced) <= declared,
                   f"acc declared [{declared}], fenced with {fenced}; control (one warpgroup): "
                   f"declared [{one_wg[0]}], fenced with {one_wg[1]}")
