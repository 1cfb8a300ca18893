"""The RL rollout around the fused decode kernel: a Qwen2 decode loop that owns the whole step
(one CUDA graph per step, positions and the finished state on the device, sampling on the
device) over a Hugging Face ``Qwen2ForCausalLM``'s weights, and the Dr. GRPO step around it.

  config.py   Qwen2.5-0.5B's architecture, in one place (random init: nothing is downloaded)
  weights.py  the HF model's GEMM weights packed back to back, its parameters views of them
  model.py    the lab's decode forward over the HF weights (fused or SDPA attention)
  sampling.py greedy / temperature / top-k / top-p on the device
  loop.py     the prefill, then the captured decode step, stopping checked every N steps
  task.py     the synthetic arithmetic task and its verifier (prompts generated, no dataset)
  grpo.py     Dr. GRPO: completion mask, log-probs, clipped loss, k3 KL, one optimizer step
  train_stack.py  the lab's training decoder over the HF weights (q|k|v as one GEMM)
  dp.py       the same step data-parallel (torch.distributed, DDP): each rank its share of groups
  anchors.py  the update's anchors: the scoring forward under torch.compile, Liger's Dr. GRPO loss

Needs ``transformers`` (``pip install -e ".[rollout]"``).
"""
