"""Qwen2.5-0.5B's architecture, the one place its numbers live, and a tiny config of the same
shape for tests. Models are built with random weights: nothing is downloaded."""

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                  rope_theta=1_000_000.0, tie_word_embeddings=True, rms_norm_eps=1e-6,
                  max_position_embeddings=32768)

# The same structure, small, for tests; a wider init (HF's default is 0.02) so that a random
# model's greedy tokens vary instead of repeating one id.
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=96, rope_theta=1_000_000.0,
            tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=512,
            initializer_range=0.3)


def qwen2_config(base=QWEN25_05B, **overrides):
    from transformers import Qwen2Config

    return Qwen2Config(**{**base, **overrides})


def random_model(config, dtype, device, seed=0):
    """A randomly initialised ``Qwen2ForCausalLM`` in eval mode with SDPA attention."""
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    config._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(config).to(device=device, dtype=dtype).eval()
