"""Rotary position embedding in torch, the rotate-half convention of HF Llama / Qwen2
(``apply_rotary_pos_emb``): the one RoPE of the runtime (the rollout's SDPA path, the decode
bench's unfused step, the test models); the oracle runs the same function in float64, and the
fused kernels' in-register RoPE is checked against it."""
import torch


def rope_tables(length, head_dim, theta=1e6, dtype=torch.float16, device="cpu"):
    """HF Llama / Qwen2 cos and sin (length, head_dim) for ``rope_theta`` (Qwen2.5: 1e6)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


def apply_rope(x, cos, sin):
    """x·cos + rotate_half(x)·sin in x's dtype, rotate_half(x) = cat(−x[D/2:], x[:D/2]); x
    (..., D), cos / sin broadcast to it."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
