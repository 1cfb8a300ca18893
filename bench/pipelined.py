"""Benchmark the lab's TileLang pipelined baseline against its peers.

    python bench/pipelined.py --shape llama8b-4k --shape llama8b-8k --causal both
    python bench/pipelined.py --tune --shape llama8b-4k     # sweep configs, print CONFIGS lines
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # import this checkout's ws_lab

import functools
import itertools
import math

from ws_lab import bench, cli, registry


# (block_m, block_n, threads, num_stages, heavy_first); 256 threads need block_m 128.
CANDIDATES = [c for c in itertools.product((64, 128), (64, 128), (128, 256), (1, 2), (False, True))
              if not (c[2] == 256 and c[0] == 64)]


def tune(cases):
    """Times every candidate config on each case and prints the winning CONFIGS entries."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    import triton.testing

    pipelined = registry.get("pipelined").module_object()
    from ws_lab.testing import check_attention, random_qkv

    for shape in cases:
        dtype = getattr(torch, shape.dtype)
        (q, k, v), _ = random_qkv(shape.batch, shape.seq_len, shape.heads, shape.kv_heads,
                                  shape.head_dim, shape.head_dim_v, dtype, "cuda")
        configs = [pipelined.Config(*c) for c in CANDIDATES]

        def build(cfg):
            try:
                pipelined.compiled(shape.batch, shape.seq_len, shape.heads, shape.kv_heads,
                                   shape.head_dim, shape.head_dim_v, shape.causal, shape.dtype,
                                   1.0 / math.sqrt(shape.head_dim), cfg)
                return cfg
            except Exception as exc:  # e.g. shared memory over the limit
                print(f"  {cfg}: {type(exc).__name__}", file=sys.stderr)

        with ThreadPoolExecutor(max_workers=16) as pool:
            built = [cfg for cfg in pool.map(build, configs) if cfg]
        timings, errors = {}, {}
        for cfg in built:
            run = lambda: pipelined.attention(q, k, v, causal=shape.causal, config=cfg)  # noqa: E731
            try:
                errors[cfg] = check_attention(
                    functools.partial(pipelined.attention, config=cfg), shape.batch, shape.seq_len,
                    shape.heads, shape.kv_heads, shape.head_dim, shape.head_dim_v, shape.causal, dtype)
                if errors[cfg].ok:
                    timings[cfg] = triton.testing.do_bench(run, warmup=50, rep=200,
                                                           return_mode="median")
            except Exception as exc:  # e.g. a launch that needs more shared memory than there is
                print(f"  {cfg}: {type(exc).__name__}", file=sys.stderr)
        for cfg, ms in sorted(timings.items(), key=lambda kv: kv[1]):
            print(f"  {shape.name} causal={shape.causal} {cfg}: {ms:.3f} ms, "
                  f"{shape.flops() / ms / 1e9:.0f} TFLOPS, {errors[cfg]}")
        for cfg in set(errors) - set(timings):
            print(f"  {shape.name} causal={shape.causal} {cfg}: WRONG {errors[cfg]}")
        best = min(timings, key=timings.get)
        print(f"    ({shape.head_dim}, {shape.head_dim_v}, {shape.causal}): {best},")


def _main(argv):
    args = bench.parse_args(argv, ["llama8b-4k"], extra=lambda ap: ap.add_argument(
        "--tune", action="store_true",
        help="time every candidate config on each shape and print CONFIGS lines (needs a GPU)"))
    if not args.tune:
        return bench.run(["pipelined"], args)
    import torch

    if not torch.cuda.is_available():
        raise bench.needs_gpu("--tune")
    tune(args.cases)


if __name__ == "__main__":
    cli.main(_main, sys.argv[1:])
