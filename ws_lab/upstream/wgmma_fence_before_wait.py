"""``T.wgmma_gemm`` emits its trailing accumulator fence *before* ``T.wait_wgmma``, none after.

``warpgroup_fence_operand`` keeps nvcc from moving accesses of the accumulator across the
asynchronous wgmma. TileLang 0.1.15 closes each ``T.wgmma_gemm`` with arrive … mma_async …
commit, fence(acc) and leaves the wait to the user, so no fence follows the wait. That is the
order of FA3's ``flash::gemm`` (hopper/utils.h), which fences before the commit and leaves
``warpgroup_wait`` to its caller: this is a request, not a bug report. The request: fence the
accumulator after ``T.wait_wgmma`` (or document that callers must), so reads after the wait
cannot be hoisted above it. The control adds that fence by hand.
"""
import re

import tilelang.language as T

from ws_lab.upstream import lower_sm90a, verdict

TITLE = "T.wgmma_gemm's accumulator fence is emitted before T.wait_wgmma instead of after it"
TRIAGE = "enhancement"
IMPACT = ("none today: with nvcc 13.0 the kernel and the control (fenced after the wait) "
          "compile to identical SASS (see the SASS facts)")
LINKS = ("none found: no open issue or PR on the fence placement of T.wgmma_gemm",)
PASS_CONFIGS = {}
EXPECTED = "a warpgroup_fence_operand on the accumulator after wait_wgmma<0>(), before acc is read"
WORKAROUND = "call T.warpgroup_fence_operand(acc, num_regs=…) right after every T.wait_wgmma"


def kernel(fence_after_wait: bool = False):
    """``fence_after_wait=True``: the control, fenced by hand after the wait."""
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
            if fence_after_wait:
                T.warpgroup_fence_operand(acc, num_regs=32)
            T.copy(acc, C)

    return fence_order


def control():
    return kernel(fence_after_wait=True)


def lower():
    return lower_sm90a(kernel(), PASS_CONFIGS)


def _fences(source: str):
    """(accumulator fences before wait_wgmma<0>, after it), or None without a wait."""
    wait = source.find("wait_wgmma<0>")
    if wait < 0:
        return None
    fence = r"warpgroup_fence_operand\(reinterpret_cast<float\*>\(acc"
    return len(re.findall(fence, source[:wait])), len(re.findall(fence, source[wait:]))


def check():
    """Fixed when the accumulator is fenced between the wait and its first read, as in the
    control; the bug, fences before the wait only."""
    reading, fenced = _fences(lower()), _fences(lower_sm90a(control(), PASS_CONFIGS))
    control_ok = fenced is not None and fenced[1] > 0
    if reading is None or not control_ok:
        return verdict(False, False, f"kernel (before, after) {reading}; control {fenced}")
    before, after = reading
    return verdict(before > 0 and after == 0, after > 0,
                   f"{before} accumulator fence(s) before wait_wgmma<0>, {after} after it; "
                   f"control: {fenced[1]} after it")
