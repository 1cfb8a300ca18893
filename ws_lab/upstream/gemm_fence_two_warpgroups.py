"""``T.gemm`` split over two warpgroups fences twice the accumulator registers a thread holds.

With 256 threads and ``GemmWarpPolicy.FullRow`` a 128×128 fp32 accumulator is 64 registers per
thread (each warpgroup owns 64 rows), and TileLang 0.1.15 declares ``float acc[64]`` — but the
``warpgroup_fence_operand`` calls around the wgmma pass 128, i.e. the whole tile over one
warpgroup. The fence's inline asm then names ``acc[64..127]``, past the end of the array
(undefined behaviour that nvcc happens to compile without spills today). Found reading the
lab's pipelined kernel (``python -m ws_lab.emit pipelined --shape llama8b-4k``).
"""
import re

import tilelang.language as T

from ws_lab.upstream import lower_sm90a, verdict

TITLE = "T.gemm over two warpgroups fences 2x the accumulator registers each thread declares"
UPSTREAM = "to be filed (bundle: python -m ws_lab.repro gemm_fence_two_warpgroups)"
PASS_CONFIGS = {}
EXPECTED = "every warpgroup_fence_operand(acc, n) has n <= the declared size of acc (64)"
WORKAROUND = ("none needed so far: the pipelined kernel is correct on the H100 (tests/ws); the "
              "lab's own kernels (coop) allocate per-warpgroup fragments, whose fences are right")


def kernel():
    @T.prim_func
    def two_warpgroups(A: T.Tensor([128, 64], "float16"), B: T.Tensor([128, 64], "float16"),
                       C: T.Tensor([128, 128], "float")):
        with T.Kernel(1, threads=256) as _:
            a_s = T.alloc_shared([128, 64], "float16")
            b_s = T.alloc_shared([128, 64], "float16")
            acc = T.alloc_fragment([128, 128], "float")
            T.copy(A, a_s)
            T.copy(B, b_s)
            T.gemm(a_s, b_s, acc, transpose_B=True, clear_accum=True,
                   policy=T.GemmWarpPolicy.FullRow)
            T.copy(acc, C)

    return two_warpgroups


def lower():
    return lower_sm90a(kernel(), PASS_CONFIGS)


def check():
    """Fixed when no fence names more registers than ``acc`` declares; the bug, one that does."""
    src = lower()
    match = re.search(r"float acc\[(\d+)\];", src)
    fenced = [int(n) for n in
              re.findall(r"warpgroup_fence_operand\(reinterpret_cast<float\*>\(acc \+ 0\), (\d+)\)", src)]
    if not match or not fenced:
        return verdict(False, False, f"declaration {bool(match)}, fences {fenced}")
    declared = int(match.group(1))
    return verdict(max(fenced) > declared, max(fenced) <= declared,
                   f"acc declared [{declared}], fenced with {sorted(set(fenced))}")
