"""The float64 oracle against a direct per-element formula (GQA, causal, Dv != D, scale)."""
import math

import pytest
import torch

from ws_lab import oracle


def naive(q, k, v, causal, scale):
    batch, seq, heads, _ = q.shape
    group = heads // k.shape[2]
    out = torch.zeros(batch, seq, heads, v.shape[3], dtype=torch.float64)
    lse = torch.zeros(batch, heads, seq, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            kh = h // group
            for i in range(seq):
                keys = range(i + 1) if causal else range(seq)
                logits = [scale * float(q[b, i, h].double() @ k[b, j, kh].double()) for j in keys]
                m = max(logits)
                weights = [math.exp(x - m) for x in logits]
                total = sum(weights)
                lse[b, h, i] = m + math.log(total)
                for w, j in zip(weights, keys):
                    out[b, i, h] += (w / total) * v[b, j, kh].double()
    return out, lse


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 1), (6, 2)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim,head_dim_v", [(8, 8), (8, 12)])
def test_oracle_matches_naive(heads, kv_heads, causal, head_dim, head_dim_v):
    gen = torch.Generator().manual_seed(heads * 100 + head_dim_v + causal)
    q = torch.randn(2, 7, heads, head_dim, generator=gen)
    k = torch.randn(2, 7, kv_heads, head_dim, generator=gen)
    v = torch.randn(2, 7, kv_heads, head_dim_v, generator=gen)
    scale = 0.3
    out, lse = oracle.attention_ref(q, k, v, causal=causal, softmax_scale=scale)
    want_out, want_lse = naive(q, k, v, causal, scale)
    assert out.shape == (2, 7, heads, head_dim_v)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_default_scale_is_rsqrt_head_dim():
    q, k, v = (torch.randn(1, 5, 2, 16) for _ in range(3))
    out, _ = oracle.attention_ref(q, k, v)
    want, _ = oracle.attention_ref(q, k, v, softmax_scale=0.25)
    torch.testing.assert_close(out, want)


def test_head_chunking_gives_the_same_answer(monkeypatch):
    q, k, v = torch.randn(2, 9, 8, 4), torch.randn(2, 9, 2, 4), torch.randn(2, 9, 2, 6)
    whole, whole_lse = oracle.attention_ref(q, k, v, causal=True)
    monkeypatch.setattr(oracle, "_SCORE_ELEMS", 81)  # one head per chunk
    chunked, chunked_lse = oracle.attention_ref(q, k, v, causal=True)
    torch.testing.assert_close(whole, chunked, rtol=0, atol=0)
    torch.testing.assert_close(whole_lse, chunked_lse, rtol=0, atol=0)


def test_rel_l2_catches_nan_and_error():
    ref = torch.randn(100, dtype=torch.float64)
    assert oracle.rel_l2(ref, ref) == 0
    assert abs(oracle.rel_l2(ref * 1.01, ref) - 0.01) < 1e-12
    bad = ref.clone()
    bad[3] = float("nan")
    assert math.isnan(oracle.rel_l2(bad, ref))


def test_oracle_rejects_partial_groups():
    with pytest.raises(ValueError, match="multiple"):
        oracle.attention_ref(torch.randn(1, 4, 6, 8), torch.randn(1, 4, 4, 8), torch.randn(1, 4, 4, 8))


def closed_form_grads(q, k, v, dout, causal, scale):
    """FlashAttention's backward written out: P = softmax(S), dV = Pᵀ dO, dP = dO Vᵀ,
    dS = P ∘ (dP − rowsum(dO ∘ O)), dQ = scale · dS K, dK = scale · dSᵀ Q, dK / dV summed over
    each query group."""
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    group = q.shape[2] // k.shape[2]
    kx, vx = (t.repeat_interleave(group, dim=2) for t in (k, v))  # B S Hq D
    s = torch.einsum("bihd,bjhd->bhij", q, kx) * scale
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = torch.einsum("bhij,bjhd->bihd", p, vx)
    dp = torch.einsum("bihd,bjhd->bhij", dout, vx)
    ds = p * (dp - (dout * o).sum(-1).transpose(1, 2)[..., None])
    dq = torch.einsum("bhij,bjhd->bihd", ds, kx) * scale
    dk = torch.einsum("bhij,bihd->bjhd", ds, q) * scale
    dv = torch.einsum("bhij,bihd->bjhd", p, dout)
    fold = lambda t: t.unflatten(2, (k.shape[2], group)).sum(3)  # noqa: E731
    return dq, fold(dk), fold(dv)


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (8, 2), (7, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_oracle_matches_the_closed_form(heads, kv_heads, causal):
    gen = torch.Generator().manual_seed(heads * 10 + causal)
    q = torch.randn(2, 9, heads, 16, generator=gen).half()
    k = torch.randn(2, 9, kv_heads, 16, generator=gen).half()
    v = torch.randn(2, 9, kv_heads, 24, generator=gen).half()
    dout = torch.randn(2, 9, heads, 24, generator=gen).half()
    grads = oracle.attention_bwd_ref(q, k, v, dout, causal=causal, softmax_scale=0.2)
    for got, want, like in zip(grads, closed_form_grads(q, k, v, dout, causal, 0.2), (q, k, v)):
        assert got.dtype == torch.float64 and got.shape == like.shape
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
