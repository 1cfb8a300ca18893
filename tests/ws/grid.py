"""Shared pieces of the GPU correctness grids: case ids, parallel pre-compilation, the
bitwise-repeatability check and the compute-sanitizer run."""
import itertools
import math
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor


def case_id(c):
    return (f"D{c['head_dim']}-{c['head_dim_v']}-{c['dtype']}-{'causal' if c['causal'] else 'full'}"
            f"-S{c['seq_len']}-B{c['batch']}-g{c['heads'] // c['kv_heads']}"
            + (f"-scale{c['scale']}" if c.get("scale") else "")
            + ("" if c.get("pingpong", True) else "-nopp")
            + ("-persistent" if c.get("persistent") else ""))


def grid(head_dims, groups, ragged, kv_heads=2, batch=1, seq_len=4096, **extra):
    """fp16/bf16 × causal/full × S {seq_len, ragged} for each (D, Dv), cycling GQA groups."""
    groups, ragged = itertools.cycle(groups), itertools.cycle(ragged)
    cases = []
    for (d, dv), dtype, causal, is_ragged in itertools.product(
            head_dims, ["float16", "bfloat16"], [False, True], [False, True]):
        cases.append(dict(batch=batch, seq_len=next(ragged) if is_ragged else seq_len,
                          heads=kv_heads * next(groups), kv_heads=kv_heads, head_dim=d,
                          head_dim_v=dv, causal=causal, dtype=dtype, scale=None, **extra))
    return cases


def precompile(cases, build, request=None):
    """Compiles the kernels of the selected cases in parallel (nvcc dominates a serial run);
    with ``request`` (the fixture's), cases that ``-k`` deselected are skipped. Not under
    pytest-xdist: every worker would build every selected case, 16 threads each (16 workers
    built 16 × 42 kernels and ran no case in 190 s; notes/coop_overlap.md, "Session 62"), and
    the workers already compile side by side."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if request is not None:
        chosen = {id(item.callspec.params["case"]) for item in request.session.items
                  if "case" in getattr(getattr(item, "callspec", None), "params", {})}
        cases = [c for c in cases if id(c) in chosen]
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(build, cases))


def default_scale(c):
    return c["scale"] or 1.0 / math.sqrt(c["head_dim"])


def assert_bitwise_repeatable(entry, qkv, causal, runs=20):
    """``runs`` calls of ``entry`` on the same inputs, each into a NaN-poisoned output, agree
    bit for bit."""
    import torch

    q, k, v = qkv
    first = entry(q, k, v, causal=causal)
    for _ in range(runs - 1):
        out = torch.full_like(first, float("nan"))
        entry(q, k, v, causal=causal, out=out)
        assert torch.equal(out, first)


SANITIZER_CLEAN = {"memcheck": "ERROR SUMMARY: 0 errors",
                   "racecheck": "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"}


def assert_sanitizer_clean(tool, script, kernels="main_kernel"):
    """compute-sanitizer ``tool`` over the kernels whose name contains ``kernels`` (TileLang's
    ``main_kernel`` by default) that ``script`` launches finds nothing; skips where
    compute-sanitizer is not installed."""
    import pytest

    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        pytest.skip("compute-sanitizer not on PATH")
    done = subprocess.run([sanitizer, f"--tool={tool}", "--kernel-name", f"kns={kernels}",
                           "--error-exitcode=3", sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert SANITIZER_CLEAN[tool] in done.stdout, done.stdout[-3000:]
