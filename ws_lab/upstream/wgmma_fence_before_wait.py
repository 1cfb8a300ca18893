"""``T.wgmma_gemm`` emits its trailing accumulator fence *before* ``T.wait_wgmma``, none after.

``warpgroup_fence_operand`` is what stops nvcc from moving reads of the accumulator across the
asynchronous wgmma. TileLang 0.1.15 closes each ``T.wgmma_gemm`` with arrive … mma_async …
commit, fence(acc) and leaves the wait to the user; the fence then sits before the wait, where
it orders nothing that matters, and no fence follows the wait. FA3 (``hopper/utils.h``
``flash::gemm`` + ``warpgroup_wait``) fences the accumulator after the wait.
"""
import re

import tilelang.language as T

from ws_lab.upstream import lower_sm90a, verdict

TITLE = "T.wgmma_gemm's accumulator fence is emitted before T.wait_wgmma instead of after it"
UPSTREAM = "to be filed (bundle: python -m ws_lab.repro wgmma_fence_before_wait)"
PASS_CONFIGS = {}
EXPECTED = "a warpgroup_fence_operand on the accumulator after wait_wgmma<0>(), before acc is read"
WORKAROUND = ("kernels/coop.py calls T.warpgroup_fence_operand(acc, num_regs=…) right after every "
              "T.wait_wgmma; the post-processor of the IntraWGOverlap issue is to do it for "
              "hand-written wgmma")


def kernel():
    @T.prim_func
    def fence_order(A: T.Tensor([64, 64], "float16"), B: T.Tensor([64, 64], "float16"),
                    C: T.Tensor([64, 64], "float")):
        with T.Kernel(1, threads=128) as _:
            a_s = T.alloc_shared([64, 64], "float16")
            b_s = T.alloc_shared([64, 64], "float16")
            acc = T.alloc_fragment([64, 64], "float")
            T.copy(A, a_s)
            T.copy(B, b_s)
            T.wgmma_gemm(a_s, b_s, acc, transpose_B=True, clear_accum=True)
            T.wait_wgmma(0)
            T.copy(acc, C)

    return fence_order


def lower():
    return lower_sm90a(kernel(), PASS_CONFIGS)


def check():
    """Fixed when the accumulator is fenced between the wait and its first read; the bug, fences
    before the wait only."""
    src = lower()
    wait = src.find("wait_wgmma<0>")
    if wait < 0:
        return verdict(False, False, "no wait_wgmma<0> in the emitted code")
    before = len(re.findall(r"warpgroup_fence_operand\(reinterpret_cast<float\*>\(acc", src[:wait]))
    after = len(re.findall(r"warpgroup_fence_operand\(reinterpret_cast<float\*>\(acc", src[wait:]))
    return verdict(before > 0 and after == 0, after > 0,
                   f"{before} accumulator fence(s) before wait_wgmma<0>, {after} after it")
