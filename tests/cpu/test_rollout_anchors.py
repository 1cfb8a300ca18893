"""The Dr. GRPO update's anchors (ws_lab/rollout/anchors.py) on the CPU, fp32, the tiny Qwen2
config: Liger's fused linear Dr. GRPO loss and the update with Inductor-compiled decoder stacks
(``grpo.update(compiled=True)``, the lab's training decoder or HF's) take the same optimizer
step as ``grpo.update`` on the same batch (SGD, so the step is the clipped gradient itself; a
perturbed reference, so the KL term has a gradient)."""
import copy

import pytest
import torch

pytest.importorskip("transformers")

from ws_lab.rollout import anchors, config, grpo  # noqa: E402
from ws_lab.rollout.task import EOS  # noqa: E402

GROUP, MICRO = 2, 2


def _problem():
    """(policy, reference, prompts, completions, rewards): a seed-0 tiny policy, a reference
    0.01 away from it, 8 responses in groups of 2 (one with an early EOS)."""
    policy = config.random_model(config.qwen2_config(config.TINY), torch.float32, "cpu")
    reference = copy.deepcopy(policy)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    vocab = config.TINY["vocab_size"]
    prompts = torch.randint(0, vocab, (8, 6), generator=gen)
    completions = torch.randint(0, vocab, (8, 5), generator=gen)
    completions[1, 2] = EOS
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 3.0])
    return policy, reference, prompts, completions, rewards


def _step(update):
    """``update(policy, reference, optimizer, prompts, completions, rewards)`` from a fresh
    problem: (its report, the parameters after the step)."""
    policy, reference, prompts, completions, rewards = _problem()
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    report = update(policy, reference, optimizer, prompts, completions, rewards)
    return report, [p.detach().clone() for p in policy.parameters()]


def _lab(policy, reference, optimizer, prompts, completions, rewards, scorer=None):
    return grpo.update(policy, reference, optimizer, prompts, completions, rewards, GROUP, EOS,
                       micro_batch=MICRO, scorer=scorer)[0]


def _assert_same_step(got, want, rel=1e-5):
    (report, params), (want_report, want_params) = got, want
    assert report.loss == pytest.approx(want_report.loss, rel=rel, abs=1e-7)
    assert report.grad_norm == pytest.approx(want_report.grad_norm, rel=rel)
    for p, q in zip(params, want_params):
        torch.testing.assert_close(p, q, rtol=rel, atol=rel / 10)


def test_the_liger_anchor_takes_grpo_updates_step():
    pytest.importorskip("liger_kernel")
    want = _step(_lab)
    assert want[0].loss != 0.0 and want[0].kl > 0.0  # the batch exercises both terms
    got = _step(lambda *a: anchors.liger_update(*a, GROUP, EOS, micro_batch=MICRO,
                                                compiled=False))
    _assert_same_step(got, want)


@pytest.mark.parametrize("decoder", grpo.DECODERS)
def test_the_compiled_stack_takes_grpo_updates_step(decoder):
    want = _step(_lab)
    got = _step(lambda *a: grpo.update(*a, GROUP, EOS, micro_batch=MICRO, compiled=True,
                                       decoder=decoder)[0])
    # Inductor's fused fp32 reductions round apart from eager's
    _assert_same_step(got, want, rel=1e-4)


def test_a_compiled_update_compiles_once_then_replays():
    from torch._dynamo.utils import counters

    policy, reference, prompts, completions, rewards = _problem()
    optimizer = torch.optim.SGD(policy.parameters(), lr=1e-3)

    def update():
        grpo.update(policy, reference, optimizer, prompts, completions, rewards, GROUP, EOS,
                    micro_batch=MICRO, compiled=True)
        return counters["stats"]["unique_graphs"]

    first = update()
    assert grpo.compiled_stack(policy) is grpo.compiled_stack(policy)
    assert update() == first  # the second update made no graph
