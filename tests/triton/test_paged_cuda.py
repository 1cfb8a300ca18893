"""backend='cuda' (kernels/decode/paged_cuda.cu) on the GPU vs the float64 oracle: fresh random inputs,
NaN-poisoned outputs, and NaN in every cache slot a sequence does not own, so a read past a
length or outside a sequence's blocks shows. Tolerances as tests/triton/test_paged.py: fp16
2e-3 rel-L2; bf16 vLLM's atol 1.5e-2 / rtol 1e-2."""
import pytest

from ws_lab import oracle
from ws_lab.paged_cases import assert_matches_oracle, make_paged

pytestmark = pytest.mark.gpu

# (B, Hq, Hkv, lengths): groups 1–16; one CTA per pair (B·Hkv ≥ the SM count) and split
# contexts; lengths 0, 1, 15, 16, 17, block-aligned and not; one 57600-token context, and one
# of 33000 tokens on one CTA per pair (past what a warp sorts, so plan splits it).
CASES = [
    (8, 32, 32, [2048, 1, 777, 2048, 64, 1500, 2047, 33]),
    (32, 32, 8, [16, 17, 15, 2000] * 8),
    (4, 64, 8, [0, 4096, 3001, 1]),
    (3, 16, 1, [523, 37, 2011]),
    (1, 8, 2, [57600]),
    (2, 128, 8, [1328, 463]),
    (17, 28, 4, [200 + 37 * i for i in range(17)]),
    (17, 32, 8, [33000] + [100 + 61 * i for i in range(16)]),
]


def _poison_unowned_slots(kc, vc, table, lens):
    """NaN in every slot past a sequence's length and in every block no sequence uses."""
    import torch

    owned = torch.zeros(kc.shape[:2], dtype=torch.bool, device=kc.device)
    for b, n in enumerate(lens.tolist()):
        tokens = torch.arange(n, device=kc.device)
        owned[table[b, tokens // 16].long(), tokens % 16] = True
    kc[~owned] = float("nan")
    vc[~owned] = float("nan")


def _check(out, ref, seed):
    import torch

    assert torch.isfinite(out).all(), f"non-finite output (seed {seed})"
    assert_matches_oracle(out, ref, seed)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-{c[1]}/{c[2]}-ctx{max(c[3])}")
def test_cuda_mode_matches_oracle(case, dtype):
    import torch

    from ws_lab.kernels.decode import paged

    batch, heads, kv_heads, lens = case
    dt = getattr(torch, dtype)
    (q, kc, vc, table, lens_t), seed = make_paged(batch, heads, kv_heads, 128, 16, lens, dt,
                                                  "cuda")
    _poison_unowned_slots(kc, vc, table, lens_t)
    out = torch.full_like(q, float("nan"))
    paged.paged_attention(q, kc, vc, table, lens_t, backend="cuda", out=out)
    _check(out, oracle.paged_attention_ref(q, kc, vc, table, lens_t), seed)


def test_strided_q_and_out_and_a_scale():
    """q and out as every other head of wider tensors; an explicit softmax scale."""
    import torch

    from ws_lab.kernels.decode import paged

    (q, kc, vc, table, lens), seed = make_paged(6, 16, 2, 128, 16, [900, 31, 4000, 16, 1, 2222],
                                                torch.float16, "cuda")
    wide_q = torch.randn(6, 32, 128, dtype=torch.float16, device="cuda")
    wide_q[:, ::2] = q
    wide_out = torch.full_like(wide_q, float("nan"))
    paged.paged_attention(wide_q[:, ::2], kc, vc, table, lens, backend="cuda", out=wide_out[:, ::2],
                          softmax_scale=0.05)
    ref = oracle.paged_attention_ref(q, kc, vc, table, lens, softmax_scale=0.05)
    _check(wide_out[:, ::2], ref, seed)
    assert wide_out[:, 1::2].isnan().all()  # nothing written between the heads


def test_a_pool_past_two_to_the_31_elements():
    """Block ids near the end of a 2.1e9-element pool: the offsets are 64-bit."""
    import torch

    from ws_lab.kernels.decode import paged

    (q, kc, vc, table, lens), seed = make_paged(2, 16, 8, 128, 16, [3001, 770], torch.float16,
                                                "cuda", num_blocks=131080)
    table[0, :4] = torch.arange(131076, 131080, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    paged.paged_attention(q, kc, vc, table, lens, backend="cuda", out=out)
    _check(out, oracle.paged_attention_ref(q, kc, vc, table, lens), seed)


@pytest.mark.parametrize("batch,kv_heads", [(8, 32), (4, 8)], ids=["whole", "split"])
def test_cuda_graph_replays_match_oracle(batch, kv_heads):
    """Captured once (the launch goes through the driver API on the capturing stream),
    replayed on fresh queries."""
    import torch

    from ws_lab.kernels.decode import paged

    lens = [2048 - 97 * i for i in range(batch)]
    (q, kc, vc, table, lens_t), seed = make_paged(batch, 4 * kv_heads, kv_heads, 128, 16, lens,
                                                  torch.float16, "cuda")
    out = torch.full_like(q, float("nan"))
    paged.paged_attention(q, kc, vc, table, lens_t, backend="cuda", out=out)  # build outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged.paged_attention(q, kc, vc, table, lens_t, backend="cuda", out=out)
    for _ in range(3):
        q.normal_()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, oracle.paged_attention_ref(q, kc, vc, table, lens_t), seed)


def _rewrite_rows(table, kind, num_blocks):
    """The block tables the walk's sort (paged_cuda.cu's WalkSort) finds hardest."""
    import torch

    width = table.shape[1]
    for b in range(table.shape[0]):
        if kind == "repeats":  # four blocks over and over: equal ids in one bucket
            table[b] = table[b, torch.arange(width, device=table.device) % 4]
        elif kind == "run-and-outliers":  # most ids in one bucket, a few far away
            table[b] = (torch.arange(width, device=table.device) + b * width + 8) % num_blocks
            table[b, ::50] = torch.tensor([0, num_blocks - 1, 1, num_blocks - 2],
                                          device=table.device).repeat(width)[:len(table[b, ::50])]
        elif kind == "descending":
            table[b] = table[b].sort(descending=True).values
        elif kind == "consecutive":
            table[b] = torch.arange(width, device=table.device) + b * width


@pytest.mark.parametrize("kind", ["repeats", "run-and-outliers", "descending", "consecutive"])
@pytest.mark.parametrize("batch,kv_heads", [(8, 32), (4, 8)], ids=["whole", "split"])
def test_any_order_of_block_ids(kind, batch, kv_heads):
    """The CTA walks its blocks sorted by id, the context's partial last block in its own
    place; the table's order, repeats and spread must not matter."""
    import torch

    from ws_lab.kernels.decode import paged

    lens = [2000, 1999, 37, 2048, 1, 1500, 16, 2047][:batch]
    (q, kc, vc, table, lens_t), seed = make_paged(batch, 4 * kv_heads, kv_heads, 128, 16, lens,
                                                  torch.float16, "cuda")
    _rewrite_rows(table, kind, kc.shape[0])
    _poison_unowned_slots(kc, vc, table, lens_t)
    out = torch.full_like(q, float("nan"))
    paged.paged_attention(q, kc, vc, table, lens_t, backend="cuda", out=out)
    _check(out, oracle.paged_attention_ref(q, kc, vc, table, lens_t), seed)


@pytest.mark.parametrize("batch,kv_heads", [(8, 32), (4, 8)], ids=["whole", "split"])
def test_the_output_repeats_to_the_bit(batch, kv_heads):
    """The walk's order comes from the table alone (ascending ids; the atomics that bucket
    them only order equal ids, which are interchangeable), so two calls agree bit for bit."""
    import torch

    from ws_lab.kernels.decode import paged

    (q, kc, vc, table, lens_t), _ = make_paged(batch, 4 * kv_heads, kv_heads, 128, 16,
                                               [3000 - 111 * i for i in range(batch)],
                                               torch.bfloat16, "cuda")
    first, second = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    paged.paged_attention(q, kc, vc, table, lens_t, backend="cuda", out=first)
    paged.paged_attention(q, kc, vc, table, lens_t, backend="cuda", out=second)
    assert torch.equal(first, second)
