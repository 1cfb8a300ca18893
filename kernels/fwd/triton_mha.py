"""Flash-attention forward in Triton (MHA/GQA, BSHD through strides), as a torch custom op.

Counterpart: FlashAttention-2's forward (one program per (Q tile, batch·head), K/V streamed
with an online softmax). Causal programs stop at the diagonal (loop skip), only the blocks
that straddle it pay for the mask (``IS_CAUSAL`` constexpr), and the grid launches the longest
Q tiles first; configs are autotuned per
(S, D, IS_CAUSAL). ``torch.ops.ws_lab.triton_mha`` has a fake (meta) implementation, so a model
calling it compiles under ``torch.compile(fullgraph=True)`` without a graph break.
"""
import os

import torch
import triton
import triton.language as tl

from ws_lab.kernels import LOG2E
from ws_lab.check import Support, head_dims_supported, validate_attention_inputs

HEAD_DIMS = [(d, d) for d in (64, 128)]

# The interpreter (CPU tests) cannot benchmark: it gets one config, so autotuning is skipped.
# (BLOCK_M, BLOCK_N, stages, warps); the last three for short sequences (S 512, GPT-2), where
# 128-row tiles leave SMs idle.
_TUNED = [(128, 64, 3, 8), (128, 128, 3, 8), (128, 128, 2, 8), (128, 64, 4, 4), (64, 64, 4, 4),
          (128, 32, 4, 4), (64, 128, 3, 4), (64, 32, 4, 4), (32, 64, 4, 4), (64, 64, 3, 4)]
CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_stages=s, num_warps=w)
           for bm, bn, s, w in ([(64, 64, 4, 4)] if os.environ.get("TRITON_INTERPRET") == "1" else _TUNED)]


@triton.jit
def _attend(acc, l_i, m_i, q, K, V, stride_kn, stride_vn, offs_d, start, stop, offs_m, S,
            scale_log2, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    for start_n in range(start, stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if MASKED:
            k = tl.load(K + offs_n[:, None] * stride_kn + offs_d[None, :], mask=offs_n[:, None] < S,
                        other=0.0)
        else:
            k = tl.load(K + offs_n[:, None] * stride_kn + offs_d[None, :])
        s = tl.dot(q, tl.trans(k))
        if MASKED:
            keep = offs_n[None, :] < S
            if IS_CAUSAL:
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
            s = tl.where(keep, s, float("-inf"))
        # Scores stay unscaled: one FFMA per element scales and shifts them inside exp2.
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
        p = tl.exp2(s * scale_log2 - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if MASKED:
            v = tl.load(V + offs_n[:, None] * stride_vn + offs_d[None, :], mask=offs_n[:, None] < S,
                        other=0.0)
        else:
            v = tl.load(V + offs_n[:, None] * stride_vn + offs_d[None, :])
        # O accumulates inside the MMA (no second accumulator and add).
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=CONFIGS, key=["S", "D", "IS_CAUSAL"])
@triton.jit
def _mha_fwd_kernel(Q, K, V, Out, scale_log2, S, H, GROUP,
                    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                    stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
                    D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    if IS_CAUSAL:
        # Grid (B·H, Q tiles), Q tiles reversed: every head's longest tiles launch first and the
        # shortest fill the last wave (LPT order; the tail is what a causal grid loses).
        bh = tl.program_id(0)
        pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    else:
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    kvh = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                mask=offs_m[:, None] < S, other=0.0)
    K_bh = K + b * stride_kb + kvh * stride_kh
    V_bh = V + b * stride_vb + kvh * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if IS_CAUSAL:
        stop = tl.minimum((pid_m + 1) * BLOCK_M, S)
        unmasked_stop = (pid_m * BLOCK_M) // BLOCK_N * BLOCK_N  # blocks left of the diagonal
    else:
        stop = S
        unmasked_stop = S // BLOCK_N * BLOCK_N  # full blocks; the ragged tail is masked
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, K_bh, V_bh, stride_ks, stride_vs, offs_d, 0,
                            unmasked_stop, offs_m, S, scale_log2, False, IS_CAUSAL, BLOCK_N)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, K_bh, V_bh, stride_ks, stride_vs, offs_d,
                            unmasked_stop, stop, offs_m, S, scale_log2, True, IS_CAUSAL, BLOCK_N)
    out = acc / l_i[:, None]
    tl.store(Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=offs_m[:, None] < S)


def launch(q, k, v, out, causal, scale):
    batch, seq, heads, head_dim = q.shape
    if causal:
        grid = lambda meta: (batch * heads, triton.cdiv(seq, meta["BLOCK_M"]))  # noqa: E731
    else:
        grid = lambda meta: (triton.cdiv(seq, meta["BLOCK_M"]), batch * heads)  # noqa: E731
    _mha_fwd_kernel[grid](q, k, v, out, scale * LOG2E, seq, heads, heads // k.shape[2],
                          *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
                          D=head_dim, IS_CAUSAL=causal)
    return out


def _validated(q, k, v, causal, softmax_scale, out=None, devices="triton"):
    """The op's and the Python entry's one validation (``devices="any"`` in the fake, which
    sees meta/fake tensors): the same errors wherever the call is checked."""
    return validate_attention_inputs(q, k, v, supported_head_dims=HEAD_DIMS, out=out,
                                     softmax_scale=softmax_scale, causal=causal,
                                     contiguous=False, devices=devices)


@torch.library.custom_op("ws_lab::triton_mha", mutates_args=())
def triton_mha(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
               softmax_scale: float) -> torch.Tensor:
    """(B, S, Hq, D) attention; k, v (B, S, Hkv, D). Inputs need stride 1 in D only."""
    dims = _validated(q, k, v, causal, softmax_scale)
    return launch(q, k, v, torch.empty_like(q), causal, dims.softmax_scale)


@triton_mha.register_fake
def _(q, k, v, causal, softmax_scale):
    _validated(q, k, v, causal, softmax_scale, devices="any")
    return torch.empty_like(q)


def attention(q, k, v, causal=False, softmax_scale=None, out=None):
    """The lab's kernel API: BSHD q (B,S,Hq,D), k/v (B,S,Hkv,D) fp16/bf16 on CUDA; D 64/128.
    Strided views (e.g. slices of a fused QKV projection) are taken as they are."""
    dims = _validated(q, k, v, causal, softmax_scale, out)
    if out is None:
        return triton_mha(q, k, v, bool(causal), dims.softmax_scale)
    return launch(q, k, v, out, bool(causal), dims.softmax_scale)


def supports(shape) -> Support:
    return head_dims_supported(shape.head_dim, shape.head_dim_v, HEAD_DIMS)


def static_specs(shape):
    """The kernel's sm_90 specializations for a shape, for the no-GPU static report."""
    from ws_lab.triton_static import StaticSpec

    elem = "*bf16" if shape.dtype == "bfloat16" else "*fp16"
    types = {n: "i32" for n in _mha_fwd_kernel.fn.arg_names}
    types.update(Q=elem, K=elem, V=elem, Out=elem, scale_log2="fp32")
    return [StaticSpec(f"mha_fwd bm{c.kwargs['BLOCK_M']} bn{c.kwargs['BLOCK_N']}", _mha_fwd_kernel.fn,
                       types, dict(D=shape.head_dim, IS_CAUSAL=shape.causal, **c.kwargs),
                       dict(num_warps=c.num_warps, num_stages=c.num_stages)) for c in CONFIGS[:2]]
