"""``torch.ops.ws_lab.attention``: BSHD GQA attention that trains. The forward is the pipelined
TileLang kernel (``kernels/fwd/pipelined.py``) with its lse output; the backward is
``pipelined.attention_bwd`` (this folder), as the opaque op ``ws_lab::attention_bwd`` so
``torch.compile`` traces both through their fakes. lse is returned for inspection and is not
differentiable. ``deterministic=True`` makes the backward bitwise repeatable
(``pipelined.attention_bwd``'s dQ kernel in place of its reduce-adds, which land in no
fixed order). Every kernel takes the batch at launch (``dynamic_batch``): a training loop's
micro-batches and its planner's probes share one compile (notes/bwd.md "Session 46").

Both ops are defined through ``torch.library.Library`` (a schema, one
``CompositeExplicitAutograd`` kernel, a fake, and the forward's ``register_autograd``), not
``torch.library.custom_op``, whose Python layers cost ≈ 35 µs more a call on the host, in
compiled graphs too (notes/rollout.md "Session 49")."""
import torch

from ws_lab.check import validate_attention_inputs
from ws_lab.kernels.bwd import pipelined as bwd
from ws_lab.kernels.fwd import pipelined as fwd


def _check(q, k, v, causal, softmax_scale):
    return validate_attention_inputs(q, k, v, supported_head_dims=bwd.HEAD_DIMS,
                                     softmax_scale=softmax_scale, causal=causal, devices="any")


def _require_backward_head_dims(q, v):
    """The one thing the forward op asks beyond ``fwd.attention``'s own validation (which
    runs before its launch): head dims the backward has. Not a second full validation: at
    ≈ 23 µs a call it was a fifth of the op's host time (notes/rollout.md "Session 49")."""
    if q.dim() == v.dim() == 4 and (q.shape[3], v.shape[3]) not in bwd.HEAD_DIMS:
        raise ValueError(f"unsupported head dim (D={q.shape[3]}, Dv={v.shape[3]}) for the "
                         f"trainable op; supported (D, Dv): {sorted(bwd.HEAD_DIMS)}")


_LIB = torch.library.Library("ws_lab", "FRAGMENT")  # kept: the ops live as long as it does
_LIB.define("attention(Tensor q, Tensor k, Tensor v, bool causal, float? softmax_scale, "
            "bool deterministic=False) -> (Tensor, Tensor)")
_LIB.define("attention_bwd(Tensor q, Tensor k, Tensor v, Tensor out, Tensor dout, Tensor lse, "
            "bool causal, float? softmax_scale, bool deterministic=False) "
            "-> (Tensor, Tensor, Tensor)")


def _forward_kernel(q, k, v, causal, softmax_scale, deterministic=False):
    """``ws_lab::attention``'s kernel: (out, lse) from ``fwd.attention``."""
    _require_backward_head_dims(q, v)
    return fwd.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True,
                         dynamic_batch=True)


def _backward_kernel(q, k, v, out, dout, lse, causal, softmax_scale, deterministic=False):
    """``ws_lab::attention_bwd``'s kernel: (dq, dk, dv) from ``bwd.attention_bwd``."""
    return bwd.attention_bwd(q, k, v, out, dout, lse, causal, softmax_scale,
                             deterministic=deterministic, dynamic_batch=True)


_LIB.impl("attention", _forward_kernel, "CompositeExplicitAutograd")
_LIB.impl("attention_bwd", _backward_kernel, "CompositeExplicitAutograd")


@torch.library.register_fake("ws_lab::attention", lib=_LIB)
def _(q, k, v, causal, softmax_scale, deterministic=False):
    dims = _check(q, k, v, causal, softmax_scale)
    return (q.new_empty(q.shape), q.new_empty((dims.batch, dims.heads, dims.seq_len),
                                              dtype=torch.float32))


@torch.library.register_fake("ws_lab::attention_bwd", lib=_LIB)
def _(q, k, v, out, dout, lse, causal, softmax_scale, deterministic=False):
    _check(q, k, v, causal, softmax_scale)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, deterministic = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.softmax_scale, ctx.deterministic = causal, softmax_scale, deterministic


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.ws_lab.attention_bwd(q, k, v, out, dout.contiguous(), lse, ctx.causal,
                                                ctx.softmax_scale, ctx.deterministic)
    return dq, dk, dv, None, None, None


torch.library.register_autograd("ws_lab::attention", _backward, setup_context=_setup_context,
                                lib=_LIB)
