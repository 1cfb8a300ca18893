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
its layout's threads inside the branch is emitted correctly: the control, the same code on a
128-thread kernel under ``if tx >= 0``.
"""
import tilelang.language as T
from tilelang.layout import Fragment

from ws_lab.upstream import lower_sm90a, verdict

TITLE = "an annotated fragment layout inside `if tx >= 128` silently drops the branch's code"
TRIAGE = "wrong code"
IMPACT = ("wrong values: the kernel computes nothing (0 stores to M, no loads, an empty body) "
          "and no error or warning is given; read from the emitted code, no GPU run needed")
LINKS = ("none found: no open issue or PR on annotated layouts inside a thread-range branch",)
PASS_CONFIGS = {}
EXPECTED = ("the branch's loads and stores of M for threads 128..255 (the layout's threads counted "
            "from the branch's first thread, as inferred layouts are), or an error saying the "
            "layout's threads lie outside the branch")
WORKAROUND = "do not annotate fragment layouts inside a branch on the thread index"
EXCERPT = r"M\b|frag|threadIdx|\{|\}"


def kernel(branch_from: int = 128):
    """The code under ``if tx >= branch_from``; ``branch_from=0`` runs it on the first
    warpgroup (threads 0..127 of 128), the control."""
    # the wgmma accumulator's pattern on a 64 × 16 stripe: 8 registers a thread of 128
    stripe = Fragment([64, 16],
                      forward_thread_fn=lambda i, j: 32 * (i // 16) + 4 * (i % 8) + (j % 8) // 2,
                      forward_index_fn=lambda i, j: 4 * (j // 8) + 2 * ((i % 16) // 8) + j % 2)

    @T.prim_func
    def second_warpgroup(A: T.Tensor([64, 16], "float"), M: T.Tensor([64, 16], "float")):
        with T.Kernel(1, threads=branch_from + 128) as _:
            tx = T.get_thread_binding()
            if tx >= branch_from:
                frag = T.alloc_fragment([64, 16], "float")
                T.annotate_layout({frag: stripe})
                for i, j in T.Parallel(64, 16):
                    frag[i, j] = A[i, j] * 2.0
                for i, j in T.Parallel(64, 16):
                    M[i, j] = frag[i, j]

    return second_warpgroup


def control():
    return kernel(branch_from=0)


def lower():
    return lower_sm90a(kernel(), PASS_CONFIGS)


def _stores(prim_func) -> tuple[int | None, str]:
    """Stores to M in the emitted kernel (None: no kernel), and the body's tokens."""
    src = lower_sm90a(prim_func, PASS_CONFIGS)
    if "second_warpgroup_kernel(" not in src:
        return None, "no second_warpgroup_kernel in the emitted code"
    body = src[src.rindex("second_warpgroup_kernel("):]
    return body.count("(M + "), " ".join(body[body.index("{"):].split())[:200]


def check():
    """Fixed when the emitted kernel stores M; the bug is a kernel body without a store, while
    the control (the first warpgroup) stores M. A lowering error is not a documented fix: it
    reads as a changed codegen (recheck)."""
    try:
        (stores, body), (control_stores, _) = _stores(kernel()), _stores(control())
    except Exception as exc:
        return verdict(False, False, f"lowering raised {type(exc).__name__}: {exc}")
    control_ok = bool(control_stores)
    return verdict(control_ok and stores == 0, control_ok and bool(stores),
                   f"{stores} stores to M under `tx >= 128` (body: {body}); control "
                   f"(one warpgroup, `tx >= 0`): {control_stores} stores")
