"""kernels/step/rope_qkv.py: the Triton split + RoPE and its backward under TRITON_INTERPRET=1
against autograd through the float64 reference (ragged row blocks, GQA groups, a half width
that is not a power of two, fp16 and fp32); the torch path a CPU training run takes, with
``opcheck``; and the input checks (before any launch)."""
import pytest
import torch

from tests.interpret import run_interpreted
from ws_lab.kernels.step import rope_qkv as rq

# (B, T, Hq, Hkv, D, dtype, bound): 70 rows are a ragged second 64-row block; D 12's half is 6
CASES = [(2, 37, 4, 2, 64, "float32", 1e-6), (3, 70, 6, 2, 16, "float16", 1e-3),
         (1, 5, 2, 2, 12, "float32", 1e-6), (2, 9, 7, 1, 8, "float32", 1e-6)]

SCRIPT = """
import json, sys, torch
from ws_lab import oracle
from ws_lab.kernels.step.rope_qkv import rope_qkv
results = []
for b, t, hq, hkv, d, dtype, _ in json.loads(sys.argv[1]):
    gen = torch.Generator().manual_seed(b * t * d)
    dt = getattr(torch, dtype)
    qkv = torch.randn(b, t, (hq + 2 * hkv) * d, generator=gen).to(dt)
    angles = torch.randn(t, d // 2, generator=gen) * 3
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(dt) for f in (torch.cos, torch.sin))
    grads = [torch.randn(b, n, t, d, generator=gen).to(dt) for n in (hq, hkv, hkv)]
    leaf = qkv.detach().requires_grad_()
    got = rope_qkv(leaf, cos, sin, hq, hkv)
    torch.autograd.backward(got, grads)
    ref_leaf = qkv.double().requires_grad_()
    heads = ref_leaf.view(b, t, hq + 2 * hkv, d).transpose(1, 2)
    want = (oracle.rope_ref(heads[:, :hq], cos, sin), oracle.rope_ref(heads[:, hq:hq + hkv], cos,
            sin), heads[:, hq + hkv:])
    torch.autograd.backward(want, [g.double() for g in grads])
    results.append([oracle.rel_l2(a, w) for a, w in zip(got, want)]
                   + [oracle.rel_l2(leaf.grad, ref_leaf.grad), all(a.is_contiguous() for a in got)])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def errors():
    return run_interpreted(SCRIPT, CASES)


@pytest.mark.parametrize("i", range(len(CASES)))
def test_the_triton_split_and_its_backward_match_the_float64_reference(errors, i):
    *_, bound = CASES[i]
    *errs, contiguous = errors[i]
    assert contiguous
    assert max(errs) <= bound, (CASES[i], errs)


def _inputs(b=2, t=5, hq=4, hkv=2, d=8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(b, t, (hq + 2 * hkv) * d, generator=gen, dtype=dtype)
    cos, sin = torch.randn(t, d, generator=gen), torch.randn(t, d, generator=gen)
    return qkv, cos.to(dtype), sin.to(dtype)


def test_the_torch_path_passes_opcheck():
    qkv, cos, sin = _inputs()
    torch.library.opcheck(rq.rope_qkv, (qkv.requires_grad_(), cos, sin, 4, 2))


@pytest.mark.parametrize("change, error, match", [
    (lambda a: (a[0][..., :-1], *a[1:]), ValueError, "heads"),
    (lambda a: (a[0][0], *a[1:]), ValueError, "B, T"),
    (lambda a: (a[0], a[1][:-1], a[2]), ValueError, "cos and sin must be"),
    (lambda a: (a[0], a[1], a[2].t()), ValueError, "cos and sin must be"),
    (lambda a: (a[0].to(torch.int32), *a[1:]), TypeError, "fp16"),
    (lambda a: (a[0], a[1].to(torch.int64), a[2]), TypeError, "floating"),
    (lambda a: (a[0], a[1].to("meta"), a[2]), ValueError, "one device"),
])
def test_bad_inputs_are_refused_before_any_launch(change, error, match):
    qkv, cos, sin = change(_inputs())
    with pytest.raises(error, match=match):
        rq.rope_qkv(qkv, cos, sin, 4, 2)


@pytest.mark.parametrize("heads, kv_heads", [(3, 2), (4, 0), (2, 4), (4.0, 2)])
def test_head_counts_must_form_gqa_groups(heads, kv_heads):
    qkv, cos, sin = _inputs()
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        rq.validate(qkv, cos, sin, heads, kv_heads)


def test_an_odd_head_dim_is_refused():
    qkv, cos, sin = _inputs(d=8)
    with pytest.raises(ValueError, match="even"):
        rq.validate(qkv[..., :(4 + 4) * 7], cos[:, :7], sin[:, :7], 4, 2)
