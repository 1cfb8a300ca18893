"""Benchmark the lab's TileLang pipelined baseline against its peers.

    python bench/pipelined.py --shape llama8b-4k --shape llama8b-8k --causal both
    python bench/pipelined.py --tune --shape llama8b-4k     # sweep configs, print CONFIGS lines
"""
import itertools
import sys

from ws_lab import bench


def tune(cases):
    """Times every candidate config on each case and prints the winning CONFIGS entries."""
    import torch
    import triton.testing

    from kernels import pipelined
    from ws_lab.check import random_qkv

    for shape in cases:
        dtype = getattr(torch, shape.dtype)
        (q, k, v), _ = random_qkv(shape.batch, shape.seq_len, shape.heads, shape.kv_heads,
                                  shape.head_dim, shape.head_dim_v, dtype, "cuda")
        timings = {}
        for bm, bn, threads, stages in itertools.product((64, 128), (64, 128), (128, 256), (1, 2)):
            if threads == 256 and bm == 64:
                continue
            cfg = pipelined.Config(bm, bn, threads, stages)
            try:
                run = lambda: pipelined.attention(q, k, v, causal=shape.causal, config=cfg)  # noqa: E731
                run()
                timings[cfg] = triton.testing.do_bench(run, warmup=50, rep=200, return_mode="median")
            except Exception as exc:  # e.g. shared memory over the limit
                print(f"  {cfg}: {type(exc).__name__}", file=sys.stderr)
        for cfg, ms in sorted(timings.items(), key=lambda kv: kv[1]):
            print(f"  {shape.name} causal={shape.causal} {cfg}: {ms:.3f} ms, "
                  f"{shape.flops() / ms / 1e9:.0f} TFLOPS")
        best = min(timings, key=timings.get)
        print(f"    ({shape.head_dim}, {shape.head_dim_v}, {shape.causal}): {best},")


if __name__ == "__main__":
    args = bench.parse_args(sys.argv[1:], ["llama8b-4k"],
                            extra=lambda ap: ap.add_argument("--tune", action="store_true"))
    if args.tune:
        tune(args.cases)
    else:
        bench.run(["pipelined"], args)
