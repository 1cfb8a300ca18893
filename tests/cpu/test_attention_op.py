"""torch.ops.ws_lab.attention without a GPU: its fake gives (out, lse) shapes and dtypes, lse
carries no gradient, and the forward + backward trace (make_fx over fake tensors, as
torch.compile's AOT autograd does) holds one forward op and one backward op, each opaque."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ws_lab.kernels.bwd import attention_op  # noqa: F401  (registers the ops)


def _qkv(head_dim=64, dtype=torch.bfloat16):
    q = torch.randn(2, 50, 8, head_dim, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 50, 2, head_dim, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 50, 2, head_dim, dtype=dtype, requires_grad=True)
    return q, k, v


def test_forward_and_backward_trace_as_two_opaque_ops():
    def train_step(q, k, v):
        out, lse = torch.ops.ws_lab.attention(q, k, v, True, None)
        return (out, lse, *torch.autograd.grad(out.float().square().sum(), (q, k, v)))

    graph = make_fx(train_step, tracing_mode="fake")(*_qkv())
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert targets.count("ws_lab.attention.default") == 1
    assert targets.count("ws_lab.attention_bwd.default") == 1
    outputs = next(n for n in graph.graph.nodes if n.op == "output").args[0]
    shapes = [tuple(o.meta["val"].shape) for o in outputs]
    assert shapes == [(2, 50, 8, 64), (2, 8, 50), (2, 50, 8, 64), (2, 50, 2, 64), (2, 50, 2, 64)]
    assert outputs[1].meta["val"].dtype == torch.float32


def test_lse_is_not_differentiable():
    from torch._subclasses import FakeTensorMode

    with FakeTensorMode():
        out, lse = torch.ops.ws_lab.attention(*_qkv(), False, None)
    assert out.requires_grad and not lse.requires_grad


@pytest.mark.parametrize("head_dim,message", [(96, "unsupported head dim"), (256, "unsupported")])
def test_the_op_refuses_head_dims_the_backward_lacks(head_dim, message):
    from torch._subclasses import FakeTensorMode

    with FakeTensorMode(), pytest.raises(ValueError, match=message):
        torch.ops.ws_lab.attention(*_qkv(head_dim), False, None)


@pytest.mark.parametrize("head_dim", [96, 256])
def test_the_real_op_refuses_head_dims_the_backward_lacks_before_anything_else(head_dim):
    """The op itself (not its fake), on CPU tensors: a head dim the forward runs (256) or
    nobody runs (96), but the backward lacks, is refused as such, ahead of the forward's own
    validation (which would name the device first)."""
    with pytest.raises(ValueError, match=r"unsupported head dim \(D=%d, Dv=%d\) for the "
                                         r"trainable op" % (head_dim, head_dim)):
        torch.ops.ws_lab.attention(*(t.detach() for t in _qkv(head_dim)), False, None)


@pytest.mark.parametrize("mode", ["eager", "aot_eager"])
def test_the_ops_autograd_wiring_with_oracle_kernels(monkeypatch, mode):
    """The op's autograd (the forward's saved tensors, dout, the causal flag and the scale
    routed to the backward op; dq, dk, dv to q, k, v) with the two kernels replaced by the
    float64 oracle on the CPU: eagerly and through AOT autograd (torch.compile's path, no
    Inductor), the gradients equal the oracle's for this causal mask and scale, each op
    called once."""
    from ws_lab import oracle
    from ws_lab.kernels.bwd import attention_op as op

    calls = []

    def fwd_stub(q, k, v, causal, softmax_scale, return_lse, dynamic_batch):
        calls.append("fwd")
        out, lse = oracle.attention_ref(q, k, v, causal=causal, softmax_scale=softmax_scale)
        return out.to(q.dtype), lse.float()

    def bwd_stub(q, k, v, out, dout, lse, causal, softmax_scale, deterministic, dynamic_batch):
        calls.append("bwd")
        with torch.enable_grad():  # the oracle's own autograd, inside a backward
            grads = oracle.attention_bwd_ref(q, k, v, dout, causal=causal,
                                             softmax_scale=softmax_scale)
        return tuple(g.to(q.dtype) for g in grads)

    monkeypatch.setattr(op.fwd, "attention", fwd_stub)
    monkeypatch.setattr(op.bwd, "attention_bwd", bwd_stub)
    q, k, v = _qkv()
    dout = torch.randn(q.shape, dtype=q.dtype)

    def step(q, k, v):
        out, _ = torch.ops.ws_lab.attention(q, k, v, True, 0.2)
        return torch.autograd.grad(out, (q, k, v), dout)

    if mode == "eager":
        got = step(q, k, v)
    else:  # the training loop's shape: a compiled forward, then backward through its graph
        out = torch.compile(lambda q, k, v: torch.ops.ws_lab.attention(q, k, v, True, 0.2)[0],
                            backend="aot_eager", fullgraph=True)(q, k, v)
        got = torch.autograd.grad(out, (q, k, v), dout)
    want = oracle.attention_bwd_ref(q, k, v, dout, causal=True, softmax_scale=0.2)
    for name, g, w in zip("qkv", got, want):
        assert oracle.rel_l2(g, w) < 1e-2, name
    assert calls == ["fwd", "bwd"]
