"""A LLaMA-style attention block (QKV projection, RoPE, an attention op, output projection)
and a whole LLaMA block around it (RMSNorm, attention, RMSNorm, SwiGLU MLP, residuals): the
models that prove ``torch.ops.ws_lab.triton_mha`` (inference) and ``torch.ops.ws_lab.attention``
(training, through the TileLang backward) compile with ``torch.compile(fullgraph=True)``."""
import torch
from torch import nn

from ws_lab.kernels.fwd.triton_mha import triton_mha
from ws_lab.rope import apply_rope


def _trainable_attention(q, k, v, causal, scale):
    return torch.ops.ws_lab.attention(q, k, v, causal, scale)[0]


class LlamaAttention(nn.Module):
    """``trainable``: attend with ``torch.ops.ws_lab.attention`` (forward and backward kernels;
    D 64 / 128) instead of the forward-only Triton op."""

    def __init__(self, hidden, heads, kv_heads, rope_base=10000.0, trainable=False):
        super().__init__()
        if trainable:
            from ws_lab.kernels.bwd import attention_op  # noqa: F401  (registers the op)
        self.attend = _trainable_attention if trainable else triton_mha
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.out = nn.Linear(heads * self.head_dim, hidden, bias=False)
        inv_freq = rope_base ** (-torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).view(batch, seq, -1, self.head_dim).split(
            [self.heads, self.kv_heads, self.kv_heads], dim=2)
        angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), self.inv_freq)
        cos = torch.cat((angles.cos(), angles.cos()), dim=-1)[None, :, None, :].to(x.dtype)
        sin = torch.cat((angles.sin(), angles.sin()), dim=-1)[None, :, None, :].to(x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        attn = self.attend(q.contiguous(), k.contiguous(), v.contiguous(), True,
                           self.head_dim ** -0.5)
        return self.out(attn.reshape(batch, seq, -1))


class LlamaBlock(nn.Module):
    """x + attn(norm(x)), then h + mlp(norm(h)); the attention trainable (the lab's op)."""

    def __init__(self, hidden, heads, kv_heads, intermediate):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(hidden, eps=1e-6), nn.RMSNorm(hidden, eps=1e-6)
        self.attn = LlamaAttention(hidden, heads, kv_heads, trainable=True)
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        h = x + self.attn(self.attn_norm(x))
        gate, up = self.gate_up(self.mlp_norm(h)).chunk(2, dim=-1)
        return h + self.down(nn.functional.silu(gate) * up)
