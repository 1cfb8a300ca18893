"""The data-parallel Dr. GRPO step (ws_lab/rollout/dp.py) on the CPU: two gloo ranks, each
with its share of whole groups and the policy's scoring wrapped in DDP, make the same update
as one process on the union batch (fp32, the tiny Qwen2 config, SGD so that the update is the
gradient itself)."""
import copy
import os
import socket

import pytest
import torch

pytest.importorskip("transformers")

from ws_lab.rollout import config, dp, grpo  # noqa: E402
from ws_lab.rollout.weights import shared_weights  # noqa: E402
from ws_lab.rollout.task import EOS  # noqa: E402

GROUP, GROUPS, PROMPT, COMPLETION, MICRO = 2, 4, 6, 5, 2


def _batch():
    """The union batch: prompts, completions (one with an early EOS) and rewards."""
    gen = torch.Generator().manual_seed(1)
    vocab = config.TINY["vocab_size"]
    prompts = torch.randint(0, vocab, (GROUP * GROUPS, PROMPT), generator=gen)
    completions = torch.randint(0, vocab, (GROUP * GROUPS, COMPLETION), generator=gen)
    completions[1, 2] = EOS
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 3.0])
    return prompts, completions, rewards


def _step(rank_slice=slice(None), scorer_of=None):
    """One Dr. GRPO step from the seed-0 tiny model: (parameters after it, its report, how many
    storages the gradients live in). As in the bench, the policy's GEMM weights are views of
    the decode model's packed buffer, made after the optimizer (``weights.shared_weights``)."""
    policy = config.random_model(config.qwen2_config(config.TINY), torch.float32, "cpu")
    reference = copy.deepcopy(policy)
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    shared_weights(policy)
    prompts, completions, rewards = (t[rank_slice] for t in _batch())
    scorer = scorer_of(policy) if scorer_of else None
    report = grpo.update(policy, reference, optimizer, prompts, completions, rewards, GROUP, EOS,
                         micro_batch=MICRO, scorer=scorer)[0]
    storages = {p.grad.untyped_storage().data_ptr() for p in policy.parameters()}
    return [p.detach().clone() for p in policy.parameters()], report, len(storages)


def _rank(rank, world, port, out, compiled=False):
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    assert dp.init("gloo") == (rank, world)
    share = dp.share(GROUP * GROUPS, GROUP, rank, world)
    scoring = grpo.compiled_stack if compiled else (lambda policy: policy)
    params, report, storages = _step(share, lambda policy: dp.scorer(scoring(policy), MICRO))
    if rank == 0:
        torch.save({"params": params, "report": report.__dict__, "storages": storages}, out)
    dist.destroy_process_group()
    _exit_without_finalizing()


def _exit_without_finalizing():
    """End a rank whose work is done and saved. About 1 run in 30 (here and in CI), a rank
    aborts in interpreter finalization after ``destroy_process_group`` ("terminate called
    without an active exception", no Python frame); ``os._exit`` skips that teardown."""
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled-stack"])
def test_two_gloo_ranks_make_the_single_process_update(tmp_path, compiled):
    """DDP over the policy, or over its ``grpo.compiled_stack`` (a module, so that DDP finds
    the weights; Inductor's fp32 reductions round apart from eager's: 1e-4)."""
    out = tmp_path / "rank0.pt"
    torch.multiprocessing.spawn(_rank, args=(2, _free_port(), str(out), compiled), nprocs=2,
                                join=True)
    rel = 1e-4 if compiled else 1e-5
    got = torch.load(out)
    want_params, want, own_storages = _step()
    initial = config.random_model(config.qwen2_config(config.TINY), torch.float32, "cpu")
    moved = max((w - i).abs().max().item() for w, i in zip(want_params, initial.parameters()))
    assert moved > 1e-3  # the step moved the weights: the comparison below can fail
    for g, w in zip(got["params"], want_params):
        torch.testing.assert_close(g, w, rtol=rel, atol=rel)
    for name in ("loss", "ratio", "kl", "grad_norm"):
        assert got["report"][name] == pytest.approx(getattr(want, name), rel=rel, abs=1e-6), name
    # under DDP the gradients are views of its buckets (one here), not one tensor a parameter
    assert got["storages"] == 1 < own_storages


def test_a_share_is_whole_groups_on_every_rank():
    assert [dp.share(8, 2, r, 2) for r in range(2)] == [slice(0, 4), slice(4, 8)]
    with pytest.raises(ValueError, match="3 groups of 2 do not split evenly over 2 ranks"):
        dp.share(6, 2, 0, 2)
    with pytest.raises(ValueError, match="7 responses are not whole groups of 2"):
        dp.share(7, 2, 0, 2)


def test_init_outside_torchrun_says_so(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="not started by torchrun: RANK, WORLD_SIZE"):
        dp.init("gloo")


def _check_rank(rank, world, port, out):
    """One rank of the bench's data-parallel check (ws_lab.bench_rollout.dp_check), on a
    process group whose collectives time out: a single-process update that all-reduced beside
    it (the bug this pins) fails instead of hanging."""
    import datetime
    import types

    import torch.distributed as dist

    from ws_lab import bench_rollout

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    policy = config.random_model(config.qwen2_config(config.TINY), torch.float32, "cpu")
    reference = copy.deepcopy(policy)
    prompts = torch.randint(0, config.TINY["vocab_size"], (GROUP * GROUPS, PROMPT),
                            generator=torch.Generator().manual_seed(0))
    args = types.SimpleNamespace(new=COMPLETION, grpo_logprobs="torch")
    mine = dp.share(GROUP * GROUPS, GROUP, rank, world)
    got = bench_rollout.dp_check(policy, reference, prompts[mine], GROUP, EOS, args, rank)
    if rank == 0:
        torch.save([got[0].__dict__, got[1].__dict__], out)
    dist.destroy_process_group()
    _exit_without_finalizing()


def test_the_benchs_data_parallel_check_runs_and_agrees(tmp_path):
    """bench/rollout.py's check under torchrun: DDP over two ranks against rank 0's update of
    the union batch alone (which must make no collective of its own), equal reports."""
    out = tmp_path / "reports.pt"
    torch.multiprocessing.spawn(_check_rank, args=(2, _free_port(), str(out)), nprocs=2,
                                join=True)
    one, parallel = torch.load(out)
    assert one["grad_norm"] > 0  # the seeded 0 / 1 rewards give a gradient to compare
    for name in ("loss", "ratio", "kl", "grad_norm"):
        assert parallel[name] == pytest.approx(one[name], rel=1e-5, abs=1e-6), name
