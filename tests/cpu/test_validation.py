"""Every bad input to a kernel entry point fails with a clear error before any launch."""
import pytest
import torch

from ws_lab.kernels.fwd import coop, largehdv, pipelined


def good(batch=1, seq=16, heads=4, kv_heads=2, d=64, dv=64, dtype=torch.float16):
    return (torch.randn(batch, seq, heads, d).to(dtype), torch.randn(batch, seq, kv_heads, d).to(dtype),
            torch.randn(batch, seq, kv_heads, dv).to(dtype))


def replaced(index, tensor):
    qkv = list(good())
    qkv[index] = tensor
    return qkv


q0, k0, v0 = good()
CASES = [
    ("q as list", ([[0.0]], k0, v0), {}, TypeError, "q must be a torch.Tensor"),
    ("fp32 q", replaced(0, q0.float()), {}, TypeError, "q has dtype torch.float32"),
    ("int k", replaced(1, k0.to(torch.int32)), {}, TypeError, "k has dtype"),
    ("fp64 everything", [t.double() for t in good()], {}, TypeError, "dtype torch.float64"),
    ("mixed fp16/bf16", replaced(2, v0.bfloat16()), {}, TypeError, "dtypes differ"),
    ("3-D q", replaced(0, q0[0]), {}, ValueError, "must be 4-D BSHD"),
    ("5-D v", replaced(2, v0[None]), {}, ValueError, "v must be 4-D"),
    ("batch mismatch", replaced(1, torch.cat([k0, k0])), {}, ValueError, "batch/seq mismatch"),
    ("seq mismatch", replaced(2, v0[:, :8]), {}, ValueError, "batch/seq mismatch"),
    ("k/v head count", replaced(2, v0[:, :, :1]), {}, ValueError, "k has 2 heads but v has 1"),
    ("q/k head dim", replaced(1, k0[..., :32]), {}, ValueError, "head_dim 64 != k head_dim 32"),
    ("partial group", good(heads=3, kv_heads=2), {}, ValueError, "not a multiple of Hkv"),
    ("head dim 96", good(d=96, dv=96), {}, ValueError, r"unsupported head dim \(D=96, Dv=96\)"),
    ("head dim 32", good(d=32, dv=32), {}, ValueError, "unsupported head dim"),
    ("Dv 128 with D 64", good(dv=128), {}, ValueError, r"D=64, Dv=128"),
    ("empty seq", good(seq=0), {}, ValueError, "empty input"),
    ("transposed q (BHSD view)", replaced(0, q0.transpose(1, 2).contiguous().transpose(1, 2)), {},
     ValueError, "q must be contiguous"),
    ("strided k", replaced(1, torch.randn(1, 32, 2, 64).half()[:, ::2]), {}, ValueError,
     "k must be contiguous"),
    ("out wrong shape", good(), {"out": torch.empty(1, 16, 4, 32).half()}, ValueError,
     "out must be a contiguous"),
    ("out wrong dtype", good(), {"out": torch.empty(1, 16, 4, 64).bfloat16()}, ValueError,
     "out must be a contiguous"),
    ("out not a tensor", good(), {"out": 3}, TypeError, "out must be a torch.Tensor"),
    ("scale zero", good(), {"softmax_scale": 0.0}, ValueError, "softmax_scale must be finite"),
    ("scale nan", good(), {"softmax_scale": float("nan")}, ValueError, "softmax_scale must be finite"),
    ("scale string", good(), {"softmax_scale": "0.1"}, TypeError, "softmax_scale must be a float"),
    ("cpu tensors", good(), {}, ValueError, "inputs must be CUDA tensors"),
]


@pytest.mark.parametrize("entry", [pipelined.attention, coop.attention], ids=["pipelined", "coop"])
@pytest.mark.parametrize("qkv,kwargs,exc,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_refused_before_launch(entry, qkv, kwargs, exc, message):
    with pytest.raises(exc, match=message):
        entry(*qkv, **kwargs)


def test_coop_refuses_dv_512():
    q, k, v = good(d=64, dv=512)
    with pytest.raises(ValueError, match=r"unsupported head dim \(D=64, Dv=512\)"):
        coop.attention(q, k, v)


lq, lk, lv = good(dv=512)
LARGEHDV_CASES = [
    ("D 64 Dv 64 (coop's shape)", good(), {}, ValueError, r"unsupported head dim \(D=64, Dv=64\)"),
    ("D 128 Dv 512", good(d=128, dv=512), {}, ValueError, r"unsupported head dim \(D=128, Dv=512\)"),
    ("fp32", [t.float() for t in good(dv=512)], {}, TypeError, "dtype torch.float32"),
    ("v seq mismatch", (lq, lk, lv[:, :8]), {}, ValueError, "batch/seq mismatch"),
    ("out Dv 256", (lq, lk, lv), {"out": torch.empty(1, 16, 4, 256).half()}, ValueError,
     "out must be a contiguous"),
    ("cpu tensors", (lq, lk, lv), {}, ValueError, "inputs must be CUDA tensors"),
]


@pytest.mark.parametrize("qkv,kwargs,exc,message", [c[1:] for c in LARGEHDV_CASES],
                         ids=[c[0] for c in LARGEHDV_CASES])
def test_largehdv_refuses_bad_input_before_launch(qkv, kwargs, exc, message):
    with pytest.raises(exc, match=message):
        largehdv.attention(*qkv, **kwargs)


def test_persistent_coop_refuses_head_dim_256():
    q, k, v = good(d=256, dv=256)
    with pytest.raises(ValueError, match=r"unsupported head dim \(D=256, Dv=256\)"):
        coop.attention(q, k, v, persistent=True)


def test_every_supports_answer_carries_its_reason():
    """One predicate, ``supports``, everywhere: a ``check.Support``, false with the reason."""
    from ws_lab import registry, shapes
    from ws_lab.check import Support

    answers = [registry.get(n).supports(s) for n in registry.KERNELS for s in shapes.SHAPES.values()]
    assert all(isinstance(a, Support) for a in answers)
    refusals = [a for a in answers if not a]
    assert refusals and all("(D, Dv)" in a.reason or a.reason.startswith("bwd-ws does not run")
                            for a in refusals)
