"""The hand-written CUDA fused decode (kernels/decode/fused_decode_cuda.cu), through the static entry
that dispatches to it, on the GPU vs the float64 oracle (tolerances: ws_lab.decode_cases; the
rotated k within 1 ulp, v bitwise, every other slot untouched, slots at and past each position
NaN-poisoned so a read past the context turns the output NaN): fp16 / bf16, groups 7, 8 and 1,
capacities 456 and 512, positions 0, 1, capacity − 1 and ragged; q / k / v as views of one
q|k|v buffer, as the rollout passes them; a CUDA graph replayed over advancing positions."""
import itertools

import pytest
import torch

from ws_lab.decode_cases import check_decode, graph_replays, make_decode
from ws_lab.kernels.decode import fused_decode, fused_decode_cuda
from ws_lab.kernels.decode.triton_common import sm_count

pytestmark = pytest.mark.gpu

SHAPES = {"qwen-14/2": (64, 14, 2), "group8-16/2": (64, 16, 2), "mha-8/8": (16, 8, 8)}


def _positions(kind, batch, capacity):
    return {"zero": [0] * batch, "one": [1] * batch, "last": [capacity - 1] * batch,
            "ragged": [(97 * b + 13) % capacity for b in range(batch)],
            "advancing": [100 + 5 * b for b in range(batch)]}[kind]  # 24 steps stay < 456


def _goes_to_cuda(p):
    cuda = fused_decode_cuda.supports(p.q, p.k_new, p.v_new, p.k_cache, p.v_cache, p.cos, p.sin,
                                      p.q)
    capacity = p.k_cache.shape[2]
    return fused_decode.plan(p.q.shape[0], p.k_new.shape[1], p.q.shape[2], capacity,
                             sm_count(p.q.device), cuda=cuda).backend == "cuda"


def _problem(shape, capacity, positions, dtype):
    batch, hq, hkv = SHAPES[shape]
    p = make_decode(batch, hq, hkv, 64, capacity, _positions(positions, batch, capacity),
                    getattr(torch, dtype), "cuda")
    if not _goes_to_cuda(p):
        pytest.skip("outside the CUDA kernel's scope on this GPU (SM count or architecture)")
    return p


def _as_views_of_one_qkv_buffer(p, lead=0):
    """q, k_new and v_new copied into one (B, (Hq + 2·Hkv)·D) buffer, as the rollout's q|k|v
    GEMM writes them, each row starting ``lead`` elements in; p's tensors become its views."""
    batch, hq, d = p.q.shape
    hkv = p.k_new.shape[1]
    buf = torch.empty(batch, lead + (hq + 2 * hkv) * d, dtype=p.q.dtype, device="cuda")
    qkv = buf[:, lead:].view(batch, hq + 2 * hkv, d)
    qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:] = p.q, p.k_new, p.v_new
    p.q, p.k_new, p.v_new = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]


@pytest.mark.parametrize("dtype,shape,capacity,positions", itertools.product(
    ["float16", "bfloat16"], SHAPES, [456, 512], ["zero", "one", "last", "ragged"]))
def test_matches_oracle(dtype, shape, capacity, positions):
    p = _problem(shape, capacity, positions, dtype)
    result = check_decode(fused_decode.fused_decode_attention, p)
    assert result.ok, result


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_q_k_v_as_views_of_one_qkv_buffer_and_the_op_path(dtype):
    """The rollout slices q, k_new and v_new out of its q|k|v GEMM's output (batch stride
    (Hq + 2·Hkv)·D) and calls without ``out`` (torch.ops.ws_lab.fused_decode)."""
    p = _problem("qwen-14/2", 456, "ragged", dtype)
    _as_views_of_one_qkv_buffer(p)
    result = check_decode(lambda *a, out, softmax_scale: out.copy_(
        fused_decode.fused_decode_attention(*a, softmax_scale=softmax_scale)), p)
    assert result.ok, result


def test_rows_off_16_bytes_go_to_the_triton_kernel():
    """The prologue loads q, k_new and v_new in 16-byte pieces: a q|k|v buffer whose rows start
    8 bytes off (a 4-element lead) is not the CUDA kernel's, and the call is still right."""
    p = _problem("qwen-14/2", 456, "ragged", "bfloat16")
    _as_views_of_one_qkv_buffer(p, lead=4)
    assert not _goes_to_cuda(p)
    result = check_decode(fused_decode.fused_decode_attention, p)
    assert result.ok, result


def test_graph_replays_over_advancing_positions():
    """One capture at the rollout's shape; each replay decodes the next position of every
    sequence (ragged), inputs fresh, everything checked against the oracle's step."""
    p = _problem("qwen-14/2", 456, "advancing", "bfloat16")
    out = torch.empty_like(p.q)

    def step():
        fused_decode.fused_decode_attention(*p.args(), out=out)

    for position, result in graph_replays(p, step, out, 24):
        assert result.ok, (position, result)
