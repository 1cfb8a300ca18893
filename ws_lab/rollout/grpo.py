"""Dr. GRPO (Liu et al., "Understanding R1-Zero-Like Training"): GRPO without the two biases —
advantages are rewards minus the group mean (no division by the group's std), and a response's
loss is the sum over its tokens (no division by its length), averaged over responses.

Per token t of response i: ratio = exp(logp − logp_old); loss = −min(ratio · A_i,
clip(ratio, 1 − ε, 1 + ε) · A_i) + β · k3, with the k3 estimator of KL to a frozen reference,
k3 = exp(ref − logp) − (ref − logp) − 1. Tokens count up to and including a response's first
EOS; a response with no EOS keeps every token (the seed's fallback).
"""
from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass

import torch

from ws_lab import registry


def completion_mask(completions: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, C) 1.0 up to and including the first EOS; all ones where there is no EOS."""
    is_eos = completions == eos_id
    first = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1),
                        torch.full_like(is_eos[:, 0], completions.shape[1], dtype=torch.long))
    steps = torch.arange(completions.shape[1], device=completions.device)
    return (steps[None, :] <= first[:, None]).float()


LOGPROB_BACKENDS = ("torch", "lab")


def token_logprobs(model, prompts: torch.Tensor, completions: torch.Tensor,
                   micro_batch: int = 8, backend: str = "torch") -> torch.Tensor:
    """log p(completion token t | prompt, completion[:t]) (B, C): one forward over prompt +
    completion, the hidden states at positions P − 1 … P + C − 2 through the lm_head. Backend
    ``"torch"``: the (B, C, V) logits, log_softmax, gather; ``"lab"``: the lm_head, log-softmax
    and gather chunked over the vocabulary (kernels/step/token_logprobs.py: the logits are
    never whole; checked on the CPU, not yet measured on a GPU)."""
    if backend not in LOGPROB_BACKENDS:
        raise ValueError(f"backend must be one of {LOGPROB_BACKENDS}, got {backend!r}")
    length = prompts.shape[1]
    rows = []
    for start in range(0, prompts.shape[0], micro_batch):
        ids = torch.cat([prompts, completions], dim=1)[start:start + micro_batch]
        hidden = _hidden_states(model, ids)[:, length - 1:-1]
        target = completions[start:start + micro_batch]
        if backend == "lab":
            flat = registry.decode("token_logprobs").token_logprobs(
                hidden.reshape(-1, hidden.shape[-1]), model.lm_head.weight, target.reshape(-1))
            rows.append(flat.view(target.shape))
            continue
        logits = model.lm_head(hidden).float()
        rows.append(torch.log_softmax(logits, dim=-1).gather(-1, target[..., None])[..., 0])
    return torch.cat(rows)


def _hidden_states(model, ids: torch.Tensor) -> torch.Tensor:
    """The last hidden states (B, T, hidden) of a causal LM or a ``CompiledStack``."""
    if isinstance(model, CompiledStack):
        return model.hidden_states(ids)
    return model.model(ids).last_hidden_state


DECODERS = ("lab", "hf")


class CompiledStack(torch.nn.Module):
    """A causal LM as ``token_logprobs`` reads it (``.hidden_states``, ``.lm_head``), its
    decoder stack under ``torch.compile``: ``"lab"``, the lab's training forward
    (``train_stack.TrainingDecoder``: q|k|v as one GEMM), or ``"hf"``, HF's own (the anchor).
    The weights stay the model's (a module, so that DDP finds them). Made once per model and
    decoder by ``compiled_stack`` and kept, so every later update replays its graphs."""

    def __init__(self, model, decoder: str = "lab"):
        super().__init__()
        if decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {DECODERS}, got {decoder!r}")
        from ws_lab.rollout.train_stack import TrainingDecoder

        self.decoder = decoder
        # static shapes: the no-grad log-probs and the update's slices differ in batch, and a
        # second shape must not turn the first graph dynamic (notes/rollout.md "Session 41")
        self.model = torch.compile(TrainingDecoder(model) if decoder == "lab" else model.model,
                                   dynamic=False)
        self.lm_head = model.lm_head

    def hidden_states(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(ids)
        return out if self.decoder == "lab" else out.last_hidden_state


_STACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compiled_stack(model, decoder: str = "lab") -> CompiledStack:
    """The model's ``CompiledStack`` of ``decoder`` (Inductor fuses the norms, RoPE and SwiGLU:
    log-probs + update in 0.58 × plain HF's time on the H100, notes/rollout.md "Session 40")."""
    stacks = _STACKS.setdefault(model, {})
    if decoder not in stacks:
        stacks[decoder] = CompiledStack(model, decoder)
    return stacks[decoder]


class Scorer(torch.nn.Module):
    """``token_logprobs`` of a model as a module's forward, so that DDP can wrap the policy's
    scoring (its gradient all-reduce hooks run for a forward through the wrapper)."""

    def __init__(self, model, micro_batch: int = 8, backend: str = "torch"):
        super().__init__()
        self.model, self.micro_batch, self.backend = model, micro_batch, backend

    def forward(self, prompts: torch.Tensor, completions: torch.Tensor) -> torch.Tensor:
        return token_logprobs(self.model, prompts, completions, self.micro_batch, self.backend)


def advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """Rewards minus their group's mean (groups of ``group`` consecutive responses); no std."""
    grouped = rewards.view(-1, group)
    return (grouped - grouped.mean(dim=1, keepdim=True)).flatten()


def loss(logp, logp_old, logp_ref, adv, mask, clip_eps: float = 0.2, beta: float = 0.04):
    """The Dr. GRPO loss and its parts: (loss, mean ratio over masked tokens, mean k3 KL)."""
    ratio = torch.exp(logp - logp_old)
    surrogate = torch.minimum(ratio * adv[:, None],
                              torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv[:, None])
    log_ref_ratio = logp_ref - logp
    kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1
    per_token = (-surrogate + beta * kl) * mask
    total = per_token.sum(dim=1).mean()
    tokens = mask.sum().clamp_min(1)
    return total, (ratio * mask).sum() / tokens, (kl * mask).sum() / tokens


def micro_batch_for(batch: int, per_sequence: float, fixed: float, budget: float) -> int:
    """The largest micro-batch that divides ``batch`` (equal slices) and whose modelled peak,
    ``fixed + m · per_sequence`` bytes, stays within ``budget``; 1 when none does."""
    fits = [m for m in range(1, batch + 1)
            if batch % m == 0 and fixed + m * per_sequence <= budget]
    return max(fits, default=1)


def largest_fitting(batch: int, first: int, fits) -> int:
    """The largest divisor of ``batch`` not above ``first`` for which ``fits(m)``; 1 when none
    does (a slice of one sequence is the smallest there is)."""
    for m in range(first, 1, -1):
        if batch % m == 0 and fits(m):
            return m
    return 1


# sequences the two probes run (a line fixed + m · per_sequence through them): 2 and 4, where
# the activations, not the gradients' allocation, set the peak; 1 and 2 for smaller batches
PROBE_SIZES = (2, 4)


def _slice_peak(scorer, prompts, completions, m: int, grad: bool) -> tuple[int, int]:
    """(the allocator's peak, the bytes held after) while ``scorer`` runs a slice of ``m``
    sequences. With gradients: the second of two forward + backward passes, since every slice
    after an update's first runs with the gradients already held."""
    def run():
        if not grad:
            with torch.no_grad():
                scorer(prompts[:m], completions[:m])
            return
        no_sync = getattr(scorer, "no_sync", contextlib.nullcontext)  # DDP: no all-reduce
        with no_sync():
            scorer(prompts[:m], completions[:m]).sum().backward()

    if grad:
        run()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()


def _peak_line(peak_of, batch: int) -> tuple[float, float]:
    """(fixed bytes, bytes per sequence): ``peak_of(m)`` at the two probe sizes, as a line."""
    sizes = PROBE_SIZES if batch >= PROBE_SIZES[1] else (1, 2)
    peaks = [peak_of(m) for m in sizes]
    per_sequence = (peaks[1] - peaks[0]) / (sizes[1] - sizes[0])
    return peaks[0] - sizes[0] * per_sequence, per_sequence


def adamw(params, lr: float) -> torch.optim.AdamW:
    """The update's optimizer: AdamW, fused (one kernel over every parameter) where the
    parameters are on a GPU, else the default. The foreach step took 18 ms of the update's
    kernel time at 494 M parameters (notes/rollout.md "Session 44")."""
    params = list(params)
    return torch.optim.AdamW(params, lr=lr, fused=bool(params) and params[0].is_cuda)


def _adam_bytes(optimizer) -> tuple[int, int]:
    """(the moments an Adam step has still to allocate, its parameter-sized temporary); (0, 0)
    for another optimizer or none. A fused step works in place: no temporary."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 0, 0
    size = sum(p.numel() * p.element_size() for g in optimizer.param_groups for p in g["params"])
    temporary = 0 if optimizer.defaults.get("fused") else size  # foreach's sqrt(v) temporary
    return (0 if optimizer.state else 2) * size, temporary


def training_peak(scorer, prompts, completions, optimizer, m: int) -> float:
    """The measured peak of an update at ``m`` sequences a slice: a slice's forward and
    backward (gradients held) with the Adam moments still to come, or the optimizer step
    (what the slice leaves held, the moments and the step's temporary), whichever is higher.
    The gradients are cleared before and after."""
    moments, temporary = _adam_bytes(optimizer)
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    peak, held = _slice_peak(scorer, prompts, completions, m, grad=True)
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    return max(peak, held + temporary) + moments


def _peak_of(scorer, prompts, completions, optimizer, grad: bool):
    """m -> the measured peak of a slice of m sequences: ``training_peak`` (``grad``) or the
    log-probs without gradients (the old and reference log-probs)."""
    if grad:
        return lambda m: training_peak(scorer, prompts, completions, optimizer, m)
    return lambda m: _slice_peak(scorer, prompts, completions, m, grad=False)[0]


def training_peak_model(scorer, prompts, completions, optimizer) -> tuple[float, float]:
    """(fixed bytes, bytes per sequence) of ``training_peak``, a line through the probe sizes."""
    return _peak_line(_peak_of(scorer, prompts, completions, optimizer, True), prompts.shape[0])


def plan_micro_batch(scorer, optimizer, prompts, completions, budget_bytes: float,
                     grad: bool = True) -> int:
    """A micro-batch from memory: the largest divisor of the batch whose peak, modelled by a
    line through the probe sizes (``grad``: the update's forward and backward, else the
    log-probs without gradients; ``optimizer`` then unused), is within ``budget_bytes``, then
    run: while its measured peak passes the budget, the next smaller divisor. ``scorer`` is
    the module the update will run (a compiled stack has its own peak). The smallest over the
    ranks of a process group; on a CPU the whole batch."""
    batch = prompts.shape[0]
    if not prompts.is_cuda or batch == 1:
        return batch
    peak = _peak_of(scorer, prompts, completions, optimizer, grad)
    fixed, per_sequence = _peak_line(peak, batch)
    first = micro_batch_for(batch, per_sequence, fixed, budget_bytes)
    micro = torch.tensor([largest_fitting(batch, first, lambda m: peak(m) <= budget_bytes)])
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        micro = micro.to("cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(micro, op=dist.ReduceOp.MIN)
    return int(micro.item())


def plan_scoring_batch(policy, prompts, completions, logprobs: str,
                       budget_bytes: float | None) -> int:
    """The old and reference log-probs' slice: ``plan_micro_batch`` without gradients on the
    eager policy, within ``budget_bytes`` (None: 90 % of the GPU's)."""
    if budget_bytes is None and prompts.is_cuda:
        budget_bytes = 0.9 * torch.cuda.get_device_properties(prompts.device).total_memory
    return plan_micro_batch(Scorer(policy, prompts.shape[0], logprobs), None, prompts,
                            completions, budget_bytes, grad=False)


@dataclass(frozen=True)
class Targets:
    """What every optimizer step of an update scores against: the completion mask, the
    advantages, the old and reference log-probs, and the seconds those log-probs took."""
    mask: torch.Tensor
    adv: torch.Tensor
    logp_old: torch.Tensor | None  # None: the policy's own log-probs, detached (one step)
    logp_ref: torch.Tensor
    logprob_s: float


def targets(policy, reference, prompts, completions, rewards, group: int, eos_id: int,
            micro_batch: int, logprobs: str = "torch", old: bool = True) -> Targets:
    """The update's ``Targets``: old (``old``) and reference log-probs once, without
    gradients."""
    sync = torch.cuda.synchronize if prompts.is_cuda else (lambda: None)
    start = time.perf_counter()
    mask = completion_mask(completions, eos_id)
    adv = advantages(rewards.to(mask.device), group)
    with torch.no_grad():
        logp_old = (token_logprobs(policy, prompts, completions, micro_batch, logprobs)
                    if old else None)
        logp_ref = token_logprobs(reference, prompts, completions, micro_batch, logprobs)
    sync()
    return Targets(mask, adv, logp_old, logp_ref, time.perf_counter() - start)


@dataclass
class StepReport:
    logprob_s: float
    update_s: float
    loss: float
    ratio: float
    kl: float
    grad_norm: float


def update(policy, reference, optimizer, prompts, completions, rewards, group: int, eos_id: int,
           *, inner_steps: int = 1, clip_eps: float = 0.2, beta: float = 0.04,
           max_grad_norm: float = 1.0, micro_batch: int | None = None, scorer=None,
           logprobs: str = "torch", memory_budget: float | None = None,
           compiled: bool = False, decoder: str = "lab",
           score_micro_batch: int | None = None) -> list[StepReport]:
    """The Dr. GRPO update after a rollout: old and reference log-probs once, then
    ``inner_steps`` optimizer steps (gradient clipping each), micro-batched backward passes.
    ``micro_batch``: sequences a forward / backward pass takes; None plans it from memory
    (``plan_micro_batch`` on the scorer that runs, within ``memory_budget`` bytes, default 90 %
    of the GPU's; a caller that updates often plans once and passes it). ``scorer``: the
    module whose forward gives the policy's log-probs with gradients (default a ``Scorer`` of
    the policy, or of its ``compiled_stack`` when ``compiled``; data-parallel:
    ``ws_lab.rollout.dp.scorer``, a DDP wrapper, with this rank's share of whole groups).
    ``logprobs``: ``token_logprobs``'s backend for the old, reference and policy log-probs.
    ``compiled``: all three through the models' ``compiled_stack`` of ``decoder`` (``"lab"``,
    the lab's training forward, or ``"hf"``). ``score_micro_batch``: the
    slices of the old and reference log-probs, which keep no activations (None: planned from
    memory as ``micro_batch``, without gradients). Returns one report per inner step, its
    loss, ratio and KL (with a DDP ``scorer``: over every rank's responses). Inner step 0's
    ratio is exactly 1 with one inner step (no old log-probs are computed) and on a CPU; with
    more on a GPU, 1 within the rounding of the no-grad and grad slices (bf16, other batch
    sizes, compiled graphs)."""
    sync = torch.cuda.synchronize if prompts.is_cuda else (lambda: None)
    scoring, ref_scoring = ((compiled_stack(policy, decoder), compiled_stack(reference, decoder))
                            if compiled else (policy, reference))
    if micro_batch is None:
        probe = Scorer(scoring, prompts.shape[0], logprobs) if scorer is None else scorer
        if memory_budget is None and prompts.is_cuda:
            memory_budget = 0.9 * torch.cuda.get_device_properties(prompts.device).total_memory
        micro_batch = plan_micro_batch(probe, optimizer, prompts, completions, memory_budget)
    if score_micro_batch is None:  # on a CPU the update's slices: bitwise equal log-probs
        score_micro_batch = (plan_scoring_batch(policy, prompts, completions, logprobs,
                                                memory_budget) if prompts.is_cuda
                             else micro_batch)
    scorer = Scorer(scoring, micro_batch, logprobs) if scorer is None else scorer
    # one inner step: the old log-probs are the policy's own, detached (TRL's
    # num_iterations == 1), so no forward is spent on them and the ratio is exactly 1
    t = targets(scoring, ref_scoring, prompts, completions, rewards, group, eos_id,
                score_micro_batch, logprobs, old=inner_steps > 1)
    reports = []
    batch = prompts.shape[0]
    slices = [(lo, min(lo + micro_batch, batch)) for lo in range(0, batch, micro_batch)]
    # DDP's gradients are views of its buckets (dp.scorer): zeroed in place, not dropped, or
    # every step would allocate a second set
    keep_grads = isinstance(scorer, torch.nn.parallel.DistributedDataParallel)
    for _ in range(inner_steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=not keep_grads)
        # loss over responses, ratio, kl, slices: summed on the device (no sync a slice)
        sums = torch.zeros(4, dtype=torch.float64, device=prompts.device)
        for lo, hi in slices:
            # DDP all-reduces the gradients once, on the last slice's backward
            last = hi == batch
            with contextlib.nullcontext() if last or not hasattr(scorer, "no_sync") \
                    else scorer.no_sync():
                logp = scorer(prompts[lo:hi], completions[lo:hi])
                old = logp.detach() if t.logp_old is None else t.logp_old[lo:hi]
                value, ratio, kl = loss(logp, old, t.logp_ref[lo:hi],
                                        t.adv[lo:hi], t.mask[lo:hi], clip_eps, beta)
                (value * (hi - lo) / batch).backward()  # the mean over responses, across slices
            sums += torch.stack([value.detach() * (hi - lo), ratio.detach(), kl.detach(),
                                 torch.ones_like(kl)]).double()
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), max_grad_norm)
        optimizer.step()
        sync()
        if isinstance(scorer, torch.nn.parallel.DistributedDataParallel):
            sums = _over_ranks(sums)  # a single-process update beside a process group: its own
        loss_sum, ratio_sum, kl_sum, parts = sums.tolist()
        responses = batch * parts / len(slices)  # every rank holds the same share
        reports.append(StepReport(t.logprob_s, time.perf_counter() - start, loss_sum / responses,
                                  ratio_sum / parts, kl_sum / parts, float(grad_norm)))
    return reports


def _over_ranks(sums: torch.Tensor) -> torch.Tensor:
    """``sums`` added over the ranks of the default process group."""
    import torch.distributed as dist

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    total = sums.to(device)
    dist.all_reduce(total)
    return total.cpu()
