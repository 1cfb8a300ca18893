"""A generic store to a shared buffer no async operation touches still gets a proxy fence
before every later wgmma.

``fence.proxy.async`` orders accesses to the *same* shared-memory bytes through the generic and
the async proxy. TileLang 0.1.15's InjectFenceProxy puts ``fence_proxy_async()`` after the
``warpgroup_arrive()`` of each wgmma that follows a generic shared store, whatever buffer the
store wrote: here the wgmma reads only TMA-loaded ``a_s`` / ``b_s``, the store goes to ``note``,
which nothing reads, and the wgmma is fenced anyway. In coop_overlap's KV loop (a 4-value store
per thread that anchors ptxas' schedule) the fences cost 1.4 % (half the anchor's gain).
"""
import re

import tilelang.language as T

from ws_lab.upstream import lower_sm90a, verdict

TITLE = "InjectFenceProxy fences a wgmma after a generic store to an unrelated shared buffer"
UPSTREAM = "to be filed (bundle: python -m ws_lab.repro fence_proxy_for_unrelated_smem)"
PASS_CONFIGS = {}
EXPECTED = ("no fence_proxy_async() between warpgroup_arrive() and the wgmma: the wgmma reads "
            "a_s / b_s (written by TMA only), the generic store wrote note")
WORKAROUND = ("postproc/anchors.py (drop_anchor_fences) removes those fences when every other "
              "generic shared store carries its own fence and the stored buffer is never read; "
              "kernels/coop_overlap.py compiles its anchored KV loop under it")


def kernel():
    @T.prim_func
    def unrelated_store(A: T.Tensor([64, 64], "float16"), B: T.Tensor([64, 64], "float16"),
                        C: T.Tensor([64, 64], "float")):
        with T.Kernel(1, threads=128) as _:
            a_s = T.alloc_shared([64, 64], "float16")
            b_s = T.alloc_shared([64, 64], "float16")
            note = T.alloc_shared([64, 8], "float")
            acc = T.alloc_fragment([64, 64], "float")
            loaded = T.alloc_barrier(1)
            T.tma_copy(A, a_s, barrier=loaded)
            T.tma_copy(B, b_s, barrier=loaded)
            T.mbarrier_arrive(loaded)
            T.mbarrier_wait_parity(loaded, 0)
            T.fill(acc, 1.0)
            for i, j in T.Parallel(64, 8):
                note[i, j] = acc[i, j]
            T.wgmma_gemm(a_s, b_s, acc, transpose_B=True, clear_accum=False)
            T.wait_wgmma(0)
            T.copy(acc, C)

    return unrelated_store


def lower():
    return lower_sm90a(kernel(), PASS_CONFIGS)


def check():
    """Fixed when no proxy fence sits between the arrive and the wgmma; the bug, one or more."""
    src = lower()
    arrive, wgmma = src.find("warpgroup_arrive"), src.find("wgmma_ss")
    if arrive < 0 or wgmma < arrive:
        return verdict(False, False, "no warpgroup_arrive() … wgmma_ss window in the code")
    fences = len(re.findall(r"fence_proxy_async\(\)", src[arrive:wgmma]))
    return verdict(fences > 0, fences == 0,
                   f"{fences} fence_proxy_async() between warpgroup_arrive() and wgmma_ss")
