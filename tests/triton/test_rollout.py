"""The lab's decode loop on the GPU, Qwen2.5-0.5B's architecture (random weights, bf16): fed
the same 256 tokens (teacher forcing), the fused-kernel loop's logits match the SDPA loop's at
every step (rel-L2 ≤ LOGITS_TOLERANCE: bf16 through 24 layers, RoPE rounded in fp32 by the
kernel and in bf16 by torch), and the SDPA loop's match HF's own forward over the same tokens;
the L2 prefetches change no logit; top-k draws come from each step's k largest."""
from copy import deepcopy

import pytest
import torch

pytest.importorskip("transformers")

from tests.decoder_grads import errors_against_float64  # noqa: E402
from ws_lab import oracle  # noqa: E402
from ws_lab.rollout import config  # noqa: E402
from ws_lab.rollout.loop import generate  # noqa: E402
from ws_lab.rollout.model import PREFETCH, DecodeModel  # noqa: E402
from ws_lab.rollout.sampling import Sampling  # noqa: E402

pytestmark = pytest.mark.gpu

LOGITS_TOLERANCE = 3e-2
BATCH, PROMPT, NEW = 4, 200, 256


@pytest.fixture(scope="module")
def hf():
    return config.random_model(config.qwen2_config(), torch.bfloat16, "cuda")


@pytest.fixture(scope="module")
def runs(hf):
    vocab = hf.config.vocab_size
    prompts = torch.randint(0, vocab, (BATCH, PROMPT), device="cuda")
    forced = torch.randint(0, vocab, (BATCH, NEW), device="cuda")
    out = {}
    for attention in ("sdpa", "fused"):
        model = DecodeModel(hf, BATCH, PROMPT + NEW, attention)
        out[attention] = generate(model, prompts, NEW, Sampling(temperature=0), eos_id=vocab,
                                  forced=forced, keep_logits=True)
        del model
    with torch.no_grad():
        out["hf"] = hf(torch.cat([prompts, forced], dim=1)).logits[:, PROMPT - 1:-1].float()
    out["forced"] = forced
    return out


def test_fused_loop_logits_match_the_sdpa_loop_at_every_step(runs):
    errors = [oracle.rel_l2(runs["fused"].logits[:, t], runs["sdpa"].logits[:, t])
              for t in range(NEW)]
    assert max(errors) <= LOGITS_TOLERANCE, (max(errors), errors.index(max(errors)))
    assert torch.equal(runs["fused"].tokens, runs["forced"])


def test_sdpa_loop_logits_match_hf_forward(runs):
    errors = [oracle.rel_l2(runs["sdpa"].logits[:, t], runs["hf"][:, t]) for t in range(NEW)]
    assert max(errors) <= LOGITS_TOLERANCE, (max(errors), errors.index(max(errors)))


def test_l2_prefetches_change_no_logit(hf):
    """The side streams' L2 prefetches, of the weights and of the next layer's context (forked
    and joined inside the captured step), are hints: the same forced tokens give bitwise the
    same logits with each of them and without."""
    vocab = hf.config.vocab_size
    prompts = torch.randint(0, vocab, (BATCH, PROMPT), device="cuda")
    forced = torch.randint(0, vocab, (BATCH, 16), device="cuda")
    model = DecodeModel(hf, BATCH, PROMPT + 16, "fused")
    logits = []
    for span, context in ((PREFETCH, True), (None, True), (PREFETCH, False), (None, False)):
        model.set_prefetch(span)
        model.prefetch_context = context
        logits.append(generate(model, prompts, 16, Sampling(temperature=0), eos_id=vocab,
                               forced=forced, keep_logits=True).logits)
    assert all(torch.equal(logits[0], other) for other in logits[1:])


@pytest.mark.parametrize("capacity", [40, 9000])  # 9000 tokens: rows over one bulk prefetch
def test_context_prefetch_clamps_positions_to_the_cache(capacity):
    """Positions below 0 or past the capacity ask for nothing outside a row, and rows longer
    than one bulk prefetch go in pieces: the launch completes without a fault (the sync would
    raise it) and leaves the caches as they were."""
    from ws_lab.kernels.step import decode_layer

    k = torch.randn(3, 2, capacity, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    before = k.clone(), v.clone()
    positions = torch.tensor([-5, capacity // 2, capacity + 1000], device="cuda",
                             dtype=torch.int32)
    decode_layer.prefetch_context_l2(k, v, positions)
    torch.cuda.synchronize()
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])


def test_top_k_loop_draws_each_token_from_its_steps_k_largest(hf):
    """The loop's top-k path (the lm_head's chunk maxima handed to the sampler): every sampled
    token is among the k largest logits of the step that drew it."""
    vocab, k = hf.config.vocab_size, 50
    prompts = torch.randint(0, vocab, (BATCH, PROMPT), device="cuda")
    model = DecodeModel(hf, BATCH, PROMPT + 32, "fused")
    out = generate(model, prompts, 32, Sampling(temperature=1.0, top_k=k), eos_id=vocab,
                   keep_logits=True)
    kth = torch.topk(out.logits, k, dim=-1).values[..., -1]
    assert (out.logits.gather(-1, out.tokens[..., None])[..., 0] >= kth).all()


def test_later_requests_replay_the_captured_step(hf):
    """The first generate() captures the step; later ones of the same shape, with other prompt
    lengths, replay that capture and give the greedy tokens of a freshly built model; after
    the HF weights change, the same capture gives the logits of a model built on a copy of
    them (the decode model's weights are the HF model's own)."""
    vocab = hf.config.vocab_size
    model = DecodeModel(hf, BATCH, PROMPT + 32, "fused")
    greedy = Sampling(temperature=0)
    first = None
    for length in (PROMPT, 57, PROMPT - 1):
        prompts = torch.randint(0, vocab, (BATCH, length), device="cuda")
        got = generate(model, prompts, 32, greedy, eos_id=vocab).tokens
        replay = next(iter(model.decode_runs.values())).replay
        first = first or replay
        assert replay == first and len(model.decode_runs) == 1
        fresh = generate(DecodeModel(hf, BATCH, PROMPT + 32, "fused"), prompts, 32, greedy,
                         eos_id=vocab).tokens
        assert torch.equal(got, fresh), length
    copy = config.random_model(config.qwen2_config(), torch.bfloat16, "cuda", seed=1)
    model = DecodeModel(copy, BATCH, PROMPT + 16, "fused")
    prompts = torch.randint(0, vocab, (BATCH, PROMPT), device="cuda")
    forced = torch.randint(0, vocab, (BATCH, 16), device="cuda")

    def logits(decode_model):
        return generate(decode_model, prompts, 16, greedy, eos_id=vocab, forced=forced,
                        keep_logits=True).logits

    logits(model)
    with torch.no_grad():
        for p in copy.parameters():
            p.mul_(1.01)
    torch.testing.assert_close(logits(model), logits(DecodeModel(deepcopy(copy), BATCH,
                                                                 PROMPT + 16, "fused")))


def test_the_planned_micro_batch_keeps_the_update_within_its_budget(hf):
    """grpo.plan_micro_batch at a budget of 4.5 sequences past the probed fixed bytes picks 4
    of 16 (the largest divisor that fits; the line passes through the probe at 4, so its
    measured peak fits too), and the update it plans peaks within that budget: the probe's
    peak (a slice with the gradients held, the Adam moments, the step's temporary) is not
    optimistic."""
    import copy

    from ws_lab.rollout import grpo

    policy, reference = copy.deepcopy(hf).train(), copy.deepcopy(hf).eval()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    vocab = hf.config.vocab_size
    prompts = torch.randint(0, vocab, (16, PROMPT), device="cuda")
    completions = torch.randint(0, vocab, (16, 64), device="cuda")
    probe = grpo.Scorer(policy, 16)
    fixed, per_sequence = grpo.training_peak_model(probe, prompts, completions, optimizer)
    budget = fixed + 4.5 * per_sequence
    micro = grpo.plan_micro_batch(probe, optimizer, prompts, completions, budget)
    assert micro == 4 and all(p.grad is None for p in policy.parameters())
    torch.cuda.reset_peak_memory_stats()
    grpo.update(policy, reference, optimizer, prompts, completions, torch.rand(16), 8, vocab,
                micro_batch=micro)
    assert torch.cuda.max_memory_allocated() <= budget


def test_the_labs_prefill_matches_hfs(hf):
    """``prefill="lab"`` (the training decoder under torch.compile) fills the caches and gives
    the last logits of HF's prefill (rel-L2 ≤ LOGITS_TOLERANCE, bf16)."""
    prompts = torch.randint(0, hf.config.vocab_size, (BATCH, PROMPT), device="cuda")
    ref, lab = (DecodeModel(hf, BATCH, PROMPT + 16, "fused", prefill=p) for p in ("hf", "lab"))
    pairs = [(lab.prefill(prompts), ref.prefill(prompts)), (lab.k_cache, ref.k_cache),
             (lab.v_cache, ref.v_cache)]
    for name, (got, want) in zip(("logits", "k_cache", "v_cache"), pairs):
        assert oracle.rel_l2(got, want) <= LOGITS_TOLERANCE, name


def test_the_training_decoder_errs_as_hfs_decoder_does_in_bf16(hf):
    """Against HF's decoder in float64 (autograd through the reference), the lab's training
    decoder in bf16 errs no more than 1.5 × HF's own bf16 decoder, on the hidden states and
    every parameter's gradient (2 sequences of 128 tokens)."""
    from ws_lab.rollout.train_stack import TrainingDecoder

    model = deepcopy(hf).train()
    ids = torch.randint(0, hf.config.vocab_size, (2, 128), device="cuda")
    weight = torch.randn(2, 128, hf.config.hidden_size, device="cuda", dtype=torch.float64)
    for name, lab, own in errors_against_float64(TrainingDecoder(model), model, hf, ids, weight):
        assert lab <= 1.5 * own + 1e-4, name
