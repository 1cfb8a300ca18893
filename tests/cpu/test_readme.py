"""The README's Python API examples run as written: the CPU ones under Triton's interpreter in a
fresh process, the GPU one at least names real entry points."""
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _api_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Python API"):text.index("## Layout")]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_the_cpu_examples_run_under_the_interpreter():
    blocks = [b for b in _api_blocks() if 'else "cpu"' in b]
    assert len(blocks) == 2
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    for block in blocks:
        done = subprocess.run([sys.executable, "-c", block], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "torch.Size" in done.stdout


def test_the_gpu_example_names_a_registered_kernel():
    from ws_lab import registry

    (block,) = [b for b in _api_blocks() if "registry.get" in b]
    ast.parse(block)
    names = re.findall(r'registry\.get\("([^"]+)"\)', block)
    assert names and all(n in registry.KERNELS for n in names)
