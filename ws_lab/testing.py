"""Test helpers shared by the tests and the bench's correctness column: fresh random inputs and
the NaN-poisoned check of an attention kernel against the float64 oracle."""
from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from ws_lab import oracle

# Relative L2 error ‖out−ref‖/‖ref‖ allowed per input dtype (P is rounded to the input dtype
# before the PV GEMM, so the error is a few ulps of that dtype).
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.2e-2, torch.float32: 1e-5}


def random_qkv(batch, seq_len, heads, kv_heads, head_dim, head_dim_v, dtype, device, seed=None):
    """Fresh N(0,1) q, k, v (never zeros); returns them and the seed that reproduces them."""
    seed = secrets.randbits(31) if seed is None else seed
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    q = randn(batch, seq_len, heads, head_dim)
    k = randn(batch, seq_len, kv_heads, head_dim)
    v = randn(batch, seq_len, kv_heads, head_dim_v)
    return (q, k, v), seed


@dataclass
class CheckResult:
    rel_err: float
    tolerance: float
    seed: int

    @property
    def ok(self) -> bool:
        return self.rel_err <= self.tolerance  # NaN compares False

    def __str__(self):
        return f"rel_err={self.rel_err:.3e} (tol {self.tolerance:.1e}, seed {self.seed})"


def check_attention(fn, batch, seq_len, heads, kv_heads, head_dim, head_dim_v, causal, dtype,
                    device="cuda", softmax_scale=None) -> CheckResult:
    """Runs ``fn(q, k, v, causal=, softmax_scale=, out=)`` on fresh random inputs into a
    NaN-poisoned output and compares with the float64 oracle."""
    (q, k, v), seed = random_qkv(batch, seq_len, heads, kv_heads, head_dim, head_dim_v, dtype, device)
    out = torch.full((batch, seq_len, heads, head_dim_v), float("nan"), dtype=dtype, device=device)
    fn(q, k, v, causal=causal, softmax_scale=softmax_scale, out=out)
    ref, _ = oracle.attention_ref(q, k, v, causal=causal, softmax_scale=softmax_scale)
    return CheckResult(oracle.rel_l2(out, ref), TOLERANCE[dtype], seed)


def memcheck_failure(script: str, timeout: int = 900) -> str | None:
    """Runs ``python -c script`` under compute-sanitizer memcheck. None when the script ends
    with "cases ok" printed and memcheck reports 0 errors; else the tail of its output (what a
    test asserts on). Raises ``FileNotFoundError`` without compute-sanitizer on PATH."""
    import shutil
    import subprocess
    import sys

    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        raise FileNotFoundError("compute-sanitizer not on PATH")
    done = subprocess.run([sanitizer, "--tool=memcheck", "--error-exitcode=3", sys.executable,
                           "-c", script], capture_output=True, text=True, timeout=timeout)
    clean = "ERROR SUMMARY: 0 errors" in done.stdout and "cases ok" in done.stdout
    return None if done.returncode == 0 and clean else done.stdout[-3000:] + done.stderr[-3000:]
