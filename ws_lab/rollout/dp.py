"""Data-parallel Dr. GRPO on PyTorch's own distributed engine (issue #47): each rank holds the
whole policy, generates and scores its share of the prompts' groups, and DDP all-reduces the
gradients (NCCL on GPUs, gloo on CPUs) once per optimizer step. A group never straddles two
ranks, so its advantages are those of the single-process step; every rank holds the same
number of responses, so DDP's mean of the ranks' mean losses is the mean over all responses.
The CPU test (tests/cpu/test_rollout_dp.py) runs two gloo ranks against one process on the
union batch; ``torchrun --nproc-per-node N bench/rollout.py --grpo`` times the step on N GPUs.
"""
from __future__ import annotations

import os

import torch

from ws_lab.rollout.grpo import Scorer


def launched() -> bool:
    """Whether this process was started by torchrun (or another launcher that sets RANK)."""
    return "RANK" in os.environ


def init(backend: str | None = None) -> tuple[int, int]:
    """(rank, world size) of a process started by torchrun (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR / MASTER_PORT in the environment); NCCL where CUDA is present, else gloo.
    With CUDA, each process takes the GPU of its local rank."""
    import torch.distributed as dist

    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if name not in os.environ]
    if missing:
        raise RuntimeError(f"not started by torchrun: {', '.join(missing)} unset "
                           "(torchrun --nproc-per-node N ...)")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend or ("nccl" if torch.cuda.is_available() else "gloo"))
    return dist.get_rank(), dist.get_world_size()


def share(responses: int, group: int, rank: int, world: int) -> slice:
    """This rank's contiguous share of ``responses`` (groups of ``group`` consecutive ones):
    whole groups, the same number on every rank."""
    if responses % group:
        raise ValueError(f"{responses} responses are not whole groups of {group}")
    groups = responses // group
    if groups % world:
        raise ValueError(f"{groups} groups of {group} do not split evenly over {world} ranks: "
                         "give a group count that the world size divides")
    per_rank = groups // world * group
    return slice(rank * per_rank, (rank + 1) * per_rank)


def scorer(policy, micro_batch: int = 8, logprobs: str = "torch") -> torch.nn.Module:
    """The policy's scoring wrapped in DDP (for ``grpo.update(..., scorer=)``): its backward
    all-reduces the gradients over the default process group. ``policy``: the model or its
    ``grpo.compiled_stack``."""
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [torch.cuda.current_device()] if next(policy.parameters()).is_cuda else None
    # The gradients are views of DDP's buckets from the start (DDP re-points gradients that
    # exist when it is built), and grpo.update zeroes rather than drops them: no second
    # gradient-sized copy (0.9 GiB of the two-GPU peak, notes/rollout.md "Session 44").
    for p in policy.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    return DistributedDataParallel(Scorer(policy, micro_batch, logprobs), device_ids=device_ids,
                                   gradient_as_bucket_view=True)

