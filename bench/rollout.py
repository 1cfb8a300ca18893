"""The generate phase of an RL rollout on a random-initialised Qwen2.5-0.5B (bf16): HF generate
with its dynamic cache, HF generate with a static cache (auto-compiled), and the lab's decode loop
(one CUDA graph per step) with SDPA attention and with the fused decode kernel — one process, the
same prompts, the same sampling (temperature 1, top-k 50: HF's default), no early stop.

    python bench/rollout.py                       # 64 sequences, 200 prompt + 256 new tokens
    python bench/rollout.py --grpo [--steps 5]    # plus Dr. GRPO steps: 1 cold, then warm
    torchrun --nproc-per-node 2 bench/rollout.py --grpo   # the steps only, data-parallel

Per path: ms per decode step (prefill excluded; the median of --rounds runs, the paths shuffled
each round, and its range), tokens/s, the GPU's busy fraction (kernel time over wall time,
torch.profiler) and the HBM floor (weights + the mean K/V read once a step).

Without a GPU it says so and prints the static report instead: the SASS summary of the step's
Triton kernels at Qwen2.5-0.5B's sizes (``--json`` writes it).
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # import this checkout's ws_lab

from ws_lab import cli


def _parser():
    ap = cli.ArgumentParser(prog="bench/rollout.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64, help="sequences (default 64)")
    ap.add_argument("--prompt", type=int, default=200, help="prompt tokens (default 200)")
    ap.add_argument("--new", type=int, default=256, help="new tokens per sequence (default 256)")
    ap.add_argument("--paths", default="hf-dynamic,hf-static,lab-sdpa,lab-fused,lab-fused-cublas",
                    help="comma-separated paths to time (default: all five; lab-fused-cublas "
                         "is the fused loop on cuBLAS GEMMs)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="timed runs per path, the paths shuffled each round (default 3)")
    ap.add_argument("--json", type=Path,
                    help="write the results as JSON here (without a GPU: the static report)")
    ap.add_argument("--grpo", action="store_true",
                    help="also run Dr. GRPO steps (rollout, log-probs, update): one cold, then "
                         "--steps warm; per phase cold, warm median and range, peak memory, "
                         "floor")
    ap.add_argument("--steps", type=int, default=5,
                    help="warm Dr. GRPO steps after the cold one (default 5; with --grpo)")
    ap.add_argument("--grpo-attention", choices=("sdpa", "lab"), default="sdpa",
                    help="the scoring forward and backward's attention (with --grpo): HF's "
                         "SDPA, or the lab's op (TileLang forward + backward, "
                         "ws_lab/rollout/hf_attention.py); default sdpa")
    ap.add_argument("--grpo-logprobs", choices=("torch", "lab"), default="torch",
                    help="the old, reference and policy log-probs (with --grpo): the lm_head's "
                         "logits then log-softmax in torch, or the lab's kernel chunked over "
                         "the vocabulary (kernels/step/token_logprobs.py); default torch")
    ap.add_argument("--grpo-compile", action="store_true",
                    help="(with --grpo) the old, reference and policy log-probs, and the "
                         "rollout's prefill, through the lab's training decoder (q|k|v as one "
                         "GEMM) under torch.compile (grpo.compiled_stack, DecodeModel's "
                         "prefill='lab'; compiled once, in the cold step)")
    ap.add_argument("--grpo-memory-gib", type=float, default=13.0,
                    help="the update's memory budget (with --grpo): its micro-batch is the "
                         "largest whose probed peak fits (grpo.plan_micro_batch); default 13, "
                         "issue #47's bound")
    ap.add_argument("--grpo-anchors", action="store_true",
                    help="(with --grpo) also time the update's anchors on the last rollout's "
                         "batch: plain HF + torch log-probs, the same under torch.compile, and "
                         "Liger's fused Dr. GRPO loss (pip install -e '.[anchors]')")
    return ap


def _main(argv):
    args = _parser().parse_args(argv)
    cli.out_file(args.json)
    paths = [p for p in args.paths.split(",") if p]
    known = {"hf-dynamic", "hf-static", "lab-sdpa", "lab-fused", "lab-fused-cublas"}
    if not paths or set(paths) - known:
        raise cli.UsageError(f"--paths takes a comma-separated subset of {sorted(known)}")
    if args.rounds < 1:
        raise cli.UsageError(f"--rounds must be at least 1, got {args.rounds}")
    for option in ("batch", "prompt", "new", "steps"):
        if getattr(args, option) < 1:
            raise cli.UsageError(f"--{option} must be at least 1, got {getattr(args, option)}")
    from ws_lab.bench_rollout import GRPO_GROUP
    from ws_lab.rollout.config import QWEN25_05B

    positions = QWEN25_05B["max_position_embeddings"]
    if args.prompt + args.new > positions:
        raise cli.UsageError(f"--prompt {args.prompt} + --new {args.new} exceed Qwen2.5-0.5B's "
                             f"{positions} positions")
    if args.grpo and args.batch % GRPO_GROUP:
        raise cli.UsageError(f"--grpo samples groups of {GRPO_GROUP}: --batch must be a multiple "
                             f"of {GRPO_GROUP}, got {args.batch}")
    _check_torchrun(args, GRPO_GROUP)
    import torch

    if not torch.cuda.is_available():
        if args.grpo:
            raise cli.UsageError("--grpo times a training step and needs a CUDA device; there is "
                                 "none here")
        from ws_lab import bench_rollout

        return bench_rollout.static_report(args.json)
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise cli.UsageError("the rollout needs transformers: pip install -e '.[rollout]'") from None
    from ws_lab import bench_rollout

    bench_rollout.run(args, paths)


def _check_torchrun(args, group):
    """Under torchrun: the Dr. GRPO step only (no anchors), its groups split evenly."""
    from ws_lab.rollout import dp

    if not dp.launched():
        return
    if not args.grpo or args.grpo_anchors:
        raise cli.UsageError("under torchrun bench/rollout.py times the data-parallel Dr. GRPO "
                             "step only: give --grpo, without --grpo-anchors")
    world = int(os.environ.get("WORLD_SIZE", 1))
    if (args.batch // group) % world:
        raise cli.UsageError(f"--batch {args.batch} is {args.batch // group} groups of {group}, "
                             f"which {world} ranks do not share evenly")


def main(argv=None):
    cli.main(_main, argv, "bench/rollout.py")


if __name__ == "__main__":
    main()
