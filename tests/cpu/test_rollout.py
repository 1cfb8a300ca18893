"""The rollout on the CPU (small random Qwen2 models, fp32, the SDPA path): greedy decoding
equals HF generate token for token, sampling keeps to its top-k / top-p sets, the loop stops on
EOS, the arithmetic verifier scores, and the seed's Dr. GRPO sanity checks."""
import copy

import pytest
import torch

pytest.importorskip("transformers")

from ws_lab.rollout import config, grpo  # noqa: E402
from ws_lab.rollout.loop import generate  # noqa: E402
from ws_lab.rollout.model import DecodeModel  # noqa: E402
from ws_lab.rollout.sampling import Sampling, sample  # noqa: E402
from ws_lab.rollout.task import EOS, ArithmeticTask  # noqa: E402

STEPS = 32


@pytest.fixture(scope="module")
def hf():
    return config.random_model(config.qwen2_config(config.TINY), torch.float32, "cpu")


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)])
def test_greedy_decoding_equals_hf_generate(heads, kv_heads):
    model = config.random_model(config.qwen2_config(config.TINY, num_attention_heads=heads,
                                                    num_key_value_heads=kv_heads),
                                torch.float32, "cpu", seed=heads + kv_heads)
    prompts = torch.randint(0, model.config.vocab_size, (3, 11))
    no_eos = model.config.vocab_size + 1
    lab = generate(DecodeModel(model, 3, 64, attention="sdpa"), prompts, STEPS,
                   Sampling(temperature=0), eos_id=no_eos)
    ref = model.generate(prompts, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                         eos_token_id=None, pad_token_id=0)[:, prompts.shape[1]:]
    assert torch.equal(lab.tokens, ref)
    assert len(set(ref.flatten().tolist())) > 5  # a model whose tokens vary, not one repeated id


def test_the_labs_prefill_fills_the_caches_and_logits_as_hfs_does():
    """``prefill="lab"`` (the training decoder under torch.compile) leaves the caches and the
    last logits of HF's prefill (fp32, rel-L2 1e-5), and greedy decoding after it equals HF
    generate."""
    model = config.random_model(config.qwen2_config(config.TINY), torch.float32, "cpu", seed=5)
    prompts = torch.randint(0, model.config.vocab_size, (3, 11),
                            generator=torch.Generator().manual_seed(5))
    ref, lab = (DecodeModel(model, 3, 64, attention="sdpa", prefill=p) for p in ("hf", "lab"))
    pairs = [(lab.prefill(prompts), ref.prefill(prompts)), (lab.k_cache, ref.k_cache),
             (lab.v_cache, ref.v_cache)]
    for got, want in pairs:  # rel-L2: Inductor's fused fp32 reductions round apart from eager's
        assert (got - want).norm() <= 1e-5 * want.norm()
    assert lab.k_cache[:, :, :, :11].abs().sum() > 0  # the prompt's K is there
    no_eos = model.config.vocab_size + 1
    tokens = generate(lab, prompts, 16, Sampling(temperature=0), eos_id=no_eos).tokens
    hf_tokens = model.generate(prompts, attention_mask=torch.ones_like(prompts),
                               max_new_tokens=16, min_new_tokens=16, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[:, 11:]
    assert torch.equal(tokens, hf_tokens)


def test_a_model_serves_requests_of_other_prompt_lengths_from_one_kept_state():
    """generate() keeps its state on the model per request shape: a second and third call,
    with shorter and longer prompts, reuse it and still equal HF generate token for token."""
    model = config.random_model(config.qwen2_config(config.TINY), torch.float32, "cpu", seed=3)
    lab = DecodeModel(model, 3, 64, attention="sdpa")
    no_eos = model.config.vocab_size + 1
    for length in (11, 5, 20):
        prompts = torch.randint(0, model.config.vocab_size, (3, length))
        got = generate(lab, prompts, 16, Sampling(temperature=0), eos_id=no_eos)
        # every token is attended: HF would take the prompts' 0s for padding (pad_token_id)
        ref = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=16,
                             min_new_tokens=16, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[:, length:]
        assert torch.equal(got.tokens, ref), length
    assert len(lab.decode_runs) == 1


def test_an_optimizer_step_on_the_hf_model_is_the_decode_models():
    """The decode model's GEMM weights are the HF model's own (``weights.shared_weights``): after
    a step of an optimizer made before the decode model was built, the same forced tokens give
    the logits of a decode model built on a copy of the new weights, with no refresh; the
    buffer keeps its address, and a second decode model on the same HF model reuses it."""
    model = config.random_model(config.qwen2_config(config.TINY), torch.float32, "cpu", seed=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    lab = DecodeModel(model, 2, 32, attention="sdpa")
    prompts = torch.randint(0, model.config.vocab_size, (2, 7))
    forced = torch.randint(0, model.config.vocab_size, (2, 8))

    def logits(decode_model):
        return generate(decode_model, prompts, 8, Sampling(temperature=0), eos_id=0,
                        forced=forced, keep_logits=True).logits

    before, address = logits(lab), lab.flat.data_ptr()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    after = logits(lab)
    torch.testing.assert_close(after, logits(DecodeModel(copy.deepcopy(model), 2, 32,
                                                         attention="sdpa")))
    assert not torch.allclose(before, after)
    assert lab.flat.data_ptr() == address
    assert DecodeModel(model, 2, 16, attention="sdpa").flat.data_ptr() == address


def test_sampling_keeps_to_top_k_and_top_p():
    logits = torch.randn(64, 50)
    assert torch.equal(sample(logits, Sampling(temperature=1.0, top_k=1)), logits.argmax(-1))
    assert torch.equal(sample(logits, Sampling(temperature=1.0, top_p=1e-6)), logits.argmax(-1))
    picks = sample(logits, Sampling(temperature=2.0, top_k=5))
    top5 = logits.topk(5).indices
    assert bool((picks[:, None] == top5).any(dim=1).all())
    draws = torch.stack([sample(logits, Sampling(temperature=1.0)) for _ in range(8)])
    assert (draws != draws[0]).any()  # it samples


def test_the_loop_stops_once_every_sequence_has_finished(hf):
    prompts = torch.randint(0, hf.config.vocab_size, (2, 5))
    forced = torch.full((2, 40), 7)
    forced[:, 3:] = EOS
    out = generate(DecodeModel(hf, 2, 64, attention="sdpa"), prompts, 40, Sampling(), EOS,
                   check_every=4, forced=forced)
    assert out.steps == 4  # the host looked at step 4, found every sequence finished
    assert out.tokens[:, :3].eq(7).all() and out.tokens[:, 3:].eq(EOS).all()


def test_arithmetic_verifier():
    task = ArithmeticTask(vocab_size=96, prompt_len=20, digits=2)
    prompts, operands = task.prompts(3)
    assert prompts.shape == (3, 20) and prompts[:, -1].eq(11).all()
    answers = [[int(c) for c in str(a + b)] for a, b in operands.tolist()]
    right = torch.tensor([answers[0] + [EOS] + [0] * (6 - len(answers[0])),
                          [9, 9, 9, 9, EOS, 0, 0], answers[2] + [4] * (7 - len(answers[2]))])
    assert task.rewards(operands, right).tolist() == [1.0, 0.0, 0.0]


def test_completion_mask_keeps_a_row_without_eos_whole():
    completions = torch.tensor([[5, 6, EOS, 7, EOS], [5, 6, 7, 8, 9], [EOS, 1, 2, 3, 4]])
    assert grpo.completion_mask(completions, EOS).tolist() == [
        [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


def test_logprob_at_t_equals_a_manual_forward(hf):
    prompts = torch.randint(0, hf.config.vocab_size, (2, 7))
    completions = torch.randint(0, hf.config.vocab_size, (2, 6))
    logp = grpo.token_logprobs(hf, prompts, completions, micro_batch=1)
    for t in range(completions.shape[1]):
        ids = torch.cat([prompts, completions[:, :t]], dim=1)
        manual = torch.log_softmax(hf(ids).logits[:, -1].float(), dim=-1)
        expect = manual.gather(-1, completions[:, t:t + 1])[:, 0]
        torch.testing.assert_close(logp[:, t], expect, rtol=1e-5, atol=1e-5)


def _update(hf, rewards, inner_steps=1, micro_batch=2, score_micro_batch=None):
    policy, reference = copy.deepcopy(hf), copy.deepcopy(hf)
    prompts = torch.randint(0, hf.config.vocab_size, (4, 6))
    completions = torch.randint(0, hf.config.vocab_size, (4, 5))
    completions[0, 2] = EOS
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    return grpo.update(policy, reference, optimizer, prompts, completions, torch.tensor(rewards),
                       group=2, eos_id=EOS, inner_steps=inner_steps, micro_batch=micro_batch,
                       score_micro_batch=score_micro_batch)


def test_one_inner_step_scores_no_old_logprobs(hf, monkeypatch):
    """With one inner step the old log-probs are the policy's own, detached (TRL at
    num_iterations == 1): the no-grad pass scores the reference alone, and the step equals
    the first step of a two-step update, which scores the old log-probs too."""
    scored = []
    real = grpo.token_logprobs

    def counting(model, *args, **kwargs):
        if not torch.is_grad_enabled():
            scored.append(model)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(grpo, "token_logprobs", counting)
    torch.manual_seed(0)
    one = _update(hf, [1.0, 0.0, 0.0, 1.0])
    assert len(scored) == 1 and one[0].ratio == 1.0
    torch.manual_seed(0)
    two = _update(hf, [1.0, 0.0, 0.0, 1.0], inner_steps=2)
    assert len(scored) == 3
    assert (one[0].loss, one[0].grad_norm) == (two[0].loss, two[0].grad_norm)


def test_the_reference_logprobs_slices_do_not_change_the_update(hf):
    """The reference's no-grad slices (score_micro_batch) apart from the update's: one
    sequence a slice and the whole batch give the same step (KL 0 at step 0: a row scored
    against another's reference would not be)."""
    reports = []
    for score_micro_batch in (1, 4):
        torch.manual_seed(0)
        reports.append(_update(hf, [1.0, 0.0, 0.0, 1.0], score_micro_batch=score_micro_batch)[0])
    for report in reports:
        assert report.kl == pytest.approx(0.0, abs=1e-6)
    assert reports[0].loss == pytest.approx(reports[1].loss, rel=1e-6, abs=1e-7)
    assert reports[0].grad_norm == pytest.approx(reports[1].grad_norm, rel=1e-6)


def test_the_micro_batch_is_the_largest_divisor_within_the_budget():
    assert grpo.micro_batch_for(64, per_sequence=1.0, fixed=10.0, budget=26.0) == 16
    assert grpo.micro_batch_for(64, per_sequence=1.0, fixed=10.0, budget=74.0) == 64
    assert grpo.micro_batch_for(12, per_sequence=1.0, fixed=0.0, budget=5.5) == 4
    assert grpo.micro_batch_for(8, per_sequence=1.0, fixed=9.0, budget=5.0) == 1  # none fits


def test_the_plan_steps_down_to_the_largest_divisor_whose_measured_peak_fits():
    """grpo.largest_fitting: from the modelled micro-batch down, divisors only, the first whose
    measured peak fits; 1 when none does."""
    tried = []

    def fits(m):
        tried.append(m)
        return m <= 4

    assert grpo.largest_fitting(64, 16, fits) == 4 and tried == [16, 8, 4]
    assert grpo.largest_fitting(12, 12, lambda m: False) == 1
    assert grpo.largest_fitting(12, 5, lambda m: True) == 4


def test_an_unplanned_update_on_the_cpu_takes_the_whole_batch(hf):
    """micro_batch None plans from CUDA memory; on a CPU it is one slice of the whole batch,
    so the step equals an explicit micro_batch of 4."""
    torch.manual_seed(0)
    planned = _update(hf, [1.0, 0.0, 0.0, 1.0], micro_batch=None)[0]
    torch.manual_seed(0)
    whole = _update(hf, [1.0, 0.0, 0.0, 1.0], micro_batch=4)[0]
    assert (planned.loss, planned.grad_norm) == (whole.loss, whole.grad_norm)
    cpu_rows = torch.zeros(4, 6, dtype=torch.long)
    assert grpo.plan_micro_batch(None, None, cpu_rows, cpu_rows, budget_bytes=0) == 4


def test_ratio_is_exactly_one_on_inner_step_zero(hf):
    reports = _update(hf, [1.0, 0.0, 0.0, 1.0], inner_steps=2)
    assert reports[0].ratio == 1.0
    assert reports[1].ratio != 1.0  # the first step moved the policy


def test_loss_is_zero_when_every_advantage_is_zero(hf):
    report = _update(hf, [1.0, 1.0, 0.0, 0.0])[0]  # each group's rewards equal: A = 0
    assert report.loss == 0.0 and report.kl == 0.0  # policy == reference at step 0: k3 = 0


def test_advantages_are_centred_per_group_without_std():
    adv = grpo.advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 1.0]), group=3)
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -1 / 3, -1 / 3, -4 / 3, 5 / 3, -1 / 3]))
