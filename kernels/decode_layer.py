"""The elementwise parts of a Llama / Qwen2 decoder layer at decode time, one Triton launch each
(plain torch would take 5–7 kernels per RMSNorm): the residual add fused into the RMSNorm that
follows it, and SwiGLU's silu(gate) · up. At batch 64 every one of them is a few µs of launch;
a 24-layer step has 48 norms and 24 SwiGLUs, so the launch count is the cost.

Counterparts: vLLM's ``fused_add_rms_norm`` and ``silu_and_mul``. Numerics follow HF's Qwen2:
the residual sum is rounded to the model dtype, normalized in fp32, cast back, then scaled by
the weight in the model dtype. On a CPU tensor each function is the same formula in torch (the
rollout's CPU tests), so callers need not branch.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _add_rmsnorm_kernel(X, Residual, Weight, Out, eps, n_cols, ADD: tl.constexpr,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(X + row * n_cols + cols, mask=ok, other=0.0)
    if ADD:
        x = (x + tl.load(Residual + row * n_cols + cols, mask=ok, other=0.0)).to(X.dtype.element_ty)
        tl.store(Residual + row * n_cols + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(X.dtype.element_ty)
    w = tl.load(Weight + cols, mask=ok, other=0.0)
    tl.store(Out + row * n_cols + cols, (w * normed).to(Out.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul_kernel(GateUp, Out, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    gate = tl.load(GateUp + row * 2 * n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(GateUp + row * 2 * n_cols + n_cols + cols, mask=ok, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    tl.store(Out + row * n_cols + cols, silu * up, mask=ok)


def add_rmsnorm(x, weight, eps, residual=None):
    """RMSNorm(x + residual) · weight over the last dim of a (rows, H) tensor; with
    ``residual`` the sum is also written back into it (it carries the stream on). Returns the
    normed rows."""
    if not x.is_cuda:
        if residual is not None:
            residual.add_(x)
            x = residual
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return weight * normed
    out = torch.empty_like(x)
    n_cols = x.shape[-1]
    _add_rmsnorm_kernel[(x.shape[0],)](x, residual if residual is not None else x, weight, out,
                                       eps, n_cols, ADD=residual is not None,
                                       BLOCK=triton.next_power_of_2(n_cols), num_warps=4)
    return out


SILU_BLOCK = 1024


def silu_mul(gate_up):
    """silu(gate) · up for a (rows, 2·I) tensor holding [gate | up] per row -> (rows, I)."""
    n_cols = gate_up.shape[-1] // 2
    if not gate_up.is_cuda:
        gate, up = gate_up[..., :n_cols], gate_up[..., n_cols:]
        return torch.nn.functional.silu(gate.float()).to(up.dtype) * up
    out = torch.empty(gate_up.shape[0], n_cols, dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_kernel[(gate_up.shape[0], triton.cdiv(n_cols, SILU_BLOCK))](
        gate_up, out, n_cols, BLOCK=SILU_BLOCK, num_warps=4)
    return out
