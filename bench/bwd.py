"""Benchmark the TileLang backward (bwd-pipelined) against TileOPs' GQA backward and the
backward of SDPA (flash / cuDNN / mem-efficient) and FA-CuTe through autograd, in one process
(``ws_lab/bench_bwd.py`` says what is timed).

    python bench/bwd.py --shape train8b-4k --dtype bf16
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # import this checkout's ws_lab

from ws_lab import bench, bench_bwd

if __name__ == "__main__":
    bench.main(["bwd-pipelined"], ["train8b-4k"], sys.argv[1:], suite=bench_bwd.BACKWARD)
