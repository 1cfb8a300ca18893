"""kernels/step/token_logprobs.py under TRITON_INTERPRET=1 against the float64 oracle: the
log-probs and both gradients (hidden and the lm_head's weight), over ragged vocabulary chunks,
one chunk, targets at the vocabulary's ends, fp32 and fp16; and its input checks (no
interpreter needed: they come before any launch)."""

import pytest
import torch

from tests.interpret import run_interpreted
from ws_lab.kernels.step import token_logprobs as tlp

# (N, H, V, chunk, dtype, bound): chunks of 256 over 1000 (the last 232), one chunk, fp16
CASES = [(37, 48, 1000, 256, "float32", 1e-5), (20, 32, 300, 4096, "float32", 1e-5),
         (24, 64, 700, 128, "float16", 3e-3)]

SCRIPT = """
import json, sys, torch
from ws_lab import oracle
from ws_lab.kernels.step.token_logprobs import token_logprobs
results = []
for n, h, v, chunk, dtype, _ in json.loads(sys.argv[1]):
    gen = torch.Generator().manual_seed(n * v)
    dt = getattr(torch, dtype)
    hidden = (torch.randn(n, h, generator=gen) * 0.5).to(dt)
    weight = torch.randn(v, h, generator=gen).to(dt)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[0], targets[-1] = 0, v - 1  # the vocabulary's ends
    grad = torch.randn(n, generator=gen)
    leaves = [t.detach().requires_grad_() for t in (hidden, weight)]
    got = token_logprobs(*leaves, targets, chunk=chunk)
    got.backward(grad)
    ref_leaves = [t.detach().double().requires_grad_() for t in (hidden, weight)]
    want = oracle.token_logprobs_ref(*ref_leaves, targets)
    want.backward(grad.double())
    results.append([oracle.rel_l2(got, want)] + [oracle.rel_l2(a.grad, b.grad)
                                                 for a, b in zip(leaves, ref_leaves)])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def errors():
    return run_interpreted(SCRIPT, CASES)


@pytest.mark.parametrize("index", range(len(CASES)), ids=lambda i: "-".join(map(str, CASES[i][:5])))
def test_logprobs_and_gradients_match_the_oracle(errors, index):
    bound = CASES[index][-1]
    logp, d_hidden, d_weight = errors[index]
    assert logp < bound and d_hidden < bound and d_weight < bound, errors[index]


@pytest.mark.parametrize("args,error,phrase", [
    ((torch.zeros(4, 8), torch.zeros(10, 6), torch.zeros(4, dtype=torch.long)), ValueError,
     "must share H"),
    ((torch.zeros(4, 8), torch.zeros(10, 8), torch.zeros(3, dtype=torch.long)), ValueError,
     "targets must be int32 / int64 of shape (4,)"),
    ((torch.zeros(4, 8), torch.zeros(10, 8), torch.zeros(4)), ValueError,
     "targets must be int32 / int64"),
    ((torch.zeros(4, 8), torch.zeros(10, 8).half(), torch.zeros(4, dtype=torch.long)),
     TypeError, "must share a dtype"),
    ((torch.zeros(4, 8), [0.0], torch.zeros(4, dtype=torch.long)), TypeError,
     "weight must be a torch.Tensor"),
    ((torch.zeros(4, 8), torch.zeros(10, 8), torch.zeros(4, dtype=torch.long)), ValueError,
     "inputs must be CUDA tensors"),
])
def test_bad_inputs_are_refused_before_any_launch(args, error, phrase):
    with pytest.raises(error, match=phrase.replace("(", r"\(").replace(")", r"\)")):
        tlp.token_logprobs(*args)


def test_a_bad_chunk_is_refused():
    with pytest.raises(ValueError, match="chunk must be a positive int"):
        tlp.token_logprobs(torch.zeros(4, 8), torch.zeros(10, 8),
                           torch.zeros(4, dtype=torch.long), chunk=0)


GRPO_SCRIPT = """
import copy, json, torch
from ws_lab.rollout import config, grpo
from ws_lab.rollout.task import EOS
hf = config.random_model(config.qwen2_config(config.TINY), torch.float32, "cpu")
prompts = torch.randint(0, hf.config.vocab_size, (4, 6), generator=torch.Generator().manual_seed(2))
completions = torch.randint(0, hf.config.vocab_size, (4, 5), generator=torch.Generator().manual_seed(3))
completions[0, 2] = EOS
steps = {}
for backend in ("torch", "lab"):
    policy, reference = copy.deepcopy(hf), copy.deepcopy(hf)
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    report = grpo.update(policy, reference, optimizer, prompts, completions,
                         torch.tensor([1.0, 0.0, 0.0, 2.0]), 2, EOS, inner_steps=2,
                         micro_batch=2, logprobs=backend)[-1]
    steps[backend] = ([p.detach() for p in policy.parameters()], report)
(p_torch, r_torch), (p_lab, r_lab) = steps["torch"], steps["lab"]
moved = max((a - b).abs().max().item() for a, b in zip(p_torch, hf.parameters()))
worst = max(((a - b).abs().max() / a.abs().max()).item() for a, b in zip(p_torch, p_lab))
print(json.dumps([moved, worst, r_torch.loss, r_lab.loss, r_torch.kl, r_lab.kl]))
"""


def test_the_grpo_update_on_the_chunked_log_probs_equals_the_torch_one():
    """grpo.update(logprobs="lab"): the old, reference and policy log-probs through the chunked
    kernel (interpreter, fp32, the tiny Qwen2), two inner SGD steps: the same parameters and
    report as the (B, C, V) logits path."""
    moved, worst, loss_torch, loss_lab, kl_torch, kl_lab = run_interpreted(GRPO_SCRIPT)
    assert moved > 1e-3  # the steps moved the weights: the comparison can fail
    assert worst < 1e-4, worst
    assert loss_lab == pytest.approx(loss_torch, rel=1e-4, abs=1e-6)
    assert kl_lab == pytest.approx(kl_torch, rel=1e-4, abs=1e-7)
