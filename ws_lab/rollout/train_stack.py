"""The policy's training forward over a HF ``Qwen2ForCausalLM``'s own weights (issue #47): the
decoder stack as the Dr. GRPO update runs it under ``torch.compile`` (``grpo.compiled_stack``),
and the decode model's prefill (``DecodeModel(prefill="lab")``, its K / V kept for the caches).

Per layer: RMSNorm, **q|k|v as one GEMM** over the three weights concatenated (its backward one
dX and one dW GEMM), the split and RoPE as one Triton pass each way (``torch.ops.ws_lab.rope_qkv``,
a ``triton_op``), causal GQA attention (SDPA, or the lab's op when the model is set to
``hf_attention.NAME``), o, RMSNorm, SwiGLU, down. The rest is torch, for Inductor to fuse.
Packed, q|k|v's forward and backward took 219 µs a layer at 16 × 456 rows against 436 µs as three
GEMMs (H200); gate|up packed took 724 µs against 677, so gate and up stay two GEMMs
(notes/rollout.md "Session 44"). No Python custom op sits in the compiled path: each cost ≈ 0.3 ms
a layer of host time (notes/rollout.md "Session 46").
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ws_lab import registry
from ws_lab.rollout import hf_attention
from ws_lab.rollout.weights import qkv_biases


class TrainingDecoder(torch.nn.Module):
    """A HF Qwen2 model's decoder stack (embedding to the final norm) on the lab's forward:
    ``forward(ids)`` (B, T) -> the last hidden states (B, T, hidden), causal, unpadded. The
    weights are the HF model's (its ``.model`` is this module's child, so optimizers and DDP
    see the same parameters)."""

    def __init__(self, hf_model):
        super().__init__()
        cfg = hf_model.config
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError("TrainingDecoder has no sliding window; the config asks for one")
        self.inner = hf_model.model
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.config = cfg
        registry.decode("rope_qkv")  # its import defines torch.ops.ws_lab.rope_qkv

    def forward(self, ids: torch.Tensor, keep_kv: bool = False):
        """The last hidden states; with ``keep_kv`` also each layer's rotated K and V, (B, Hkv,
        T, D) each (transposed views under the lab's attention), as a prefill fills a cache."""
        inner = self.inner
        hidden = inner.embed_tokens(ids)
        positions = torch.arange(ids.shape[1], device=ids.device)[None]
        cos, sin = inner.rotary_emb(hidden, positions)  # HF's own tables, (1, T, D)
        kv = []
        for layer in inner.layers:
            out = self._attention(layer, layer.input_layernorm(hidden), cos[0], sin[0],
                                  kv if keep_kv else None)
            hidden = hidden + out
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return (inner.norm(hidden), kv) if keep_kv else inner.norm(hidden)

    def _attention(self, layer, x, cos, sin, kv):
        att = layer.self_attn
        batch, length, _ = x.shape
        # One GEMM over the concatenated weights; Inductor fuses the 2 MB copy, and unlike a
        # custom op nothing in Python runs per call (notes/rollout.md "Session 46").
        weights = torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])
        biases = list(qkv_biases(layer))
        bias = None if any(b is None for b in biases) else torch.cat(biases)
        qkv = F.linear(x, weights, bias)
        # q, k, v straight in the layout their attention reads: (B, T, H, D) for the lab's op,
        # (B, H, T, D) for SDPA, so no transposing copy runs either way
        lab = self.config._attn_implementation == hf_attention.NAME
        q, k, v = torch.ops.ws_lab.rope_qkv(qkv, cos, sin, self.heads, self.kv_heads, lab)
        if kv is not None:
            kv.append((k.transpose(1, 2), v.transpose(1, 2)) if lab else (k, v))
        if lab:
            out = hf_attention.lab_attention(q, k, v, True, None)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                 enable_gqa=True).transpose(1, 2)
        return att.o_proj(out.reshape(batch, length, self.heads * self.head_dim))
