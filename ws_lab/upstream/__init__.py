"""Minimal kernels pinning TileLang behaviours the lab works around (one module per issue).

Each module gives ``kernel()`` (the ≤ 60-line prim_func builder; its source goes into the repro
bundle), ``check() -> (ok, actual)`` (ok once TileLang behaves as expected), ``EXPECTED``,
``WORKAROUND``, ``TITLE`` and ``UPSTREAM``. ``tests/upstream`` asserts ``check()`` under strict xfail;
``python -m ws_lab.repro NAME`` writes the bundle to paste into a TileLang issue.
"""
