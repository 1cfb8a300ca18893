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
