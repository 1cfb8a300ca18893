"""``T.warpgroup_fence_operand(acc)`` without ``num_regs`` fences the tile's logical size.

For a 64×64 fp32 accumulator of one warpgroup each thread holds 32 registers, but TileLang
0.1.15 derives the count from the buffer's logical shape (4096), so the emitted
``tl::warpgroup_fence_operand(acc, 4096)`` names 4064 registers past the thread's fragment.
The count is computed from the logical shape before layout inference. The control passes
``num_regs=32``.
"""
import re

import tilelang.language as T

from ws_lab.upstream import lower_sm90a, verdict

TITLE = "warpgroup_fence_operand without num_regs uses the logical tile size, not registers per thread"
TRIAGE = "latent UB"
IMPACT = ("none today: nvcc 13.0 compiles the out-of-range fence to the same SASS as the "
          "control's (see the SASS facts); the inline asm still names 4096 registers of a "
          "32-register array")
LINKS = ("none found: no open issue or PR on warpgroup_fence_operand's default count",)
PASS_CONFIGS = {}
EXPECTED = "fence count 32 (64·64 fp32 over 128 threads), the fragment's registers per thread"
WORKAROUND = "pass num_regs (the fragment's registers per thread) to every T.warpgroup_fence_operand"
REGS_PER_THREAD = 64 * 64 // 128


def kernel(num_regs=None):
    """``num_regs=None``: the fence takes TileLang's default; the control passes 32."""
    @T.prim_func
    def fence_default(A: T.Tensor([64, 64], "float16"), B: T.Tensor([64, 64], "float16"),
                      C: T.Tensor([64, 64], "float")):
        with T.Kernel(1, threads=128) as _:
            a_s = T.alloc_shared([64, 64], "float16")
            b_s = T.alloc_shared([64, 64], "float16")
            acc = T.alloc_fragment([64, 64], "float")
            T.copy(A, a_s)
            T.copy(B, b_s)
            T.wgmma_gemm(a_s, b_s, acc, transpose_B=True, clear_accum=True)
            T.wait_wgmma(0)
            if num_regs is None:
                T.warpgroup_fence_operand(acc)  # the default count
            else:
                T.warpgroup_fence_operand(acc, num_regs=num_regs)
            T.copy(acc, C)

    return fence_default


def control():
    return kernel(num_regs=REGS_PER_THREAD)


def lower():
    return lower_sm90a(kernel(), PASS_CONFIGS)


def _fence_after_wait(source: str) -> list[int]:
    wait = source.find("wait_wgmma<0>")
    return ([int(n) for n in re.findall(r"warpgroup_fence_operand\([^;]*?,\s*(\d+)\)",
                                         source[wait:])][:1] if wait >= 0 else [])


def check():
    """Fixed when the fence after the wait covers REGS_PER_THREAD registers, as the control's
    does; the bug, more."""
    counts = _fence_after_wait(lower())
    control_ok = _fence_after_wait(lower_sm90a(control(), PASS_CONFIGS)) == [REGS_PER_THREAD]
    return verdict(control_ok and bool(counts) and counts[0] > REGS_PER_THREAD,
                   control_ok and counts == [REGS_PER_THREAD],
                   f"fence after the wait covers {counts} registers; control (num_regs="
                   f"{REGS_PER_THREAD}): {'as given' if control_ok else 'not as given'}")
