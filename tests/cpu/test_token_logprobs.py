"""kernels/step/token_logprobs.py under TRITON_INTERPRET=1 against the float64 oracle: the
log-probs and both gradients (hidden and the lm_head's weight), over ragged vocabulary chunks,
one chunk, targets at the vocabulary's ends, fp32 and fp16; and its input checks (no
interpreter needed: they come before any launch)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CASES)], env=env,
                          cwd=Path(__file__).resolve().parents[2], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


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
