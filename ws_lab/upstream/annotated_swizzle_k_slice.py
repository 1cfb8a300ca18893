"""A wgmma over a K-slice of an annotated shared buffer silently replaces the buffer's layout.

``T.annotate_layout({a_s: make_swizzled_layout(a_s)})`` on a 64 × 64 fp16 buffer gives the
128-byte swizzle (``initialize_wgmma_descriptor<1, 1, 64>``), and a full-width wgmma walks its
four k-steps at 32-byte offsets inside that layout. Issue the same wgmma over ``a_s[:, 0:16]``
(one k-step) and TileLang 0.1.15 re-lays the *whole* buffer in the 32-byte swizzle
(``<3, 1, 16>``): the annotation is ignored without a word, and every other access to the buffer
changes with it — in a persistent attention kernel every Q and K TMA load split into 8 boxes of
16 columns instead of 2 of 64. Merging conflicting swizzles to the finer one is deliberate
(PR #1736) and logged only at DLOG level, so this asks for two enhancements: (1) do not override
a ``T.annotate_layout`` silently — keep it or raise; (2) do not infer a finer swizzle from a
K-slice that starts on a 32-byte boundary inside the annotated one. The control is the
full-width wgmma, which keeps ``<1, 1, 64>``.
"""
import re

import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from ws_lab.upstream import lower_sm90a, verdict

TITLE = "a wgmma over a K-slice overrides the buffer's annotated swizzled layout"
TRIAGE = "enhancement"
IMPACT = ("speed, not measured: every other access to the buffer follows the finer swizzle "
          "(TMA loads in 16-column boxes); wrong values: none")
LINKS = ("https://github.com/tile-ai/tilelang/pull/1736 — merges conflicting swizzle layouts "
         "to the finer one on purpose (a DLOG warning only); this report asks for the two "
         "changes above",)
PASS_CONFIGS = {}
EXPECTED = ("the annotated 128-byte swizzle kept (descriptor <1, 1, 64>, as for the full-width "
            "wgmma; a 16-column slice starts at a 32-byte offset inside it), or an error saying "
            "the annotation cannot serve the slice")
WORKAROUND = "issue full-width wgmmas on annotated buffers (no K-slices)"
EXCERPT = r"initialize_wgmma_descriptor|wgmma_ss|a_s\)\[|a_s\) \+"


def kernel(k_cols: int = 16):
    @T.prim_func
    def k_slice(A: T.Tensor([64, 64], "float16"), B: T.Tensor([64, 64], "float16"),
                C: T.Tensor([64, 64], "float")):
        with T.Kernel(1, threads=128) as _:
            a_s = T.alloc_shared([64, 64], "float16")
            b_s = T.alloc_shared([64, 64], "float16")
            acc = T.alloc_fragment([64, 64], "float")
            T.annotate_layout({a_s: make_swizzled_layout(a_s), b_s: make_swizzled_layout(b_s)})
            T.copy(A, a_s)
            T.copy(B, b_s)
            T.wgmma_gemm(a_s[:, 0:k_cols], b_s[:, 0:k_cols], acc, transpose_B=True,
                         clear_accum=True)
            T.wait_wgmma(0)
            T.copy(acc, C)

    return k_slice


def control():
    return kernel(64)


def lower(k_cols: int = 16):
    return lower_sm90a(kernel(k_cols), PASS_CONFIGS)


def _descriptors(src: str) -> set[str]:
    return set(re.findall(r"initialize_wgmma_descriptor<([^>]*)>", src))


def check():
    """Fixed when the one-k-step wgmma keeps the layout the full-width one gets; the bug is a
    different layout. A lowering error, or no descriptor to compare, reads as changed codegen."""
    try:
        sliced = _descriptors(lower(16))
        full = _descriptors(lower_sm90a(control(), PASS_CONFIGS))
    except Exception as exc:
        return verdict(False, False, f"lowering raised {type(exc).__name__}: {exc}")
    found = bool(sliced) and bool(full)
    return verdict(found and sliced != full, found and sliced == full,
                   f"descriptor layouts: full width {sorted(full)}, K-slice {sorted(sliced)}")
