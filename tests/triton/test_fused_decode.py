"""The fused RoPE + KV-write + decode attention on the GPU vs the float64 oracle (tolerances:
ws_lab.decode_cases.TOLERANCE; the rotated k within 1 ulp of the reference cast to the cache
dtype, v bitwise, every other slot untouched, slots at and past each position NaN-poisoned):
fp16 / bf16, D 64 / 128, Hq/Hkv 14/2, 32/8 and 8/8, positions 0, 1, capacity − 1 and ragged,
static and paged caches. Then a CUDA graph captured once and replayed over 64 advancing
positions, and ``torch.compile(fullgraph=True)`` with no graph break and no recompile."""
import itertools

import pytest
import torch

from ws_lab import oracle
from ws_lab.decode_cases import TOLERANCE, check_decode, graph_replays, make_decode
from ws_lab.kernels.decode import fused_decode

pytestmark = pytest.mark.gpu

HEADS = [(14, 2), (32, 8), (8, 8)]
CAPACITY = 1024


def _positions(kind, batch):
    return {"zero": [0] * batch, "one": [1] * batch, "last": [CAPACITY - 1] * batch,
            "ragged": [(97 * b + 13) % CAPACITY for b in range(batch)]}[kind]


CASES = [dict(dtype=dt, head_dim=d, heads=h, positions=p, block_size=bs)
         for dt, d, h, p, bs in itertools.product(
             ["float16", "bfloat16"], [64, 128], HEADS, ["zero", "one", "last", "ragged"],
             [None, 16])
         if not (bs and p in ("one", "last"))]  # paged: the position cases that differ


def _id(c):
    return (f"{c['dtype']}-D{c['head_dim']}-{c['heads'][0]}/{c['heads'][1]}-{c['positions']}-"
            f"{'static' if c['block_size'] is None else 'paged' + str(c['block_size'])}")


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fused_decode_matches_oracle(case):
    batch = 5
    hq, hkv = case["heads"]
    problem = make_decode(batch, hq, hkv, case["head_dim"], CAPACITY,
                          _positions(case["positions"], batch), getattr(torch, case["dtype"]),
                          "cuda", case["block_size"])
    fn = (fused_decode.fused_decode_attention if case["block_size"] is None
          else fused_decode.fused_paged_decode_attention)
    result = check_decode(fn, problem)
    assert result.ok, result


def test_custom_scale_and_the_op_path():
    """softmax_scale given, and the call without ``out`` (through torch.ops.ws_lab.fused_decode)."""
    p = make_decode(3, 32, 8, 128, 4096, [4095, 2048, 7], torch.bfloat16, "cuda")
    ref, _, _ = oracle.fused_decode_ref(p.q, p.k_new, p.v_new, p.k_cache, p.v_cache, p.cos, p.sin,
                                        p.positions, 0.05)
    out = fused_decode.fused_decode_attention(*p.args(), softmax_scale=0.05)
    assert oracle.rel_l2(out, ref) <= TOLERANCE[torch.bfloat16]


STEPS = 64


def test_graph_replays_over_advancing_positions():
    """One capture; each replay decodes the next position of every sequence (ragged), its
    inputs fresh, its output, written slots and untouched slots checked against the oracle's
    step on the caches as they stood."""
    p = make_decode(4, 14, 2, 64, 256, [0, 10, 100, 37], torch.float16, "cuda")
    out = torch.empty_like(p.q)

    def step():
        fused_decode.fused_decode_attention(*p.args(), out=out)

    for position, result in graph_replays(p, step, out, STEPS):
        assert result.ok, (position, result)


def test_compiles_whole_and_once_as_positions_advance():
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    p = make_decode(2, 32, 8, 128, 512, [3, 200], torch.bfloat16, "cuda")

    def layer(q, k_new, v_new, k_cache, v_cache, cos, sin, positions):
        attn = fused_decode.fused_decode_attention(q, k_new, v_new, k_cache, v_cache, cos, sin,
                                                   positions)
        return attn.flatten(1) * 2.0

    compiled = torch.compile(layer, fullgraph=True)
    for _ in range(3):
        ref, _, _ = oracle.fused_decode_ref(p.q, p.k_new, p.v_new, p.k_cache, p.v_cache, p.cos,
                                            p.sin, p.positions)
        out = compiled(*p.args())
        assert oracle.rel_l2(out, 2.0 * ref.flatten(1)) <= TOLERANCE[torch.bfloat16]
        p.positions.add_(1)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
