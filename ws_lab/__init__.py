"""ws-lab: warp-specialized attention kernels for Hopper, with one harness for all of them.

The kernel families (``kernels/``) and the CUDA post-processor (``postproc/``) live beside this
package in the checkout and install as ``ws_lab.kernels`` and ``ws_lab.postproc`` (pyproject's
``package-dir``). Run from a checkout without installing (the GPU machine's ``PYTHONPATH=$PWD``),
the same names resolve through the checkout root added to this package's search path.
"""
import os as _os
import sys as _sys

__version__ = "0.1.0"

# Triton 3.9 warns on every compile until TRITON_DEFAULT_FP_FUSION is set; the lab's kernels were
# tuned and checked with FP fusion on (Triton ≤ 3.8's default), so that stays unless the user
# chose otherwise.
_os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_ROOT, "kernels", "__init__.py")):
    __path__.append(_ROOT)  # noqa: F821  (a package's own __path__)
    # Ahead of site-packages on sys.path (``python -m`` from the checkout, the bench scripts,
    # pytest), the checkout's kernels/ shadows Hugging Face's `kernels`, which transformers 5.25
    # requires and imports with its models: the root moves to the end (this package is bound).
    _sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _ROOT] + [_ROOT]
