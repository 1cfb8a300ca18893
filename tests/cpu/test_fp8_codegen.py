"""The FP8 forward (kernels/fwd/fp8.py) lowers for sm_90a and compiles on a CPU as its
docstring says: both GEMMs on e4m3 wgmma (QGMMA) from shared memory (P through shared
memory, Vᵀ K-major), the producer / consumer register split, no spill; bad inputs are refused
before a launch."""
import shutil

import pytest
import torch

from ws_lab import emit, shapes
from ws_lab.kernels.fwd import fp8

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


@needs_nvcc
@pytest.mark.parametrize("head_dim,causal,seq_len", [(128, False, 4096), (64, True, 127)])
def test_fp8_forward_compiles_to_e4m3_wgmma_without_spills(tmp_path, head_dim, causal, seq_len):
    shape = shapes.Shape("fp8-codegen", 2, 8, 2, seq_len, head_dim, head_dim, causal,
                         "bfloat16")
    emitted = emit.lower_variant("fp8", shape, fp8.prim_func_for(shape), None)
    summary = emit.inspect(emitted, tmp_path)
    cfg = fp8.config_for(causal)
    # a warpgroup's 64 rows a GEMM; K = 32 e4m3 a wgmma: Q Kᵀ over D, P Vᵀᵀ over the block
    want = {f"64x{cfg.block_n}x32.F32.E4M3.E4M3": head_dim // 32}
    want[f"64x{head_dim}x32.F32.E4M3.E4M3"] = want.get(
        f"64x{head_dim}x32.F32.E4M3.E4M3", 0) + cfg.block_n // 32
    assert dict(summary.hgmma) == want, summary.format()
    assert sorted(set(summary.setmaxnreg)) == ["DEALLOC 24", "TRY_ALLOC 240"]
    assert summary.spill_bytes == 0 and summary.stack_frame == 0, summary.format()
    assert "mma_sync" not in emitted.source and "ldmatrix" not in emitted.source


def test_transpose_v_pads_the_keys_with_zeros():
    v = torch.randn(2, 5, 3, 64).to(fp8.FP8)
    vt = fp8.transpose_v(v, 4)
    assert vt.shape == (2, 3, 64, 8) and vt.dtype == fp8.FP8
    assert torch.equal(vt[..., :5].float(), v.permute(0, 2, 3, 1).float())
    assert not vt[..., 5:].float().any()


def test_fp8_forward_refuses_bad_inputs_before_a_launch():
    q = torch.zeros(1, 8, 4, 128, dtype=fp8.FP8)
    kv = torch.zeros(1, 8, 2, 128, dtype=fp8.FP8)
    with pytest.raises(TypeError, match="q has dtype torch.bfloat16"):
        fp8.attention_fp8(q.to(torch.bfloat16), kv, kv)
    with pytest.raises(ValueError, match=r"k_descale must be a float32 tensor of shape \(B, Hkv\)"):
        fp8.attention_fp8(q, kv, kv, k_descale=torch.ones(1, 4))
    with pytest.raises(ValueError, match="out must be a contiguous torch.bfloat16 tensor"):
        fp8.attention_fp8(q, kv, kv, out=torch.empty(1, 8, 4, 128))
    with pytest.raises(ValueError, match="unsupported head dim"):
        fp8.attention_fp8(q[..., :32], kv[..., :32], kv[..., :32])
    with pytest.raises(ValueError, match="inputs must be CUDA tensors"):
        fp8.attention_fp8(q, kv, kv)
