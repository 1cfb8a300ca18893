"""The runner's rollout path (``bench/rollout.py``): the generate phase of an RL rollout on a
random-initialised Qwen2.5-0.5B, HF generate against the lab's CUDA-graph decode loop, timed in
shuffled rounds (``timing``), with the GPU's busy fraction and the HBM floor (``floors``), and
one Dr. GRPO step's breakdown. Without a GPU, the decode step's static report."""
import json
import statistics
import sys
import time

from ws_lab import cli, floors, timing

TOP_K = 50  # HF generate's default when sampling
GRPO_GROUP = 8  # completions per prompt in the Dr. GRPO step


def _progress(total, label):
    try:
        from tqdm import tqdm

        bar = tqdm(total=total, desc=label, leave=False, file=sys.stderr)
        return bar.update, bar.close
    except ImportError:
        return None, lambda: None


def _busy_fraction(run):
    """Kernel time over wall time from torch.profiler: for the lab's loop over its decode
    window (``loop.DECODE_RANGE``: the graph replays, prefill and capture left out), for HF's
    generate over the whole call (its prefill is ~2 % of it)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ws_lab.rollout.loop import DECODE_RANGE

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    wall_us = (time.perf_counter() - start) * 1e6
    events = prof.events()
    kernels = [e.time_range for e in events if e.device_type.name == "CUDA"]
    window = next((e.time_range for e in events if e.name == DECODE_RANGE), None)
    if window is not None:
        kernels = [k for k in kernels if window.start <= k.start <= window.end]
        wall_us = window.elapsed_us()
    return _covered_us(kernels) / wall_us if kernels else None


def _covered_us(ranges) -> float:
    """µs during which at least one of the ranges runs (their union): overlapping kernels, or
    one kernel reported twice (graph launches), count once."""
    covered, end = 0.0, None
    for r in sorted(ranges, key=lambda r: r.start):
        if end is None or r.start >= end:
            covered += r.end - r.start
            end = r.end
        elif r.end > end:
            covered += r.end - end
            end = r.end
    return covered


def _hf_path(hf, prompts, new, static):
    import torch

    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=True, top_k=TOP_K,
                  temperature=1.0, eos_token_id=None, pad_token_id=0)
    if static:
        kwargs["cache_implementation"] = "static"

    def run():
        with torch.no_grad():
            return hf.generate(prompts, **kwargs)

    return run


def _lab_path(hf, prompts, new, path, eos_id, prefill="hf"):
    """``lab-<attention>`` on the lab's GEMMs; ``lab-fused-cublas``: the same loop on cuBLAS
    GEMMs (the ablation of kernels/step/decode_layer.py's ``linear``). ``prefill``: the
    ``DecodeModel``'s."""
    from ws_lab.rollout.loop import generate
    from ws_lab.rollout.model import DecodeModel
    from ws_lab.rollout.sampling import Sampling

    _, attention, *rest = path.split("-")
    model = DecodeModel(hf, prompts.shape[0], prompts.shape[1] + new, attention,
                        gemms="torch" if rest == ["cublas"] else "lab", prefill=prefill)

    def run(progress=None):
        return generate(model, prompts, new, Sampling(temperature=1.0, top_k=TOP_K), eos_id,
                        check_every=32, progress=progress)

    return run


def measure(hf, prompts, new, paths, rounds):
    """Each path warmed up once, then timed in ``rounds`` rounds, the paths in a fresh shuffled
    order each round (``timing.time_rounds``: HF's host-bound generate and the lab's graph
    replays see the same drift); per path the median ms per decode step, its range and the
    GPU's busy fraction."""
    import torch

    from ws_lab.rollout.config import QWEN25_05B

    no_eos = QWEN25_05B["vocab_size"]  # an id never sampled: no early stop
    with torch.no_grad():  # the prefill, timed alone, is subtracted from HF's totals
        hf(prompts, logits_to_keep=1)
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf(prompts, logits_to_keep=1)
        torch.cuda.synchronize()
        prefill_s = time.perf_counter() - start
    runs = {}
    for path in paths:
        with cli.status(f"{path}: warm-up run (compiles)"):
            if path.startswith("hf"):
                runs[path] = _hf_path(hf, prompts, new, static=path == "hf-static")
            else:
                runs[path] = _lab_path(hf, prompts, new, path, no_eos)
            runs[path]()
    timers = {path: (lambda path=path: _time_ms(runs[path], path, new, prefill_s, "timed"))
              for path in paths}
    times, failed = timing.time_rounds(timers, rounds, timer=lambda timed: timed())
    if failed:
        path, exc = next(iter(failed.items()))
        raise RuntimeError(f"{path} failed while timed: {exc}") from exc
    results = {}
    for path in paths:
        ms = statistics.median(times[path])
        results[path] = dict(ms=ms, low=min(times[path]), high=max(times[path]),
                             busy=_busy_fraction(runs[path]))
        print(f"{path}: {ms:.3f} ms per decode step (median of {rounds})", file=sys.stderr,
              flush=True)
    return results, prefill_s


def _time_ms(run, path, new, prefill_s, label):
    """One timed run's ms per decode step: the lab loop's own figure (prefill excluded), or
    HF's wall time less the prefill over its new - 1 decode steps."""
    import torch

    update, close = _progress(new - 2, f"{path} {label}")
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = run(update) if path.startswith("lab") else run()
    torch.cuda.synchronize()
    close()
    if path.startswith("lab"):
        return out.ms_per_step
    return 1e3 * (time.perf_counter() - start - prefill_s) / (new - 1)


def floor_ms(hf, batch, prompt, new, read_gbps):
    """Weights read once a step plus the mean K/V a step reads, over the read ceiling
    (``floors.floor_ms``)."""
    cfg = hf.config
    weights = sum(p.numel() * p.element_size() for p in hf.parameters())
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    mean_ctx = prompt + new / 2
    kv = 2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * mean_ctx * head_dim * 2
    return floors.floor_ms(nbytes=weights + kv, gbps=read_gbps), weights, kv


GRPO_PHASES = ("generate", "log-probs", "update")


def grpo_floors_s(hf, batch, prompt, new, decode_floor_ms) -> dict[str, float]:
    """Each phase's floor in s. Matmul FLOPs at ``floors.TENSOR_TFLOPS``, with P the
    non-embedding matmul parameters, T every token and C the completion tokens (the lm_head
    runs on those only): log-probs are the reference's forward, 2 · (P·T + P_lm·C) (one inner
    step: the old log-probs are the policy's own, no forward of their own); the update a
    forward and a backward, 6 · (P·T + P_lm·C). Generate: ``new`` decode steps at the step's
    HBM floor (``floor_ms``)."""
    matmul = sum(p.numel() for name, p in hf.model.layers.named_parameters() if p.dim() == 2)
    forward = 2 * (matmul * batch * (prompt + new) + hf.lm_head.weight.numel() * batch * new)
    compute_s = lambda flops: floors.floor_ms(flops) / 1e3  # noqa: E731
    return {"generate": new * decode_floor_ms / 1e3, "log-probs": compute_s(forward),
            "update": compute_s(3 * forward)}


def phase_row(name, seconds, peak_bytes, floor_s) -> str:
    """A phase's table row: the cold (first) step, the warm median and range over the rest,
    the peak memory, the floor and warm ÷ floor."""
    cold, warm = seconds[0], sorted(seconds[1:])
    median = statistics.median(warm)
    return (f"| {name} | {cold:.3f} | {median:.3f} | {warm[0]:.3f}–{warm[-1]:.3f} | "
            f"{max(peak_bytes) / 2**30:.1f} | {floor_s:.3f} | {median / floor_s:.1f} |")


def grpo_step(hf, args, group=GRPO_GROUP, rank=0, world=1):
    """Dr. GRPO steps on the arithmetic task: the fused loop's rollout, the log-probs of the
    reference, one AdamW step with clipping. One cold step, then ``args.steps`` warm ones; per
    phase the cold time, the warm median and range, the peak memory and the floor. Under
    torchrun (``world`` ranks) each rank generates and scores its share of the groups and DDP
    all-reduces the gradients; rank 0 reports."""
    import copy

    import torch

    from ws_lab.rollout import dp, grpo, hf_attention
    from ws_lab.rollout.task import ArithmeticTask

    task = ArithmeticTask(hf.config.vocab_size, prompt_len=args.prompt)
    policy, reference = hf, copy.deepcopy(hf).eval()
    snapshot = copy.deepcopy(hf) if args.grpo_anchors else None  # the anchors start here
    if args.grpo_attention == "lab":  # the decode loop keeps its own attention
        for model in (policy, reference):
            model.set_attn_implementation(hf_attention.register())
    prompts, operands = task.prompts(args.batch // group, "cuda")
    mine = dp.share(args.batch, group, rank, world)  # world 1: every sequence
    prompts = prompts.repeat_interleave(group, dim=0)[mine]
    operands = operands.repeat_interleave(group, dim=0)[mine]
    if world > 1:
        dp_check(policy, reference, prompts, group, task.eos_id, args, rank)
    optimizer = grpo.adamw(policy.parameters(), lr=1e-6)
    rollout = _lab_path(policy, prompts, args.new, "lab-fused", task.eos_id,
                        prefill="lab" if args.grpo_compile else "hf")
    plan = []  # planned once, on the cold step's rollout (the shapes never change)

    def update(tokens, rewards):
        if not plan:
            plan.extend(_grpo_plan(policy, optimizer, prompts, tokens, args, world))
        micro, score_micro, scorer = plan
        report = grpo.update(policy, reference, optimizer, prompts, tokens, rewards, group,
                             task.eos_id, logprobs=args.grpo_logprobs, micro_batch=micro,
                             score_micro_batch=score_micro, compiled=args.grpo_compile,
                             scorer=scorer)[0]
        return report

    seconds, peaks, (report, tokens, rewards) = _grpo_steps(policy, rollout, task, operands,
                                                            update, args, world)
    if rank == 0:
        _grpo_table(hf, seconds, peaks, plan, args, group, world)
        print(f"last step: loss {report.loss:.4f}, ratio {report.ratio:.6f}, k3 KL "
              f"{report.kl:.2e}, grad norm {report.grad_norm:.3f}, mean reward "
              f"{rewards.mean():.3f} (rank 0's share)")
    if args.grpo_anchors:
        anchor_table(snapshot, prompts, tokens, rewards, group, task.eos_id, plan[:2], args)


def _grpo_plan(policy, optimizer, prompts, tokens, args, world):
    """(the update's slice, the reference log-probs' slice, the DDP scorer or None) within
    ``--grpo-memory-gib``, the smallest over the ranks."""
    from ws_lab.rollout import dp, grpo

    budget = args.grpo_memory_gib * 2**30
    scoring = grpo.compiled_stack(policy) if args.grpo_compile else policy
    probe = grpo.Scorer(scoring, len(tokens), args.grpo_logprobs)  # the stack the update runs
    micro = grpo.plan_micro_batch(probe, optimizer, prompts, tokens, budget)
    score_micro = grpo.plan_scoring_batch(policy, prompts, tokens, args.grpo_logprobs, budget)
    scorer = dp.scorer(scoring, micro, args.grpo_logprobs) if world > 1 else None
    return micro, score_micro, scorer


def _grpo_steps(policy, rollout, task, operands, update, args, world):
    """The timed steps: per phase its seconds and peak bytes, one entry a step (the first is
    cold), and the last step's (report, completions, rewards). Ranks start each step
    together."""
    import torch

    seconds = {name: [] for name in GRPO_PHASES}
    peaks = {name: [] for name in GRPO_PHASES}

    def phase(name, run):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        result = run()
        torch.cuda.synchronize()
        seconds[name].append(time.perf_counter() - start)
        peaks[name].append(torch.cuda.max_memory_allocated())
        return result

    for _ in range(1 + args.steps):
        if world > 1:
            torch.distributed.barrier()
        out = phase("generate", rollout)
        rewards = task.rewards(operands, out.tokens.cpu())
        policy.train()
        report = phase("update", lambda: update(out.tokens, rewards))
        policy.eval()
        # grpo.update times its log-probs apart; the update phase is the rest of it
        seconds["log-probs"].append(report.logprob_s)
        seconds["update"][-1] -= report.logprob_s
        peaks["log-probs"].append(peaks["update"][-1])
    return seconds, peaks, (report, out.tokens, rewards)


def _grpo_table(hf, seconds, peaks, plan, args, group, world):
    """Rank 0's table of the steps: per phase cold, warm median and range, peak, floor; the
    step, and the samples a second over every rank."""
    share = args.batch // world
    floor = floor_ms(hf, share, args.prompt, args.new, floors.read_bandwidth_gbps())[0]
    floors_s = grpo_floors_s(hf, share, args.prompt, args.new, floor)
    ranks = f" over {world} GPUs ({share} a GPU)" if world > 1 else ""
    print(f"\nDr. GRPO steps ({args.batch} sequences = {args.batch // group} prompts × {group}"
          f"{ranks}, {args.prompt} + {args.new} tokens, scoring attention {args.grpo_attention}, "
          f"log-probs {args.grpo_logprobs}{', compiled stack' if args.grpo_compile else ''}, "
          f"micro-batch {plan[0]} (reference log-probs {plan[1]}) from a "
          f"{args.grpo_memory_gib:g} GiB budget; 1 cold step, then {args.steps} warm):")
    print("| phase | cold s | warm s (median) | warm range | peak GiB | floor s | × floor |")
    print("|---|---|---|---|---|---|---|")
    for name in GRPO_PHASES:
        print(phase_row(name, seconds[name], peaks[name], floors_s[name]))
    steps = [sum(seconds[n][i] for n in GRPO_PHASES) for i in range(len(seconds["update"]))]
    warm = statistics.median(steps[1:])
    print(f"| step | {steps[0]:.3f} | {warm:.3f} | {min(steps[1:]):.3f}–{max(steps[1:]):.3f} | | "
          f"{sum(floors_s.values()):.3f} | {warm / sum(floors_s.values()):.1f} |")
    print(f"samples a second (warm, every GPU): {args.batch / warm:.1f}")
    print("log-probs and update share one peak (grpo.update runs both); the floors count "
          f"matmul FLOPs at {floors.TENSOR_TFLOPS:.0f} TFLOP/s and the decode step's HBM floor "
          "(a GPU's share)")


def dp_check(policy, reference, prompts, group, eos_id, args, rank):
    """Before the timed steps, under torchrun: one update of a fresh copy of the policy, DDP
    over the ranks, against one process's update of another copy on the union batch (rank 0),
    both eager with micro-batch 8 on seeded completions and 0 / 1 rewards (the random policy
    earns none, which would leave only the KL term). Rank 0 prints both reports and the
    largest parameter difference over the step's largest move, and returns (the one-process
    report, the DDP one, that difference)."""
    import copy

    import torch
    import torch.distributed as dist

    from ws_lab.rollout import dp, grpo

    world = dist.get_world_size()
    everyone = prompts.shape[0] * world
    gen = torch.Generator().manual_seed(2)
    completions = torch.randint(0, policy.config.vocab_size, (everyone, args.new),
                                generator=gen).to(prompts.device)
    rewards = torch.randint(0, 2, (everyone,), generator=gen).float()
    union = torch.cat([torch.zeros_like(prompts)] * world)
    dist.all_gather_into_tensor(union, prompts.contiguous())
    mine = dp.share(everyone, group, rank, world)

    def step(batch, scorer_of):
        model = copy.deepcopy(policy).train()
        optimizer = grpo.adamw(model.parameters(), lr=1e-6)
        report = grpo.update(model, reference, optimizer, union[batch], completions[batch],
                             rewards[batch], group, eos_id, micro_batch=8, score_micro_batch=8,
                             logprobs=args.grpo_logprobs, scorer=scorer_of(model))[0]
        return model, report

    parallel, dp_report = step(mine, lambda m: dp.scorer(m, 8, args.grpo_logprobs))
    if rank == 0:
        single, one_report = step(slice(None), lambda m: None)
        moved = max((s - p).abs().max().item() for s, p in
                    zip(single.parameters(), policy.parameters()))
        apart = max((s - q).abs().max().item() for s, q in
                    zip(single.parameters(), parallel.parameters()))
        print(f"\ndata-parallel check (eager, micro-batch 8, {everyone} sequences):")
        for name, r in (("one GPU, union batch", one_report), (f"{world} GPUs, DDP", dp_report)):
            print(f"  {name}: loss {r.loss:.6f}, ratio {r.ratio:.6f}, k3 KL {r.kl:.3e}, "
                  f"grad norm {r.grad_norm:.5f}")
        print(f"  parameters after the step: largest difference {apart:.3e}, largest move "
              f"{moved:.3e}", flush=True)
        del single
    del parallel
    if prompts.is_cuda:
        torch.cuda.empty_cache()
    dist.barrier()
    return (one_report, dp_report, apart) if rank == 0 else None


GRPO_ANCHORS = ("lab", "plain", "compiled", "liger")


def anchor_update(name, policy, reference, optimizer, prompts, tokens, rewards, group, eos_id,
                  micro, args):
    """One update of a path on the anchors' table (issue #47): "lab", ``grpo.update`` as the
    steps above ran it (``args``' log-probs and compiled stack, the policy's attention);
    "plain", the same on HF's SDPA and torch's log-probs; "compiled", plain with HF's decoder
    stacks under ``torch.compile`` (``grpo.compiled_stack(..., "hf")``); "liger", TRL's Liger path
    (ws_lab/rollout/anchors.py). ``micro``: the update's slices and the lab's reference
    log-probs' (the anchors score in the update's slices, as before)."""
    from ws_lab.rollout import anchors, grpo

    if name == "liger":
        return anchors.liger_update(policy, reference, optimizer, prompts, tokens, rewards,
                                    group, eos_id, micro_batch=micro[0])
    lab = name == "lab"
    return grpo.update(policy, reference, optimizer, prompts, tokens, rewards, group, eos_id,
                       micro_batch=micro[0], score_micro_batch=micro[1 if lab else 0],
                       logprobs=args.grpo_logprobs if lab else "torch",
                       compiled=name == "compiled" or (lab and args.grpo_compile),
                       decoder="hf" if name == "compiled" else "lab")[0]


def anchor_table(snapshot, prompts, tokens, rewards, group, eos_id, micro, args):
    """The lab's update and its anchors on the last rollout's batch, each from the policy as it
    was before the first step (``snapshot``, also the reference) with a fresh AdamW: the first
    update's loss and gradient norm (the same batch and weights: they should agree to bf16's
    precision), then the cold and ``args.steps`` warm updates (log-probs included), peak
    memory."""
    import copy

    import torch

    from ws_lab.rollout import grpo, hf_attention

    print(f"\nThe update and its anchors on the last rollout's batch (micro-batch {micro[0]}):")
    print("| path | cold s | warm s (median) | warm range | process peak GiB | first loss | "
          "grad norm |")
    print("|---|---|---|---|---|---|---|")
    lab_attention = hf_attention.register() if args.grpo_attention == "lab" else "sdpa"
    for name in GRPO_ANCHORS:
        attention = lab_attention if name == "lab" else "sdpa"
        policy, reference = copy.deepcopy(snapshot).train(), copy.deepcopy(snapshot).eval()
        for model in (policy, reference):
            model.set_attn_implementation(attention)
        optimizer = grpo.adamw(policy.parameters(), lr=1e-6)
        seconds, reports = [], []
        torch.cuda.reset_peak_memory_stats()
        for _ in range(1 + args.steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            reports.append(anchor_update(name, policy, reference, optimizer, prompts, tokens,
                                         rewards, group, eos_id, micro, args))
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        warm = sorted(seconds[1:])
        print(f"| {name} | {seconds[0]:.3f} | {statistics.median(warm):.3f} | "
              f"{warm[0]:.3f}–{warm[-1]:.3f} | {torch.cuda.max_memory_allocated() / 2**30:.1f} | "
              f"{reports[0].loss:.6f} | {reports[0].grad_norm:.4f} |")
        del policy, reference, optimizer
        torch.cuda.empty_cache()


def static_report(json_path):
    """Without a GPU: the SASS summary of the step's Triton kernels at Qwen2.5-0.5B's sizes —
    the gate|up and split-K down GEMMs, the paced L2 prefetch, the fused decode attention (the
    CPU tests in tests/cpu/test_rollout.py run the loop itself on a small model)."""
    from ws_lab import registry, triton_static
    from ws_lab.rollout.config import QWEN25_05B as cfg

    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg["hidden_size"] // heads
    layer = registry.decode("layer_ops").static_specs(cfg["hidden_size"], cfg["intermediate_size"])
    fused = registry.decode("fused").static_specs(heads, kv_heads, head_dim, "bfloat16")
    triton_static.print_reports(
        "the decode step's kernels at Qwen2.5-0.5B's sizes",
        [("Qwen2.5-0.5B decode step", spec, dict(kernel=spec.name)) for spec in layer + fused],
        json_path)


def run(args, paths):
    """The GPU run of ``bench/rollout.py``: every path timed, the table, ``--json``, and the
    Dr. GRPO step with ``--grpo``; under torchrun the Dr. GRPO step only, data-parallel."""
    import torch

    from ws_lab.rollout import config, dp

    if dp.launched():
        rank, world = dp.init()
        hf = config.random_model(config.qwen2_config(), torch.bfloat16, "cuda")  # seed 0: one
        grpo_step(hf, args, rank=rank, world=world)  # model on every rank
        torch.distributed.destroy_process_group()
        return
    read_gbps = floors.read_bandwidth_gbps()
    hf = config.random_model(config.qwen2_config(), torch.bfloat16, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    prompts = torch.randint(0, hf.config.vocab_size, (args.batch, args.prompt), generator=gen,
                            device="cuda")
    results, prefill_s = measure(hf, prompts, args.new, paths, args.rounds)
    floor, weights, kv = floor_ms(hf, args.batch, args.prompt, args.new, read_gbps)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, read ceiling "
          f"{read_gbps:.0f} GB/s; B {args.batch}, {args.prompt} + {args.new} tokens; prefill "
          f"{1e3 * prefill_s:.1f} ms (excluded)\n")
    print(f"| path | ms per decode step (median of {args.rounds}) | range | tokens/s | GPU busy "
          f"| × HF static |")
    print("|---|---|---|---|---|---|")
    static = results.get("hf-static", {}).get("ms")
    for path, r in results.items():
        busy = "n/a" if r["busy"] is None else f"{100 * r['busy']:.0f} %"
        gap = f"{static / r['ms']:.2f}" if static else "n/a"
        print(f"| {path} | {r['ms']:.3f} | {r['low']:.3f}–{r['high']:.3f} | "
              f"{args.batch * 1e3 / r['ms']:,.0f} | {busy} | {gap} |")
    print(f"| HBM floor ({weights / 1e9:.2f} GB weights + {kv / 1e9:.3f} GB mean K/V) | "
          f"{floor:.3f} | | | | |")
    if args.json:
        args.json.write_text(json.dumps(dict(
            device=torch.cuda.get_device_name(), torch=torch.__version__, batch=args.batch,
            prompt=args.prompt, new=args.new, rounds=args.rounds, floor_ms=floor,
            paths=results), indent=1))
    if args.grpo:
        grpo_step(hf, args)
