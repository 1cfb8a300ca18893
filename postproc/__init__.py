"""CUDA-source post-processor for TileLang's emitted code (wgmma fence/wait ordering).

``postprocess(code)`` runs every pass and returns the rewritten source with a report of each
rewrite; ``active()`` installs it as TileLang's CUDA post-processing hook for a ``with`` block
(TileLang's kernel cache is off meanwhile: its key ignores the hook) and restores whatever hook
was there before. Passes: ``fences.fence_after_wait``.
"""
import contextlib

from postproc.fences import fence_after_wait
from postproc.report import PostprocError, Rewrite

PASSES = (fence_after_wait,)
HOOK = "tilelang_callback_cuda_postproc"

__all__ = ["PASSES", "PostprocError", "Rewrite", "active", "postprocess"]


def postprocess(code: str) -> tuple[str, list[Rewrite]]:
    report: list[Rewrite] = []
    for rewrite in PASSES:
        code, done = rewrite(code)
        report += done
    return code, report


@contextlib.contextmanager
def active(on_report=None):
    """TileLang compiles with the post-processor inside the block; ``on_report(rewrites)`` sees
    each kernel's report."""
    import tilelang
    import tvm_ffi

    previous = tvm_ffi.get_global_func(HOOK, allow_missing=True)
    cache_was_on = tilelang.is_cache_enabled()

    def hook(code, target):
        code, report = postprocess(code)
        if on_report:
            on_report(report)
        return code

    tilelang.register_cuda_postproc(hook)
    tilelang.disable_cache()
    try:
        yield
    finally:
        if previous is not None:
            tilelang.register_cuda_postproc(previous)
        else:
            tvm_ffi.remove_global_func(HOOK)
        if cache_was_on:
            tilelang.enable_cache()
