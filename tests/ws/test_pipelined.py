"""Pipelined baseline vs the float64 oracle on the H100 (tolerances: ws_lab.testing.TOLERANCE).

Grid: (D, Dv) ∈ {64, 128, 256, 64/512} × fp16/bf16 × causal/full × S ∈ {4096, ragged}, GQA
group cycling through 1/4/8/16, plus batch 3 and a custom softmax scale — 34 cases. Every case
draws fresh random inputs and writes into a NaN-poisoned output.
"""
import pytest

from ws_lab.kernels.fwd import pipelined
from tests.ws.grid import case_id, default_scale, grid, precompile
from ws_lab.testing import check_attention

pytestmark = pytest.mark.hopper

CASES = grid([(64, 64), (128, 128), (256, 256), (64, 512)], groups=[1, 4, 8, 16],
             ragged=[1000, 4097]) + [
    dict(batch=3, seq_len=777, heads=8, kv_heads=2, head_dim=128, head_dim_v=128, causal=True,
         dtype="float16", scale=None),
    dict(batch=2, seq_len=512, heads=4, kv_heads=4, head_dim=64, head_dim_v=64, causal=False,
         dtype="bfloat16", scale=0.3),
]


@pytest.fixture(scope="module", autouse=True)
def precompiled(request):
    def build(c):
        cfg = pipelined.config_for(c["head_dim"], c["head_dim_v"], c["causal"])
        pipelined.compiled(c["batch"], c["seq_len"], c["heads"], c["kv_heads"], c["head_dim"],
                           c["head_dim_v"], c["causal"], c["dtype"], default_scale(c), cfg)

    precompile(CASES, build, request)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_pipelined_matches_oracle(case):
    import torch

    result = check_attention(pipelined.attention, case["batch"], case["seq_len"], case["heads"],
                             case["kv_heads"], case["head_dim"], case["head_dim_v"], case["causal"],
                             getattr(torch, case["dtype"]), softmax_scale=case["scale"])
    assert result.ok, f"{case_id(case)}: {result}"
