"""A LLaMA-style attention block (QKV projection, RoPE, the Triton attention op, output
projection), the model that proves ``torch.ops.ws_lab.triton_mha`` compiles with
``torch.compile(fullgraph=True)``."""
import torch
from torch import nn

from ws_lab.kernels.fwd.triton_mha import triton_mha
from ws_lab.rope import apply_rope


class LlamaAttention(nn.Module):
    def __init__(self, hidden, heads, kv_heads, rope_base=10000.0):
        super().__init__()
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
        attn = triton_mha(q, k, v.contiguous(), True, self.head_dim ** -0.5)
        return self.out(attn.reshape(batch, seq, -1))
