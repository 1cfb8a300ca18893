"""HF attention through the lab's op (ws_lab/rollout/hf_attention.py) on the CPU: with the op
stood in for by the float64 oracle (the op's kernels need CUDA; tests/ws/test_bwd.py holds
them to the same oracle), a small Qwen2 on ``attn_implementation="ws_lab"`` gives SDPA's
logits and gradients, every layer goes through the adapter, and what the op cannot compute is
refused before a launch."""
import copy

import pytest
import torch

pytest.importorskip("transformers")

from ws_lab import oracle  # noqa: E402
from ws_lab.rollout import config, grpo, hf_attention  # noqa: E402

# D 64 (the op's head dims are 64 and 128), GQA 4 / 2, like Qwen2.5-0.5B's attention
SHAPE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture
def oracle_op(monkeypatch):
    calls = []

    def stand_in(q, k, v, causal, softmax_scale):
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        calls.append((tuple(q.shape), tuple(k.shape), causal, softmax_scale))
        return oracle.attention_ref(q, k, v, causal, softmax_scale)[0].to(q.dtype)

    monkeypatch.setattr(hf_attention, "lab_attention", stand_in)
    return calls


def _pair():
    sdpa = config.random_model(config.qwen2_config(config.TINY, **SHAPE), torch.float32, "cpu")
    lab = copy.deepcopy(sdpa)
    lab.set_attn_implementation(hf_attention.register())
    return sdpa, lab


def test_the_lab_path_gives_sdpas_logits_and_gradients(oracle_op):
    sdpa, lab = _pair()
    ids = torch.randint(0, sdpa.config.vocab_size, (3, 37))
    outs = []
    for model in (sdpa, lab):
        model.train()
        logits = model(ids).logits
        (logits.float().square().mean()).backward()
        outs.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (want, want_grads), (got, got_grads) = outs
    assert oracle.rel_l2(got, want) < 1e-5
    for name, grad in want_grads.items():
        assert oracle.rel_l2(got_grads[name], grad) < 1e-4, name
    layers, heads, kv_heads = sdpa.config.num_hidden_layers, 4, 2
    assert oracle_op == [((3, 37, heads, 64), (3, 37, kv_heads, 64), True, 64 ** -0.5)] * layers


def test_grpo_log_probs_match_on_the_lab_path(oracle_op):
    sdpa, lab = _pair()
    prompts = torch.randint(0, sdpa.config.vocab_size, (4, 9))
    completions = torch.randint(0, sdpa.config.vocab_size, (4, 6))
    want = grpo.token_logprobs(sdpa, prompts, completions, micro_batch=2)
    got = grpo.token_logprobs(lab, prompts, completions, micro_batch=2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32 rounding of ~20


def test_the_lab_path_compiles_where_hf_materialises_the_causal_mask(oracle_op, monkeypatch):
    """Under torch.compile before torch 2.14 HF never skips SDPA's causal mask (emulated here:
    its skip test patched to say no); the lab's mask function still gives none to an unpadded
    batch, so the compiled stack reaches the op instead of refusing a mask."""
    from transformers import masking_utils

    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", lambda *a, **k: False)
    sdpa, lab = _pair()
    ids = torch.randint(0, sdpa.config.vocab_size, (2, 21))
    want = sdpa.model(ids).last_hidden_state
    got = torch.compile(lab.model)(ids).last_hidden_state
    assert oracle.rel_l2(got, want) < 1e-5
    assert len(oracle_op) == sdpa.config.num_hidden_layers


def test_what_the_op_cannot_compute_is_refused(oracle_op):
    _, lab = _pair()
    ids = torch.randint(0, lab.config.vocab_size, (2, 12))
    padded = torch.ones_like(ids)
    padded[0, :3] = 0
    with pytest.raises(ValueError, match="takes no attention mask: the batch must be unpadded"):
        lab(ids, attention_mask=padded)
    with pytest.raises(ValueError, match="no dropout"):
        hf_attention.attention_forward(lab.model.layers[0].self_attn.train(),
                                       *[torch.zeros(1, 2, 4, 64)] * 3, None, dropout=0.1)
    with pytest.raises(ValueError, match="4 queries against 9 keys"):
        hf_attention.attention_forward(lab.model.layers[0].self_attn, torch.zeros(1, 4, 4, 64),
                                       torch.zeros(1, 2, 9, 64), torch.zeros(1, 2, 9, 64), None)
    with pytest.raises(ValueError, match="no sliding_window"):
        hf_attention.attention_forward(lab.model.layers[0].self_attn,
                                       *[torch.zeros(1, 2, 4, 64)] * 3, None, sliding_window=16)
    assert oracle_op == []  # nothing refused reached the op
