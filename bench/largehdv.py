"""Benchmark the LargeHeadDimV warp-specialized forward (QK 64, V 512) against the lab's
pipelined kernel, mem-efficient SDPA (cuDNN and flash SDPA refuse Dv ≠ D and show n/a) and the
tensor-core floor, in one process.

    python bench/largehdv.py --shape largehdv-2k --shape largehdv-1k
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # import this checkout's ws_lab

from ws_lab import bench

if __name__ == "__main__":
    bench.main(["largehdv"], ["largehdv-2k"], sys.argv[1:])
