"""A fragment with an annotated ``T.Fragment`` layout inside ``if tx >= 128`` vanishes: the
emitted kernel body is empty.

A warp-specialized kernel gives each warpgroup its own branch of ``T.get_thread_binding()``.
TileLang 0.1.15 binds the layouts it *infers* there to the branch's thread range (128..255 for
the second warpgroup, threads counted from the range's start), but takes a layout given with
``T.annotate_layout`` as absolute thread numbers: its threads 0..127 never run in the branch,
and the branch's code is dropped without a word — loads, arithmetic, the stores to ``M``, even
the kernel's parameters. Adding 128 to the layout's thread function works in this kernel, but
not where the loop also touches a fragment whose layout was inferred in the branch (a stripe
filled from the warpgroup's wgmma accumulator): there lowering stops with "Layout infer
conflict" although both layouts put each element on the same thread. The same kernel with
``if tx < 128`` is emitted correctly. Found writing a row-max stripe for coop_overlap's second
warpgroup (NOTES.md, session 8).
"""
import tilelang.language as T
from tilelang.layout import Fragment

from ws_lab.upstream import lower_sm90a, verdict

TITLE = "an annotated fragment layout inside `if tx >= 128` silently drops the branch's code"
UPSTREAM = "to be filed (bundle: python -m ws_lab.repro annotated_fragment_second_warpgroup)"
PASS_CONFIGS = {}
EXPECTED = ("the branch's loads and stores of M for threads 128..255 (the layout's threads counted "
            "from the branch's first thread, as inferred layouts are), or an error saying the "
            "layout's threads lie outside the branch")
WORKAROUND = ("none needed in the kernels (the experiment that needed it was not kept); the lab "
              "annotates no fragment layouts inside a warpgroup branch")
EXCERPT = r"M\b|frag|threadIdx|\{|\}"


def kernel():
    # the wgmma accumulator's pattern on a 64 × 16 stripe: 8 registers a thread of 128
    stripe = Fragment([64, 16],
                      forward_thread_fn=lambda i, j: 32 * (i // 16) + 4 * (i % 8) + (j % 8) // 2,
                      forward_index_fn=lambda i, j: 4 * (j // 8) + 2 * ((i % 16) // 8) + j % 2)

    @T.prim_func
    def second_warpgroup(A: T.Tensor([64, 16], "float"), M: T.Tensor([64, 16], "float")):
        with T.Kernel(1, threads=256) as _:
            tx = T.get_thread_binding()
            if tx >= 128:
                frag = T.alloc_fragment([64, 16], "float")
                T.annotate_layout({frag: stripe})
                for i, j in T.Parallel(64, 16):
                    frag[i, j] = A[i, j] * 2.0
                for i, j in T.Parallel(64, 16):
                    M[i, j] = frag[i, j]

    return second_warpgroup


def lower():
    return lower_sm90a(kernel(), PASS_CONFIGS)


def check():
    """Fixed when the emitted kernel stores M; the bug is a kernel body without a store. A
    lowering error is not a documented fix: it reads as a changed codegen (recheck)."""
    try:
        src = lower()
    except Exception as exc:
        return verdict(False, False, f"lowering raised {type(exc).__name__}: {exc}")
    if "second_warpgroup_kernel(" not in src:
        return verdict(False, False, "no second_warpgroup_kernel in the emitted code")
    body = src[src.rindex("second_warpgroup_kernel("):]
    stores = body.count("(M + ")
    return verdict(stores == 0, stores > 0, f"{stores} stores to M in the emitted kernel; its "
                                            f"body: {body[body.index('{'):].split()}")
