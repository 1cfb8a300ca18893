"""LargeHeadDimV (QK head dim 64, V head dim 256/512) vs the float64 oracle on the H100.

Grid: Dv ∈ {256, 512} × fp16/bf16 × causal/full × S ∈ {2048, ragged} × B ∈ {1, 2}, GQA group
cycling through 1/4/8 — 32 cases, plus a custom scale, then FA4's conditional rescale
(``lazy_rescale``) at Dv 512 with wide scores among them, 10 more, and the widest case without
it (tolerances: ws_lab.testing.TOLERANCE). Then 20 runs on the same inputs give
bitwise-identical output, with and without it, and compute-sanitizer's racecheck and memcheck
find nothing.
"""
import pytest

from ws_lab.kernels.fwd import largehdv
from tests.ws.grid import (assert_bitwise_repeatable, assert_sanitizer_clean, case_id,
                           default_scale, grid, precompile)
from ws_lab.testing import check_attention, random_qkv

pytestmark = pytest.mark.hopper

CASES = [c for batch in (1, 2)
         for c in grid(largehdv.HEAD_DIMS, groups=[1, 4, 8], ragged=[1000, 2049, 77],
                       batch=batch, seq_len=2048)] + [
    dict(batch=2, seq_len=333, heads=6, kv_heads=3, head_dim=64, head_dim_v=512, causal=True,
         dtype="float16", scale=0.2)]
# FA4's conditional rescale (lazy_rescale): Dv 512, and wide scores (scale 1 at D 64: a block's
# max passes the old one by more than 2^8 often), so that the kept and the moved max both run
WIDE = dict(batch=2, seq_len=1000, heads=8, kv_heads=2, head_dim=64, head_dim_v=512,
            causal=False, dtype="bfloat16", scale=1.0)
CASES += [dict(c, lazy=True) for c in grid([(64, 512)], groups=[1, 4, 8], ragged=[1000, 77],
                                           seq_len=2048)
          + [WIDE, dict(WIDE, causal=True, dtype="float16")]]
CASES += [WIDE]  # the same wide scores without the threshold


@pytest.fixture(scope="module", autouse=True)
def precompiled(request):
    precompile(CASES, lambda c: largehdv.compiled(
        c["batch"], c["seq_len"], c["heads"], c["kv_heads"], c["head_dim"], c["head_dim_v"],
        c["causal"], c["dtype"], default_scale(c), c.get("lazy", False)), request)


def _id(c):
    return case_id(c) + ("-lazy" if c.get("lazy") else "")


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_largehdv_matches_oracle(case):
    import functools

    import torch

    fn = functools.partial(largehdv.attention, lazy_rescale=case.get("lazy", False))
    result = check_attention(fn, case["batch"], case["seq_len"], case["heads"],
                             case["kv_heads"], case["head_dim"], case["head_dim_v"], case["causal"],
                             getattr(torch, case["dtype"]), softmax_scale=case["scale"])
    assert result.ok, f"{_id(case)}: {result}"


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_largehdv_is_bitwise_repeatable(causal, lazy):
    import functools

    import torch

    qkv, _ = random_qkv(2, 2048, 32, 32, 64, 512, torch.float16, "cuda")
    assert_bitwise_repeatable(functools.partial(largehdv.attention, lazy_rescale=lazy), qkv,
                              causal)


SANITIZED = """
import torch
from ws_lab.kernels.fwd import largehdv
from ws_lab.testing import check_attention
r = check_attention(largehdv.attention, 1, 300, 4, 2, 64, 512, True, torch.float16)
assert r.ok, r
"""


@pytest.mark.parametrize("tool", ["racecheck", "memcheck"])
def test_largehdv_sanitizer_clean(tool):
    assert_sanitizer_clean(tool, SANITIZED)
