"""RoPE over a packed q|k|v projection, as the lab's training decoder runs it (issue #47): one
Triton pass splits (B, T, (Hq + 2·Hkv)·D) into q, k and v, each (B, H, T, D) contiguous (SDPA's
layout) or with ``bshd`` (B, T, H, D) contiguous (the lab's attention op's: no transposing copy
either way), with q and k rotated, and its backward writes the packed gradient in one pass.

Counterparts: HF's ``apply_rotary_pos_emb`` after three projections; Liger's ``LigerRopeFunction``
(q and k in place, no split). Left to Inductor, the backward's rotation, transposes and
concatenation into the packed gradient lowered to one pointwise kernel at 109 µs a layer (16 × 456
rows, D 64, H200) against the forward's 17 µs on the same bytes (notes/rollout.md "Session 45"), so
the pair is a ``triton_op``, ``torch.ops.ws_lab.rope_qkv``: Inductor sees the two kernels and
launches them from its own code. (As a plain custom op, each call went through the dispatcher and
Triton's Python launcher: the kernels were faster, the compiled step slower.)

HF's tables (T, D), rotate-half form, h = D / 2 (both passes compute in fp32, round once):
  forward   y[:h] = x[:h]·cos[:h] − x[h:]·sin[:h]      y[h:] = x[h:]·cos[h:] + x[:h]·sin[h:]
  backward  dx[:h] = g[:h]·cos[:h] + g[h:]·sin[h:]     dx[h:] = g[h:]·cos[h:] − g[:h]·sin[:h]

One program takes ``BLOCK_T`` rows (b·T + t) of one head; heads past Hq + Hkv are v's, copied.
Inputs are checked before any launch. On a CPU without Triton's interpreter the op runs the same
formulas in torch (the tests' fp32 / fp64 training decoder).
"""
import torch
import triton
import triton.language as tl

from ws_lab.check import require_tensors, triton_supports
from ws_lab.rope import apply_rope

BLOCK_T = 64  # rows a program: 64 × D / 2 elements a half
NUM_WARPS = 4  # Triton's default, which the launch keeps; named for the static report


@triton.jit
def _head_rows(Q, K, V, r, seq_len, head, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
               HEAD_DIM: tl.constexpr, BSHD: tl.constexpr):
    """The tensor ``head`` lives in (q, k or v) and the offsets of rows ``r`` (b·T + t) of it
    there: (B, H, T, D) or, with ``BSHD``, (B, T, H, D), both contiguous."""
    if head < HEADS:
        base, h, n = Q, head, HEADS
    elif head < HEADS + KV_HEADS:
        base, h, n = K, head - HEADS, KV_HEADS
    else:
        base, h, n = V, head - HEADS - KV_HEADS, KV_HEADS
    r = r.to(tl.int64)
    if BSHD:
        return base, (r * n + h) * HEAD_DIM
    return base, ((r // seq_len * n + h) * seq_len + r % seq_len) * HEAD_DIM


@triton.jit
def _tables(Cos, Sin, t, d, ok, HALF: tl.constexpr):
    """HF's cos and sin (T, D) at positions ``t`` and columns ``d`` of each half, in fp32."""
    tab = t[:, None] * 2 * HALF + d[None, :]
    c1 = tl.load(Cos + tab, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(Cos + tab + HALF, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(Sin + tab, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(Sin + tab + HALF, mask=ok, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def _rope_split_kernel(QKV, Cos, Sin, Q, K, V, rows, seq_len, stride_row,
                       HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK: tl.constexpr, BSHD: tl.constexpr):
    """Rows [pid·BLOCK, …) of head ``program_id(1)``: rotated (q, k) or copied (v)."""
    head = tl.program_id(1)
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, BLOCK_H)
    ok = (r < rows)[:, None] & (d < HALF)[None, :]
    src = QKV + r.to(tl.int64)[:, None] * stride_row + head * 2 * HALF + d[None, :]
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    if head < HEADS + KV_HEADS:
        c1, c2, s1, s2 = _tables(Cos, Sin, r % seq_len, d, ok, HALF)
        x1, x2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    base, offsets = _head_rows(Q, K, V, r, seq_len, head, HEADS, KV_HEADS, 2 * HALF, BSHD)
    dst = base + offsets[:, None] + d[None, :]
    tl.store(dst, x1.to(base.dtype.element_ty), mask=ok)
    tl.store(dst + HALF, x2.to(base.dtype.element_ty), mask=ok)


@triton.jit
def _rope_merge_kernel(DQ, DK, DV, Cos, Sin, DQKV, rows, seq_len, stride_row,
                       HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK: tl.constexpr, BSHD: tl.constexpr):
    """The transpose of ``_rope_split_kernel``: head ``program_id(1)``'s gradient rows into the
    packed gradient."""
    head = tl.program_id(1)
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, BLOCK_H)
    ok = (r < rows)[:, None] & (d < HALF)[None, :]
    base, offsets = _head_rows(DQ, DK, DV, r, seq_len, head, HEADS, KV_HEADS, 2 * HALF, BSHD)
    src = base + offsets[:, None] + d[None, :]
    g1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    g2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    if head < HEADS + KV_HEADS:
        c1, c2, s1, s2 = _tables(Cos, Sin, r % seq_len, d, ok, HALF)
        g1, g2 = g1 * c1 + g2 * s2, g2 * c2 - g1 * s1
    dst = DQKV + r.to(tl.int64)[:, None] * stride_row + head * 2 * HALF + d[None, :]
    tl.store(dst, g1.to(DQKV.dtype.element_ty), mask=ok)
    tl.store(dst + HALF, g2.to(DQKV.dtype.element_ty), mask=ok)


def validate(qkv, cos, sin, heads: int, kv_heads: int) -> int:
    """The head dim, after checking the op's inputs (before any launch)."""
    require_tensors("rope_qkv", qkv=qkv, cos=cos, sin=sin)
    if not (isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads >= 1
            and heads >= kv_heads and heads % kv_heads == 0):
        raise ValueError(f"rope_qkv: heads must be a positive multiple of kv_heads, got "
                         f"{heads!r} and {kv_heads!r}")
    if qkv.dim() != 3 or qkv.shape[2] % (heads + 2 * kv_heads):
        raise ValueError(f"rope_qkv: qkv must be (B, T, (heads + 2·kv_heads)·D), got "
                         f"{tuple(qkv.shape)} for {heads} / {kv_heads} heads")
    head_dim = qkv.shape[2] // (heads + 2 * kv_heads)
    if head_dim % 2:
        raise ValueError(f"rope_qkv: the head dim must be even, got {head_dim}")
    if cos.shape != (qkv.shape[1], head_dim) or sin.shape != cos.shape:
        raise ValueError(f"rope_qkv: cos and sin must be (T, D) = ({qkv.shape[1]}, {head_dim}), "
                         f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if qkv.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"rope_qkv: qkv must be fp16 / bf16 / fp32 / fp64, got {qkv.dtype}")
    if not (cos.is_floating_point() and sin.is_floating_point()):
        raise TypeError(f"rope_qkv: cos and sin must be floating, got {cos.dtype}, {sin.dtype}")
    if len({qkv.device, cos.device, sin.device}) != 1:
        raise ValueError("rope_qkv: qkv, cos and sin must be on one device")
    return head_dim


def _runs_triton(t: torch.Tensor) -> bool:
    return bool(triton_supports(t.device)) and t.dtype != torch.float64


def _meta(heads, kv_heads, head_dim, bshd) -> dict:
    """Both passes' constexprs (the launch's and ``static_specs``')."""
    half = head_dim // 2
    return dict(HEADS=heads, KV_HEADS=kv_heads, HALF=half, BLOCK_H=triton.next_power_of_2(half),
                BLOCK=BLOCK_T, BSHD=bshd)


def _launch(kernel, pointers, rows, seq_len, stride_row, heads, kv_heads, head_dim, bshd):
    """``kernel`` over every row and head; ``pointers`` in the kernel's order."""
    grid = (triton.cdiv(rows, BLOCK_T), heads + 2 * kv_heads)
    torch.library.wrap_triton(kernel)[grid](*pointers, rows, seq_len, stride_row,
                                            **_meta(heads, kv_heads, head_dim, bshd))


def static_specs(heads=14, kv_heads=2, head_dim=64, bshd=False, dtype="bfloat16"):
    """sm_90 specializations of the split and merge passes for the no-GPU static report
    (default: the Dr. GRPO update's Qwen2.5-0.5B layer), with the launch's constexprs."""
    from ws_lab.triton_static import StaticSpec

    elem = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}[dtype]
    meta = _meta(heads, kv_heads, head_dim, bshd)
    # both signatures open with their six tensors, then rows, seq_len, stride_row
    return [StaticSpec(name, kernel, dict({n: elem for n in kernel.arg_names[:6]}, rows="i32",
                                          seq_len="i32", stride_row="i32"),
                       meta, dict(num_warps=NUM_WARPS))
            for name, kernel in (("rope_split", _rope_split_kernel),
                                 ("rope_merge", _rope_merge_kernel))]


def _split_torch(qkv, cos, sin, heads, kv_heads, head_dim, bshd):
    batch, length, _ = qkv.shape
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (x.view(batch, length, n, head_dim).transpose(1, 2)
               for x, n in ((q, heads), (k, kv_heads), (v, kv_heads)))
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return tuple((x.transpose(1, 2) if bshd else x).contiguous() for x in (q, k, v))


@torch.library.triton_op("ws_lab::rope_qkv", mutates_args=())
def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
             kv_heads: int, bshd: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv (B, T, (heads + 2·kv_heads)·D), cos / sin (T, D) -> q (B, heads, T, D) and k
    (B, kv_heads, T, D) rotated, v (B, kv_heads, T, D), all contiguous; with ``bshd`` each
    (B, T, H, D) instead."""
    head_dim = validate(qkv, cos, sin, heads, kv_heads)
    if not _runs_triton(qkv):
        return _split_torch(qkv, cos, sin, heads, kv_heads, head_dim, bshd)
    batch, length, width = qkv.shape
    qkv = qkv.contiguous()
    q, k, v = (qkv.new_empty((batch, length, n, head_dim) if bshd else
                             (batch, n, length, head_dim)) for n in (heads, kv_heads, kv_heads))
    _launch(_rope_split_kernel, (qkv, cos.contiguous(), sin.contiguous(), q, k, v),
            batch * length, length, width, heads, kv_heads, head_dim, bshd)
    return q, k, v


@torch.library.triton_op("ws_lab::rope_qkv_backward", mutates_args=())
def rope_qkv_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, bshd: bool = False) -> torch.Tensor:
    """The packed gradient (B, T, (Hq + 2·Hkv)·D) of ``rope_qkv`` from dq, dk, dv, laid out as
    its outputs were (``bshd``)."""
    head_axis = 2 if bshd else 1
    batch, length, head_dim = dq.shape[0], dq.shape[3 - head_axis], dq.shape[3]
    heads, kv_heads = dq.shape[head_axis], dk.shape[head_axis]
    if not _runs_triton(dq):
        if bshd:
            dq, dk, dv = (g.transpose(1, 2) for g in (dq, dk, dv))
        return torch.cat([_unrope(dq, cos, sin), _unrope(dk, cos, sin), dv.transpose(1, 2)
                          .reshape(batch, length, -1)], dim=-1)
    width = (heads + 2 * kv_heads) * head_dim
    dqkv = dq.new_empty(batch, length, width)
    _launch(_rope_merge_kernel, (dq.contiguous(), dk.contiguous(), dv.contiguous(),
                                 cos.contiguous(), sin.contiguous(), dqkv),
            batch * length, length, width, heads, kv_heads, head_dim, bshd)
    return dqkv


def _unrope(g, cos, sin):
    """The transpose of ``apply_rope`` on (B, H, T, D), back to (B, T, H·D)."""
    half = g.shape[-1] // 2
    gs = g * sin
    rotated = torch.cat((gs[..., half:], -gs[..., :half]), dim=-1)
    return (g * cos + rotated).transpose(1, 2).reshape(g.shape[0], g.shape[2], -1)


def _setup_context(ctx, inputs, output):
    _, cos, sin, _, _, ctx.bshd = inputs
    ctx.save_for_backward(cos, sin)


def _backward(ctx, dq, dk, dv):
    cos, sin = ctx.saved_tensors
    return rope_qkv_backward(dq, dk, dv, cos, sin, ctx.bshd), None, None, None, None, None


rope_qkv.register_autograd(_backward, setup_context=_setup_context)
