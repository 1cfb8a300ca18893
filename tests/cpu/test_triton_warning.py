"""Triton 3.9 warns on every compile unless TRITON_DEFAULT_FP_FUSION is set: importing ws_lab
sets it to the lab's tuned default (fusion on) and leaves a user's own choice alone."""
import os
import subprocess
import sys

PROBE = """
import warnings
from ws_lab import triton_static
from ws_lab.kernels.step import rollout_step
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    triton_static.report(rollout_step.static_specs()[0])
import os
print(os.environ["TRITON_DEFAULT_FP_FUSION"], sum("FP_FUSION" in str(w.message) for w in seen))
"""


def _probe(**env):
    base = {k: v for k, v in os.environ.items() if k != "TRITON_DEFAULT_FP_FUSION"}
    done = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_a_compile_prints_no_fp_fusion_warning():
    assert _probe() == ["1", "0"]


def test_the_users_choice_stands():
    assert _probe(TRITON_DEFAULT_FP_FUSION="0") == ["0", "0"]
