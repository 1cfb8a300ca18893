"""Paged decode attention on the GPU vs the float64 oracle: the seed's head grid and cases
re-expressed from vLLM's kernel tests (tolerances: bf16 atol 1.5e-2 / rtol 1e-2, fp32 1e-5
rel-L2, fp16 2e-3 rel-L2). Every mode, fresh random inputs, NaN-poisoned outputs."""
import itertools
import random

import pytest

from ws_lab import oracle
from ws_lab.kernels.decode import triton_common
from ws_lab.paged_cases import assert_matches_oracle, check_paged, make_paged, variants

pytestmark = pytest.mark.gpu
VARIANTS = tuple(variants())  # each mode, and split_k on each of its merges

# The seed's grid: MHA 32/32, GQA 32/8 and 64/8, MQA 16/1 and 32/1; B 1–32; fp16 and fp32.
SEED = [dict(batch=b, heads=hq, kv_heads=hkv, head_dim=128, block_size=16, dtype=dt,
             context_lens=[random.Random(b * hq + hkv).randint(1, 2048) for _ in range(b)])
        for (hq, hkv), b, dt in zip(
            [(32, 32), (32, 8), (64, 8), (16, 1), (32, 1)] * 2, [1, 7, 32, 3, 16, 32, 1, 5, 12, 2],
            ["float16"] * 5 + ["float32"] * 5)]
# vLLM: heads (4,4) (8,2) (5,1) (40,40) (64,8); head sizes 80/128/256; block sizes 16/32;
# context lengths [523, 37, 2011] and [1328, 18, 463]; pools of 2048 and 32768 blocks.
# A pool is capped where its K + V would pass POOL_BYTES (32768 blocks of 40 heads × D 256 fp32
# are 86 GB, more than the H100 holds).
POOL_BYTES = 16e9


def _pool(blocks, block_size, kv_heads, head_dim, dtype):
    block_bytes = 2 * block_size * kv_heads * head_dim * (4 if dtype == "float32" else 2)
    return min(blocks, int(POOL_BYTES // block_bytes))


VLLM = [dict(batch=3, heads=hq, kv_heads=hkv, head_dim=d, block_size=bs, dtype=dt, context_lens=cl,
             num_blocks=_pool(pool, bs, hkv, d, dt))
        for ((hq, hkv), d), bs, cl, pool, dt in zip(
            itertools.product([(4, 4), (8, 2), (5, 1), (40, 40), (64, 8)], [80, 128, 256]),
            itertools.cycle([16, 32]), itertools.cycle([[523, 37, 2011], [1328, 18, 463]]),
            itertools.cycle([2048, 32768]), itertools.cycle(["bfloat16", "float32"]))]
# One sequence at 57600 tokens; a pool past 2^31 elements (64-bit offsets into the cache).
LONG = [dict(batch=1, heads=8, kv_heads=2, head_dim=128, block_size=16, dtype="bfloat16",
             context_lens=[57600], num_blocks=32768),
        dict(batch=2, heads=16, kv_heads=8, head_dim=128, block_size=16, dtype="float16",
             context_lens=[3001, 770], num_blocks=131080)]
CASES = SEED + VLLM + LONG


def _id(c):
    return (f"{c['dtype']}-B{c['batch']}-{c['heads']}/{c['kv_heads']}-D{c['head_dim']}"
            f"-bs{c['block_size']}-pool{c.get('num_blocks', 'auto')}-ctx{max(c['context_lens'])}")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_paged_matches_oracle(case, variant):
    import torch

    fn = variants()[variant]
    dtype = getattr(torch, case["dtype"])
    args = (case["batch"], case["heads"], case["kv_heads"], case["head_dim"], case["block_size"],
            case["context_lens"], dtype, "cuda")
    if dtype == torch.bfloat16:  # vLLM's bf16 bar: elementwise atol 1.5e-2, rtol 1e-2
        (q, kc, vc, table, lens), seed = make_paged(*args, num_blocks=case.get("num_blocks"))
        out = torch.full_like(q, float("nan"))
        fn(q, kc, vc, table, lens, out=out)
        assert_matches_oracle(out, oracle.paged_attention_ref(q, kc, vc, table, lens), seed)
    else:
        err, tol, seed = check_paged(fn, *args, num_blocks=case.get("num_blocks"))
        assert err <= tol, f"rel_err {err:.3e} > {tol:.1e} (seed {seed})"


@pytest.mark.parametrize("variant", ["split_k-merge", "split_k-reduce", "auto"])
def test_cuda_graph_replays_match_oracle(variant):
    """Captured once, replayed on fresh queries: the grid and scratch depend on shapes only,
    and the in-kernel merge's arrival counters are zero again after every replay."""
    import torch

    from ws_lab.kernels.decode import paged

    (q, kc, vc, table, lens), seed = make_paged(8, 64, 8, 128, 16, [2048, 1, 777, 2048, 64,
                                                                  1500, 2047, 33], torch.float16,
                                                "cuda")
    fn = variants()[variant]
    out = torch.full_like(q, float("nan"))
    fn(q, kc, vc, table, lens, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(q, kc, vc, table, lens, out=out)
    for _ in range(3):
        q.normal_()
        out.fill_(float("nan"))
        graph.replay()
        err = oracle.rel_l2(out, oracle.paged_attention_ref(q, kc, vc, table, lens))
        assert err <= 2e-3, f"rel_err {err:.3e} (seed {seed})"
    torch.cuda.synchronize()
    assert all(int(c.abs().sum()) == 0 for c in triton_common.cached_arrival_counters())
