"""The Triton MHA kernel on the GPU vs the float64 oracle (fp16 2e-3, bf16 1.2e-2 rel-L2), its
custom-op path, and the LLaMA block compiled with fullgraph=True running on the GPU."""
import itertools

import pytest

from ws_lab.testing import check_attention

pytestmark = pytest.mark.gpu

CASES = list(itertools.product(["float16", "bfloat16"], [False, True], [(64, 1), (128, 4)],
                               [128, 1000, 2048]))


@pytest.mark.parametrize("dtype,causal,dim_group,seq", CASES)
def test_mha_matches_oracle(dtype, causal, dim_group, seq):
    import torch

    from ws_lab.kernels.fwd import triton_mha

    head_dim, group = dim_group
    result = check_attention(triton_mha.attention, 2, seq, 4 * group, 4, head_dim, head_dim,
                             causal, getattr(torch, dtype))
    assert result.ok, str(result)


def test_custom_op_and_compiled_llama_block():
    import torch

    from tests.llama_block import LlamaAttention
    from ws_lab.kernels.fwd.triton_mha import triton_mha
    from ws_lab import oracle

    q, k, v = (torch.randn(1, 256, h, 64, device="cuda", dtype=torch.float16) for h in (8, 2, 2))
    ref, _ = oracle.attention_ref(q, k, v, causal=True)
    assert oracle.rel_l2(triton_mha(q, k, v, True, 0.125), ref) < 2e-3
    block = LlamaAttention(hidden=512, heads=8, kv_heads=2).cuda().half()
    x = torch.randn(2, 300, 512, device="cuda", dtype=torch.float16)
    with torch.no_grad():  # the op is forward-only (no autograd formula)
        eager = block(x)
        compiled = torch.compile(block, fullgraph=True)(x)
    assert torch.isfinite(compiled).all()
    torch.testing.assert_close(compiled, eager, atol=2e-3, rtol=2e-3)
