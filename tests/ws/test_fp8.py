"""The FP8 forward (kernels/fwd/fp8.py) on the GPU against the float64 oracle on the
dequantised inputs (the kernel's own error: P rounded to e4m3 for the PV GEMM, fp32
accumulation), over D 64 / 128, causal and full, query groups 1 / 4 / 8 and S 1 / 127 /
4096, random descales, the output NaN-poisoned before the run. The bound is a first guess
until the first GPU run (notes/fp8.md)."""
import itertools

import pytest

from ws_lab import oracle
from ws_lab.kernels.fwd import fp8

pytestmark = pytest.mark.hopper

BOUND = 5e-2
CASES = list(itertools.product((64, 128), (False, True), (1, 4, 8), (1, 127, 4096)))


@pytest.mark.parametrize("head_dim,causal,group,seq_len", CASES)
def test_fp8_forward_matches_the_oracle_on_dequantised_inputs(head_dim, causal, group,
                                                             seq_len):
    import torch

    batch, kv_heads = 2, 2
    q = torch.randn(batch, seq_len, kv_heads * group, head_dim, device="cuda").to(fp8.FP8)
    k, v = (torch.randn(batch, seq_len, kv_heads, head_dim, device="cuda").to(fp8.FP8)
            for _ in range(2))
    qd, kd, vd = (torch.rand(batch, kv_heads, device="cuda") * 1.5 + 0.5 for _ in range(3))
    out = torch.full(q.shape, float("nan"), dtype=fp8.OUT_DTYPE, device="cuda")
    got, lse = fp8.attention_fp8(q, k, v, causal, q_descale=qd, k_descale=kd, v_descale=vd,
                                 out=out, return_lse=True)
    ref, ref_lse = oracle.attention_ref(fp8.dequantise(q, qd), fp8.dequantise(k, kd),
                                        fp8.dequantise(v, vd), causal=causal)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(got).all()
    assert oracle.rel_l2(got, ref) < BOUND
    assert (lse.double() - ref_lse).abs().max().item() < 1e-3
