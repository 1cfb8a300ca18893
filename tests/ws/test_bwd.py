"""The pipelined backward (kernels/bwd/pipelined.py) on the GPU against autograd through the
float64 oracle: dQ, dK and dV each within a rel-L2 bound, over D 64 / 128, causal and full,
fp16 and bf16, query groups 1 / 4 / 7 / 8 and S 1 / 127 / 456 / 4096, with dK and dV
NaN-poisoned before the run. The forward's out and lse come from the oracle (the lab's forward
kernels do not return lse yet)."""
import itertools

import pytest

from ws_lab import oracle
from ws_lab.kernels.bwd import pipelined

pytestmark = pytest.mark.hopper

TOLERANCE = {"float16": 5e-3, "bfloat16": 2e-2}
SEQS = itertools.cycle([1, 127, 456, 4096])
GROUPS = itertools.cycle([1, 4, 7, 8])
CASES = [(d, causal, dtype, next(GROUPS), next(SEQS))
         for d, causal, dtype in itertools.product((64, 128), (False, True),
                                                   ("float16", "bfloat16"))
         for _ in range(2)]


@pytest.mark.parametrize("head_dim,causal,dtype,group,seq_len", CASES)
def test_backward_matches_the_oracle(head_dim, causal, dtype, group, seq_len):
    import torch

    dt = getattr(torch, dtype)
    batch, kv_heads = (1, 2) if seq_len == 4096 else (2, 2)
    q = torch.randn(batch, seq_len, kv_heads * group, head_dim, device="cuda", dtype=dt)
    k, v = (torch.randn(batch, seq_len, kv_heads, head_dim, device="cuda", dtype=dt)
            for _ in range(2))
    dout = torch.randn_like(q)
    out, lse = oracle.attention_ref(q, k, v, causal=causal)
    dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    dq, dk, dv = pipelined.attention_bwd(q, k, v, out.to(dt), dout, lse.float(), causal,
                                         dk=dk, dv=dv)
    want = oracle.attention_bwd_ref(q, k, v, dout, causal=causal)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert oracle.rel_l2(got, ref) < TOLERANCE[dtype], name
