"""The Triton MHA kernel vs cuDNN / flash SDPA and the lab's TileLang pipelined kernel.

    python bench/mha.py        # LLaMA-7B causal d128 (1, 32, S 512…4096) and GPT-2 (16, 12, 512) d64
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # import this checkout's ws_lab

from ws_lab import bench, shapes

# LLaMA-7B attention: B 1, 32 heads, d128, causal, S 512…4096.
LLAMA7B = [shapes.register(shapes.Shape(f"llama7b-{seq}", 1, 32, 32, seq, 128, 128, True)).name
           for seq in (512, 1024, 2048, 4096)]

if __name__ == "__main__":
    bench.main(["triton-mha"], LLAMA7B + ["gpt2-d64"], sys.argv[1:])
