"""A generic store to a shared buffer no async operation touches still gets a proxy fence
before every later wgmma.

``fence.proxy.async`` orders accesses to the *same* shared-memory bytes through the generic and
the async proxy. TileLang 0.1.15's InjectFenceProxy puts ``fence_proxy_async()`` after the
``warpgroup_arrive()`` of each wgmma that follows a generic shared store, whatever buffer the
store wrote: here the wgmma reads only TMA-loaded ``a_s`` / ``b_s``, the store goes to ``note``,
which nothing reads, and the wgmma is fenced anyway. The pass is documented as conservative,
so this is a request: track which buffer a generic store wrote, and fence only before async
operations that read it. The control is the same kernel without the store to ``note``; the
fences are counted over the whole kernel against it.
"""
import re

import tilelang.language as T

from ws_lab.upstream import lower_sm90a, verdict

TITLE = "InjectFenceProxy fences a wgmma after a generic store to an unrelated shared buffer"
TRIAGE = "enhancement"
IMPACT = ("speed: 1.4 % on an FA3-style attention forward on the H100 (Llama-3-8B shape, 4k "
          "tokens), where such a store sits in the KV loop; here one extra FENCE.VIEW.ASYNC.S "
          "against the control (see the SASS facts); wrong values: none")
LINKS = ("none found: no open issue on per-buffer proxy tracking in InjectFenceProxy",)
PASS_CONFIGS = {}
EXPECTED = ("no fence_proxy_async() between warpgroup_arrive() and the wgmma: the wgmma reads "
            "a_s / b_s (written by TMA only), the generic store wrote note")
WORKAROUND = ("post-process the emitted CUDA (tilelang.register_cuda_postproc) to drop the "
              "fences where the stored buffer is never read by an async operation")


def kernel(store_note: bool = True):
    """``store_note=False``: the control, the same kernel without the generic store."""
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
            if store_note:
                for i, j in T.Parallel(64, 8):
                    note[i, j] = acc[i, j]
            T.wgmma_gemm(a_s, b_s, acc, transpose_B=True, clear_accum=False)
            T.wait_wgmma(0)
            T.copy(acc, C)

    return unrelated_store


def control():
    return kernel(store_note=False)


def lower():
    return lower_sm90a(kernel(), PASS_CONFIGS)


def _fences(source: str) -> int:
    return len(re.findall(r"fence_proxy_async\(\)", source[source.rfind("__global__"):]))


def check():
    """Fixed when the kernel has no more proxy fences than the control; the bug, more. Both
    must lower a wgmma, or codegen changed."""
    src, ctl = lower(), lower_sm90a(control(), PASS_CONFIGS)
    if "wgmma_ss" not in src or "wgmma_ss" not in ctl:
        return verdict(False, False, "no wgmma_ss in the kernel or the control")
    fences, control_fences = _fences(src), _fences(ctl)
    return verdict(fences > control_fences, fences == control_fences,
                   f"{fences} fence_proxy_async() in the kernel, {control_fences} in the "
                   f"control (no generic store)")
