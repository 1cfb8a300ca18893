"""``T.warpgroup_fence_operand(acc)`` without ``num_regs`` fences the tile's logical size.

For a 64×64 fp32 accumulator of one warpgroup each thread holds 32 registers, but TileLang
0.1.15 derives the count from the buffer's logical shape (4096), so the emitted
``tl::warpgroup_fence_operand(acc, 4096)`` walks 4064 registers past the thread's fragment.
Upstream: not yet filed (this bundle is the report).
"""
import re

import tilelang.language as T

from ws_lab.upstream import lower_sm90a, verdict

TITLE = "warpgroup_fence_operand without num_regs uses the logical tile size, not registers per thread"
UPSTREAM = "to be filed (bundle: python -m ws_lab.repro fence_operand_num_regs)"
PASS_CONFIGS = {}
EXPECTED = "fence count 32 (64·64 fp32 over 128 threads), the fragment's registers per thread"
WORKAROUND = "every T.warpgroup_fence_operand in kernels/ passes num_regs (kernels/coop.py: s_regs, o_regs, p_regs)"
REGS_PER_THREAD = 64 * 64 // 128


def kernel():
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
            T.warpgroup_fence_operand(acc)  # no num_regs
            T.copy(acc, C)

    return fence_default


def lower():
    return lower_sm90a(kernel(), PASS_CONFIGS)


def check():
    """Fixed when the fence after the wait covers REGS_PER_THREAD registers; the bug, more."""
    src = lower()
    wait = src.find("wait_wgmma<0>")
    counts = ([int(n) for n in re.findall(r"warpgroup_fence_operand\([^;]*?,\s*(\d+)\)", src[wait:])]
              if wait >= 0 else [])
    return verdict(bool(counts) and counts[0] > REGS_PER_THREAD, counts[:1] == [REGS_PER_THREAD],
                   f"fence after the wait covers {counts[:1]} registers")
