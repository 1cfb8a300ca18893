"""The decode layer's kernels on the GPU vs float64 (kernels/step/decode_layer.py, kernels/step/sampling.py).

``linear`` at Qwen2.5-0.5B's layer shapes (q|k|v + bias, o and down split over K and summed by
the RMSNorm, gate|up with SwiGLU, the lm_head), M 1 / 64 / 65 (two row blocks), fp16 and bf16:
rel-L2 ≤ LINEAR_TOLERANCE (bf16 output rounding ~2^-9, the SwiGLU in the model dtype).
``top_k_sample``: every draw among the row's k largest (k 1, 50, 128; the 151936 vocabulary);
k = 1 is the argmax; the draw's frequencies match softmax(top-k / T) (chi-square, p ≈ 1e-4);
a CUDA graph replayed twice draws afresh."""
import pytest
import torch

from ws_lab import oracle
from ws_lab.kernels.step import decode_layer as dl
from ws_lab.kernels.step import sampling

pytestmark = pytest.mark.gpu

LINEAR_TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
HIDDEN, INTER, QKV, VOCAB = 896, 4864, 1152, 151936


def _randn(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 64, 65])
@pytest.mark.parametrize("name", ["qkv", "o", "gate_up", "down", "lm_head"])
def test_linear_matches_float64(name, rows, dtype):
    n, k = dict(qkv=(QKV, HIDDEN), o=(HIDDEN, HIDDEN), gate_up=(INTER, HIDDEN),
                down=(HIDDEN, INTER), lm_head=(VOCAB, HIDDEN))[name]
    x = _randn(rows, k, dtype=dtype)
    w = _randn(2 * n if name == "gate_up" else n, k, dtype=dtype, scale=k ** -0.5)
    bias = _randn(n, dtype=dtype) if name == "qkv" else None
    ref = x.double() @ w.double().t()
    if name == "qkv":
        out, ref = dl.linear(x, w, bias), ref + bias.double()
    elif name == "gate_up":
        out = dl.linear(x, w, glu=True)
        ref = torch.nn.functional.silu(ref[:, :n]) * ref[:, n:]
    elif name in ("o", "down"):  # split-K partials, summed by the norm
        residual, weight = _randn(rows, n, dtype=dtype), _randn(n, dtype=dtype)
        total = residual.double() + ref
        ref = weight.double() * total / (total.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
        parts = dl.linear(x, w, split_ok=True)
        assert parts.dim() == 3 and parts.dtype == torch.float32
        out = dl.add_rmsnorm(parts, weight, 1e-6, residual)
    else:
        out = dl.linear(x, w)
    assert out.shape == (rows, n) and out.dtype == dtype
    assert oracle.rel_l2(out, ref) <= LINEAR_TOLERANCE[dtype]


@pytest.mark.parametrize("rows", [64, 65])
def test_lm_head_chunk_maxima_equal_a_pass_over_its_logits(rows):
    x = _randn(rows, HIDDEN, dtype=torch.bfloat16)
    w = _randn(VOCAB, HIDDEN, dtype=torch.bfloat16, scale=HIDDEN ** -0.5)
    chunk_max = torch.full((rows, VOCAB // sampling.CHUNK), float("nan"), device="cuda")
    logits = dl.linear(x, w, chunk_max=chunk_max)
    assert torch.equal(chunk_max, logits.float().view(rows, -1, sampling.CHUNK).amax(-1))


def test_top_k_with_given_chunk_maxima_draws_the_same_tokens():
    logits = torch.randn(64, VOCAB, device="cuda").to(torch.bfloat16)
    draws = []
    for given in (None, logits.float().view(64, -1, sampling.CHUNK).amax(-1)):
        torch.manual_seed(3)
        draws.append(sampling.top_k_sample(logits, 50, 1.0, chunk_max=given))
    assert torch.equal(draws[0], draws[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [1, 50, 128])
def test_top_k_draws_stay_in_the_k_largest(k, dtype):
    logits = torch.randn(64, VOCAB, device="cuda").to(dtype)
    ids = sampling.top_k_sample(logits, k, 1.0)
    kth = torch.topk(logits.float(), k).values[:, -1:]
    assert (logits.float().gather(-1, ids[:, None]) >= kth).all()
    if k == 1:
        assert torch.equal(logits.float().gather(-1, ids[:, None]), kth)


def test_top_k_frequencies_match_the_softmax():
    k, temperature, rows = 8, 0.8, 40_000
    base = torch.randn(4096, device="cuda") * 2
    ids = sampling.top_k_sample(base.expand(rows, -1).contiguous(), k, temperature)
    top = torch.topk(base, k)
    expected = torch.softmax(top.values / temperature, 0) * rows
    counts = (ids[:, None] == top.indices[None]).sum(0).float()
    assert int(counts.sum()) == rows  # nothing outside the top k
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 30.0, (chi2, counts.tolist(), expected.tolist())  # df 7: p ≈ 1e-4


def test_top_k_seed_pair_advances_with_its_counter():
    """With a (base, counter) seed a graph replay draws afresh once the counter moves, and the
    same seed draws the same tokens."""
    logits = torch.zeros(64, VOCAB, device="cuda")  # 50 equal candidates a row: a uniform draw
    seed = (torch.tensor([1234], device="cuda"), torch.zeros(1, dtype=torch.long, device="cuda"))
    out = torch.empty(64, dtype=torch.long, device="cuda")
    sampling.top_k_sample(logits, 50, 1.0, seed=seed)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(sampling.top_k_sample(logits, 50, 1.0, seed=seed))
    graph.replay()
    first = out.clone()
    graph.replay()
    assert torch.equal(first, out)
    seed[1].add_(1)
    graph.replay()
    assert not torch.equal(first, out)
    assert torch.equal(first, sampling.top_k_sample(logits, 50, 1.0, seed=(seed[0], seed[1] - 1)))


def test_top_k_graph_replays_draw_afresh():
    logits = torch.zeros(64, VOCAB, device="cuda")  # 50 equal candidates a row: a uniform draw
    out = torch.empty(64, dtype=torch.long, device="cuda")
    sampling.top_k_sample(logits, 50, 1.0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(sampling.top_k_sample(logits, 50, 1.0))
    graph.replay()
    first = out.clone()
    graph.replay()
    assert not torch.equal(first, out)
