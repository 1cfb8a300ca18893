"""Pipelined baseline vs the float64 oracle on the H100 (tolerances: ws_lab.check.TOLERANCE).

Grid: (D, Dv) ∈ {64, 128, 256, 64/512} × fp16/bf16 × causal/full × S ∈ {4096, ragged}, GQA
group cycling through 1/4/8/16, plus batch 3 and a custom softmax scale — 34 cases. Every case
draws fresh random inputs and writes into a NaN-poisoned output.
"""
import itertools
from concurrent.futures import ThreadPoolExecutor

import pytest

from kernels import pipelined
from ws_lab.check import check_attention

pytestmark = pytest.mark.gpu

HEAD_DIMS = [(64, 64), (128, 128), (256, 256), (64, 512)]
GROUPS = itertools.cycle([1, 4, 8, 16])
RAGGED = itertools.cycle([1000, 4097])
KV_HEADS = 2


def _cases():
    cases = []
    for (d, dv), dtype, causal, ragged in itertools.product(HEAD_DIMS, ["float16", "bfloat16"],
                                                             [False, True], [False, True]):
        seq = next(RAGGED) if ragged else 4096
        cases.append(dict(batch=1, seq_len=seq, heads=KV_HEADS * next(GROUPS), kv_heads=KV_HEADS,
                          head_dim=d, head_dim_v=dv, causal=causal, dtype=dtype, scale=None))
    cases.append(dict(batch=3, seq_len=777, heads=8, kv_heads=2, head_dim=128, head_dim_v=128,
                      causal=True, dtype="float16", scale=None))
    cases.append(dict(batch=2, seq_len=512, heads=4, kv_heads=4, head_dim=64, head_dim_v=64,
                      causal=False, dtype="bfloat16", scale=0.3))
    return cases


CASES = _cases()


def _id(c):
    return (f"D{c['head_dim']}-{c['head_dim_v']}-{c['dtype']}-{'causal' if c['causal'] else 'full'}"
            f"-S{c['seq_len']}-B{c['batch']}-g{c['heads'] // c['kv_heads']}"
            + (f"-scale{c['scale']}" if c["scale"] else ""))


@pytest.fixture(scope="module", autouse=True)
def precompiled():
    """Compiles every case's kernel in parallel up front (nvcc dominates a serial run)."""
    import math

    def build(c):
        scale = c["scale"] or 1 / math.sqrt(c["head_dim"])
        cfg = pipelined.config_for(c["head_dim"], c["head_dim_v"], c["causal"])
        pipelined.compiled(c["batch"], c["seq_len"], c["heads"], c["kv_heads"], c["head_dim"],
                           c["head_dim_v"], c["causal"], c["dtype"], scale, cfg)

    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(build, CASES))


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_pipelined_matches_oracle(case):
    import torch

    result = check_attention(pipelined.attention, case["batch"], case["seq_len"], case["heads"],
                             case["kv_heads"], case["head_dim"], case["head_dim_v"], case["causal"],
                             getattr(torch, case["dtype"]), softmax_scale=case["scale"])
    assert result.ok, f"{_id(case)}: {result}"
