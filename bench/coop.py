"""Benchmark the cooperative warp-specialized forward — serial (coop) and IntraWGOverlap
(coop-overlap) mainloops, each with and without pingpong, the persistent overlap kernel
(coop-overlap-persistent), and both overlap kernels walking K/V downward (…-desc) —
against the lab's pipelined baseline, TileOPs, FlashAttention's CuTe-DSL forward (FA-CuTe)
and cuDNN / flash / mem-efficient SDPA, in one process.

    python bench/coop.py --shape llama8b-4k --shape llama8b-8k --shape train8b-4k
    python bench/coop.py --dtype fp8 --shape llama8b-4k   # the FP8 forward (ws_lab/bench_fp8.py)
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # import this checkout's ws_lab

from ws_lab import bench, bench_fp8

if __name__ == "__main__":
    bench.main(["coop-overlap-persistent", "coop-overlap-persistent-desc", "coop-overlap",
                "coop-overlap-desc", "coop-overlap-nopp", "coop", "coop-nopp"], ["llama8b-4k"],
               sys.argv[1:],
               by_dtype={"fp8": (["fp8", "fp8-coop", "fp8-coop-persistent", "fp8-coop-rs",
                                  "fp8-coop-rs-vt", "fp8-coop-rs-persistent", "fp8-coop-rs-desc",
                                  "fp8-coop-rs-persistent-desc"],
                                 bench_fp8.FP8, bench_fp8.SOURCE_DTYPE)})
