"""kernels/step/rope_qkv.py: the Triton split + RoPE and its backward under TRITON_INTERPRET=1
against autograd through the float64 reference (ragged row blocks, GQA groups, a half width
that is not a power of two, fp16 and fp32, both output layouts); both passes through Triton's
sm_90 compiler; the torch path a CPU training run takes, with ``opcheck``; and the input checks
(before any launch)."""
import pytest
import torch

from tests.interpret import run_interpreted
from ws_lab.kernels.step import rope_qkv as rq

# (B, T, Hq, Hkv, D, dtype, bshd, bound): 70 rows are a ragged second 64-row block; D 12's half
# is 6; bshd: the outputs (and their gradients) (B, T, H, D), as the lab's attention op takes them
CASES = [(2, 37, 4, 2, 64, "float32", False, 1e-6), (3, 70, 6, 2, 16, "float16", False, 1e-3),
         (1, 5, 2, 2, 12, "float32", False, 1e-6), (2, 9, 7, 1, 8, "float32", False, 1e-6),
         (3, 70, 6, 2, 16, "float16", True, 1e-3), (2, 9, 7, 1, 8, "float32", True, 1e-6)]

SCRIPT = """
import json, sys, torch
from ws_lab import oracle
from ws_lab.kernels.step.rope_qkv import rope_qkv
results = []
for b, t, hq, hkv, d, dtype, bshd, _ in json.loads(sys.argv[1]):
    gen = torch.Generator().manual_seed(b * t * d)
    dt = getattr(torch, dtype)
    qkv = torch.randn(b, t, (hq + 2 * hkv) * d, generator=gen).to(dt)
    angles = torch.randn(t, d // 2, generator=gen) * 3
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(dt) for f in (torch.cos, torch.sin))
    grads = [torch.randn(b, t, n, d, generator=gen).to(dt) for n in (hq, hkv, hkv)]
    if not bshd:
        grads = [g.transpose(1, 2).contiguous() for g in grads]
    leaf = qkv.detach().requires_grad_()
    got = rope_qkv(leaf, cos, sin, hq, hkv, bshd)
    torch.autograd.backward(got, grads)
    ref_leaf = qkv.double().requires_grad_()
    heads = ref_leaf.view(b, t, hq + 2 * hkv, d).transpose(1, 2)
    want = (oracle.rope_ref(heads[:, :hq], cos, sin), oracle.rope_ref(heads[:, hq:hq + hkv], cos,
            sin), heads[:, hq + hkv:])
    want = [w.transpose(1, 2) if bshd else w for w in want]
    torch.autograd.backward(want, [g.double() for g in grads])
    results.append([oracle.rel_l2(a, w) for a, w in zip(got, want)]
                   + [oracle.rel_l2(leaf.grad, ref_leaf.grad),
                      all(a.is_contiguous() and a.shape == w.shape for a, w in zip(got, want))])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def errors():
    return run_interpreted(SCRIPT, CASES)


@pytest.mark.parametrize("i", range(len(CASES)))
def test_the_triton_split_and_its_backward_match_the_float64_reference(errors, i):
    *_, bound = CASES[i]
    *errs, contiguous_as_asked = errors[i]
    assert contiguous_as_asked
    assert max(errs) <= bound, (CASES[i], errs)


def _inputs(b=2, t=5, hq=4, hkv=2, d=8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(b, t, (hq + 2 * hkv) * d, generator=gen, dtype=dtype)
    cos, sin = torch.randn(t, d, generator=gen), torch.randn(t, d, generator=gen)
    return qkv, cos.to(dtype), sin.to(dtype)


@pytest.mark.parametrize("bshd", [False, True])
def test_the_torch_path_passes_opcheck(bshd):
    qkv, cos, sin = _inputs()
    torch.library.opcheck(rq.rope_qkv, (qkv.requires_grad_(), cos, sin, 4, 2, bshd))


def test_the_torch_path_gives_one_answer_in_either_layout():
    qkv, cos, sin = _inputs()
    leaves = [qkv.clone().requires_grad_() for _ in range(2)]
    bhsd, bshd = rq.rope_qkv(leaves[0], cos, sin, 4, 2), rq.rope_qkv(leaves[1], cos, sin, 4, 2, True)
    for a, b in zip(bhsd, bshd):
        torch.testing.assert_close(a.transpose(1, 2), b, rtol=0, atol=0)
    grads = [torch.randn_like(a) for a in bhsd]
    torch.autograd.backward(bhsd, grads)
    torch.autograd.backward(bshd, [g.transpose(1, 2) for g in grads])
    torch.testing.assert_close(leaves[0].grad, leaves[1].grad, rtol=0, atol=0)


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


@pytest.mark.parametrize("bshd", [False, True])
def test_both_passes_compile_for_sm90_in_either_layout(bshd):
    """Triton's own compiler (not the interpreter) at the Dr. GRPO shape: no spill, no stack."""
    from ws_lab import triton_static

    for spec in rq.static_specs(bshd=bshd):
        text = triton_static.report(spec)
        assert "STL 0," in text and "stack 0 B" in text, text
