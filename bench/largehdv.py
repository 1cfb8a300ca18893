"""Benchmark the LargeHeadDimV warp-specialized forward (QK 64, V 512) against the lab's
pipelined kernel, mem-efficient SDPA (cuDNN and flash SDPA refuse Dv ≠ D and show n/a) and the
tensor-core floor, in one process.

    python bench/largehdv.py --shape largehdv-2k --shape largehdv-1k
"""
import sys

from ws_lab import bench

if __name__ == "__main__":
    bench.main(["largehdv"], ["largehdv-2k"], sys.argv[1:])
