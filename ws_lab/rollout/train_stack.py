"""The policy's training forward over a HF ``Qwen2ForCausalLM``'s own weights (issue #47): the
decoder stack as the Dr. GRPO update runs it under ``torch.compile`` (``grpo.compiled_stack``),
and the decode model's prefill (``DecodeModel(prefill="lab")``, its K / V kept for the caches).

Per layer: RMSNorm, **q|k|v as one GEMM** over the back-to-back weights that
``weights.shared_weights`` keeps (``torch.ops.ws_lab.qkv_projection``, with its backward as one dX
and one dW GEMM), RoPE, causal GQA attention (SDPA, or the lab's op when the model is set to
``hf_attention.NAME``), o, RMSNorm, SwiGLU, down. Everything but the projection is torch, for
Inductor to fuse. Packed, q|k|v's forward and backward took 219 µs a layer at 16 × 456 rows
against 436 µs as three GEMMs (H200); gate|up packed took 724 µs against 677, so gate and up stay
two GEMMs (notes/rollout.md "Session 44").
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ws_lab.rope import apply_rope
from ws_lab.rollout import hf_attention
from ws_lab.rollout.weights import qkv_biases, shared_weights


def _stacked(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` stacked along dim 0: a view when they lie back to back in one buffer (as
    ``shared_weights`` leaves them), else a copy."""
    first, size = parts[0], parts[0].element_size()
    at = first.data_ptr()
    for part in parts:
        if part.data_ptr() != at or not part.is_contiguous():
            return torch.cat(parts)
        at += part.numel() * size
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


@torch.library.custom_op("ws_lab::qkv_projection", mutates_args=())
def qkv_projection(x: torch.Tensor, weights: list[torch.Tensor],
                   biases: list[Optional[torch.Tensor]]) -> torch.Tensor:
    """x (..., K) through the stacked ``weights`` (each (N_i, K)) and ``biases``: (..., ΣN_i),
    one GEMM."""
    bias = None if any(b is None for b in biases) else _stacked(biases)
    return F.linear(x, _stacked(weights), bias)


@qkv_projection.register_fake
def _(x, weights, biases):
    return x.new_empty(*x.shape[:-1], sum(w.shape[0] for w in weights))


@torch.library.custom_op("ws_lab::qkv_projection_backward", mutates_args=())
def qkv_projection_backward(dy: torch.Tensor, x: torch.Tensor,
                            weights: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dW of the stacked weights): one GEMM each."""
    rows = dy.reshape(-1, dy.shape[-1])
    return dy @ _stacked(weights), rows.t() @ x.reshape(-1, x.shape[-1])


@qkv_projection_backward.register_fake
def _(dy, x, weights):
    return torch.empty_like(x), dy.new_empty(dy.shape[-1], x.shape[-1])


def _setup_context(ctx, inputs, output):
    x, weights, biases = inputs
    ctx.save_for_backward(x, *weights)
    ctx.has_bias = [b is not None for b in biases]


def _backward(ctx, dy):
    x, *weights = ctx.saved_tensors
    dx, dw = qkv_projection_backward(dy, x, weights)
    sizes = [w.shape[0] for w in weights]
    db = dy.reshape(-1, dy.shape[-1]).sum(0).split(sizes)
    return dx, list(dw.split(sizes)), [d if has else None for d, has in zip(db, ctx.has_bias)]


qkv_projection.register_autograd(_backward, setup_context=_setup_context)


class TrainingDecoder(torch.nn.Module):
    """A HF Qwen2 model's decoder stack (embedding to the final norm) on the lab's forward:
    ``forward(ids)`` (B, T) -> the last hidden states (B, T, hidden), causal, unpadded. The
    weights are the HF model's (its ``.model`` is this module's child, so optimizers and DDP
    see the same parameters); the first use packs q|k|v back to back (``shared_weights``)."""

    def __init__(self, hf_model):
        super().__init__()
        cfg = hf_model.config
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError("TrainingDecoder has no sliding window; the config asks for one")
        self.inner = hf_model.model
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.config = cfg
        shared_weights(hf_model)

    def forward(self, ids: torch.Tensor, keep_kv: bool = False):
        """The last hidden states; with ``keep_kv`` also each layer's rotated K and V, (B, Hkv,
        T, D) each, as a prefill fills a cache with them."""
        inner = self.inner
        hidden = inner.embed_tokens(ids)
        positions = torch.arange(ids.shape[1], device=ids.device)[None]
        cos, sin = inner.rotary_emb(hidden, positions)  # HF's own tables, (1, T, D)
        kv = []
        for layer in inner.layers:
            out = self._attention(layer, layer.input_layernorm(hidden), cos[:, None],
                                  sin[:, None], kv if keep_kv else None)
            hidden = hidden + out
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return (inner.norm(hidden), kv) if keep_kv else inner.norm(hidden)

    def _attention(self, layer, x, cos, sin, kv):
        att = layer.self_attn
        batch, length, _ = x.shape
        weights = [att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]
        qkv = qkv_projection(x, weights, list(qkv_biases(layer)))
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is not None:
            kv.append((k, v))
        if self.config._attn_implementation == hf_attention.NAME:
            out = hf_attention.lab_attention(q.transpose(1, 2).contiguous(),
                                             k.transpose(1, 2).contiguous(),
                                             v.transpose(1, 2).contiguous(), True, None)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                 enable_gqa=True).transpose(1, 2)
        return att.o_proj(out.reshape(batch, length, q_size))
