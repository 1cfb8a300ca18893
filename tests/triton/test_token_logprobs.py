"""The chunked lm_head + log-softmax + gather (kernels/step/token_logprobs.py) on the GPU, against
the float64 oracle: log-probs, d-hidden and d-W at Qwen2.5-0.5B's lm_head (H 896, V 151936,
bf16, the default chunk) and on a ragged fp16 vocabulary, each no further from the oracle than
the torch path it replaces (bf16 logits, then ``log_softmax`` and ``gather``, the GRPO update's
``logprobs="torch"``) allows, within TORCH_SLACK of its error."""
import pytest
import torch

from ws_lab import oracle
from ws_lab.kernels.step.token_logprobs import DEFAULT_CHUNK, token_logprobs

pytestmark = pytest.mark.gpu

TORCH_SLACK = 1.5  # the lab's error may be at most this × the torch path's (both round to bf16)
# (N, H, V, chunk, dtype): Qwen2.5-0.5B's lm_head; a vocabulary the chunks do not divide
CASES = [(1024, 896, 151936, DEFAULT_CHUNK, torch.bfloat16), (300, 64, 1000, 256, torch.float16)]


def torch_logprobs(hidden, weight, targets):
    logits = (hidden @ weight.t()).float()
    return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]


def errors(fn, hidden, weight, targets, grad, ref, ref_leaves):
    leaves = [t.detach().requires_grad_() for t in (hidden, weight)]
    got = fn(*leaves, targets)
    got.backward(grad)
    return [oracle.rel_l2(got, ref)] + [oracle.rel_l2(a.grad, b.grad)
                                        for a, b in zip(leaves, ref_leaves)]


@pytest.mark.parametrize("n,h,v,chunk,dtype", CASES, ids=lambda x: str(x))
def test_logprobs_and_gradients_are_no_worse_than_the_torch_path(n, h, v, chunk, dtype):
    gen = torch.Generator(device="cuda").manual_seed(n + v)
    hidden = (torch.randn(n, h, device="cuda", generator=gen) * 0.5).to(dtype)
    weight = (torch.randn(v, h, device="cuda", generator=gen) / h ** 0.5).to(dtype)
    targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
    targets[0], targets[-1] = 0, v - 1  # the vocabulary's ends
    grad = torch.randn(n, device="cuda", generator=gen)
    ref_leaves = [t.detach().double().requires_grad_() for t in (hidden, weight)]
    ref = oracle.token_logprobs_ref(*ref_leaves, targets)
    ref.backward(grad.double())
    lab = errors(lambda a, b, t: token_logprobs(a, b, t, chunk=chunk), hidden, weight, targets,
                 grad, ref, ref_leaves)
    base = errors(torch_logprobs, hidden, weight, targets, grad, ref, ref_leaves)
    print(f"rel-L2 (log-probs, d-hidden, d-W): lab {lab}, torch {base}")
    assert all(e <= TORCH_SLACK * b for e, b in zip(lab, base)), (lab, base)
