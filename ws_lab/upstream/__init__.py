"""Minimal kernels pinning TileLang behaviours the lab works around (one module per issue).

Each module gives ``kernel()`` (the ≤ 60-line prim_func builder; its source goes into the repro
bundle), ``check() -> (ok, actual)`` (ok once TileLang behaves as expected), ``EXPECTED``,
``WORKAROUND``, ``TITLE`` and ``UPSTREAM``; optionally ``EXCERPT`` (a regex: the emitted lines the
bundle quotes) and ``run() -> str`` (what the kernel computes on a GPU; the bundle adds it when
one is present). ``tests/upstream`` asserts ``check()`` (and ``run()`` on a GPU) under strict
xfail; ``python -m ws_lab.repro NAME`` writes the bundle to paste into a TileLang issue.
"""


def lower_sm90a(prim_func, pass_configs) -> str:
    """The CUDA TileLang emits for ``prim_func`` on sm_90a (no GPU needed)."""
    import tilelang
    import tvm

    from ws_lab.target import SM90A

    target = tvm.target.Target(SM90A)
    with tilelang.transform.PassContext(config=pass_configs), target:
        return tilelang.lower(prim_func, target=target).kernel_source
