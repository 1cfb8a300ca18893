"""The Dr. GRPO update's anchor beside ``grpo.update`` (issue #47; its other anchors are
``grpo.update`` itself on plain HF, eager or ``compiled``), on the inputs ``grpo.update`` takes
and with its loss, clipping and optimizer step: TRL's Liger path (``liger_update``:
``LigerFusedLinearGRPOLoss(loss_type="dr_grpo")``, the lm_head, log-softmax and loss chunked
so the logits are never whole; the ``liger-kernel`` wheel, ``pip install -e ".[anchors]"``).
"""
from __future__ import annotations

import time

import torch

from ws_lab.rollout import grpo


def liger_update(policy, reference, optimizer, prompts, completions, rewards, group: int,
                 eos_id: int, *, clip_eps: float = 0.2, beta: float = 0.04,
                 max_grad_norm: float = 1.0, micro_batch: int = 8,
                 compiled: bool = True) -> grpo.StepReport:
    """One Dr. GRPO optimizer step as TRL's Liger path takes it: ``grpo.targets`` (the
    reference log-probs by ``grpo.token_logprobs``; one inner step, so no old ones: Liger
    takes the policy's own, detached, as TRL does), then per micro-batch the policy's hidden states through
    Liger's fused linear Dr. GRPO loss. Liger divides by responses × completion length, the lab
    by responses, so its loss is scaled by the length before the backward: the step, the
    reported loss and the gradient norm are ``grpo.update``'s. Ratio and KL are not reported
    (NaN): Liger's metrics are its clip fractions."""
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    sync = torch.cuda.synchronize if prompts.is_cuda else (lambda: None)
    t = grpo.targets(policy, reference, prompts, completions, rewards, group, eos_id,
                     micro_batch, old=False)
    start = time.perf_counter()
    batch, length = prompts.shape[0], completions.shape[1]
    loss_fn = LigerFusedLinearGRPOLoss(beta=beta, compiled=compiled, epsilon_low=clip_eps,
                                       epsilon_high=clip_eps, loss_type="dr_grpo",
                                       max_completion_length=length)
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for lo in range(0, batch, micro_batch):
        hi = min(lo + micro_batch, batch)
        ids = torch.cat([prompts[lo:hi], completions[lo:hi]], dim=1)
        hidden = policy.model(ids).last_hidden_state[:, prompts.shape[1] - 1:-1]
        value, _ = loss_fn(hidden, policy.lm_head.weight, completions[lo:hi], t.mask[lo:hi],
                           t.adv[lo:hi], ref_per_token_logps=t.logp_ref[lo:hi],
                           old_per_token_logps=None)
        (value * length * (hi - lo) / batch).backward()  # grpo.update's mean over responses
        total += value.item() * length * (hi - lo)
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), max_grad_norm)
    optimizer.step()
    sync()
    return grpo.StepReport(t.logprob_s, time.perf_counter() - start, total / batch, float("nan"),
                           float("nan"), float(grad_norm))
