"""CUDA-source post-processor for TileLang's emitted code (wgmma fence/wait ordering).

``postprocess(code)`` runs every pass and returns the rewritten source with a report of each
rewrite; ``active()`` installs it as TileLang's CUDA post-processing hook for a ``with`` block
(TileLang's kernel cache is off meanwhile: its key ignores the hook) and restores whatever hook
was there before; blocks in several threads share one hook that runs each thread's passes.
Passes: ``fences.fence_after_wait``, ``anchors.drop_anchor_fences`` and, outside ``PASSES``
(a family opts in), ``rescale.skip_unit_rescale`` and ``uniform_wg.uniform_warpgroup``; a
kernel family compiles under the ones it needs.
"""
import contextlib
import threading

from ws_lab.postproc.anchors import drop_anchor_fences
from ws_lab.postproc.fences import fence_after_wait
from ws_lab.postproc.rescale import skip_unit_rescale
from ws_lab.postproc.uniform_wg import uniform_warpgroup
from ws_lab.postproc.report import PostprocError, Rewrite

PASSES = (fence_after_wait, drop_anchor_fences)
HOOK = "tilelang_callback_cuda_postproc"

__all__ = ["PASSES", "PostprocError", "Rewrite", "active", "drop_anchor_fences",
           "fence_after_wait", "postprocess", "skip_unit_rescale", "uniform_warpgroup"]


def postprocess(code: str, passes=PASSES) -> tuple[str, list[Rewrite]]:
    report: list[Rewrite] = []
    for rewrite in passes:
        code, done = rewrite(code)
        report += [r.by(rewrite.__name__) for r in done]
    return code, report


_STATE = threading.Lock()
_LOCAL = threading.local()  # this thread's stack of (passes, on_report)
_ACTIVE = {"blocks": 0, "previous": None, "cache_was_on": False}


@contextlib.contextmanager
def active(on_report=None, passes=PASSES):
    """TileLang compiles with ``passes`` inside the block; ``on_report(rewrites)`` sees each
    kernel's report. Blocks may run in several threads at once (parallel compiles): each
    thread's compiles take its own innermost block's passes, other threads' go to the hook
    installed before, if any (TileLang calls the hook in the compiling thread)."""
    import tilelang

    stack = _LOCAL.__dict__.setdefault("stack", [])
    stack.append((passes, on_report))
    with _STATE:
        if _ACTIVE["blocks"] == 0:
            _ACTIVE["previous"] = _current_hook()
            _ACTIVE["cache_was_on"] = tilelang.is_cache_enabled()
            tilelang.register_cuda_postproc(_dispatch)
            tilelang.disable_cache()
        _ACTIVE["blocks"] += 1
    try:
        yield
    finally:
        stack.pop()
        with _STATE:
            _ACTIVE["blocks"] -= 1
            if _ACTIVE["blocks"] == 0:
                _restore()


def _current_hook():
    import tvm_ffi

    return tvm_ffi.get_global_func(HOOK, allow_missing=True)


def _dispatch(code, target):
    stack = getattr(_LOCAL, "stack", [])
    if not stack:  # another thread's compile while a block is active
        previous = _ACTIVE["previous"]
        return previous(code, target) if previous is not None else code
    passes, on_report = stack[-1]
    code, report = postprocess(code, passes)
    if on_report:
        on_report(report)
    return code


def _restore():
    import tilelang
    import tvm_ffi

    if _ACTIVE["previous"] is not None:
        tilelang.register_cuda_postproc(_ACTIVE["previous"])
    else:
        tvm_ffi.remove_global_func(HOOK)
    if _ACTIVE["cache_was_on"]:
        tilelang.enable_cache()
