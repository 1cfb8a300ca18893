"""Benchmark the TileLang backward (bwd-pipelined) against TileOPs' GQA backward and the
backward of SDPA (flash / cuDNN / mem-efficient) and FA-CuTe through autograd, in one process
(``ws_lab/bench_bwd.py`` says what is timed). The rows: train8b-4k / 8k (full), llama8b-4k /
8k (causal) and qwen0.5b-train, the Dr. GRPO update's attention (B 8, S 456, 14 / 2 heads,
D 64, causal).

    python bench/bwd.py --dtype bf16
    python bench/bwd.py --shape qwen0.5b-train --dtype bf16 --rounds 40
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # import this checkout's ws_lab

from ws_lab import bench, bench_bwd, shapes

QWEN_TRAIN = shapes.register(shapes.Shape("qwen0.5b-train", 8, 14, 2, 456, 64, 64, True))
ROWS = ["train8b-4k", "train8b-8k", "llama8b-4k", "llama8b-8k", QWEN_TRAIN.name]

if __name__ == "__main__":
    bench.main(["bwd-pipelined", "bwd-ws"], ROWS, sys.argv[1:], suite=bench_bwd.BACKWARD)
