"""The boundary cases of ws_lab.boundary_cases on the Triton decode kernels under
TRITON_INTERPRET=1: a block id outside the pool or a position outside the cache gives exactly
that sequence's NaN rows and touches nothing outside a buffer; non-finite q / k / v give NaN in
exactly the rows they reach; an empty context stays zeros. The GPU suite:
tests/triton/test_boundary.py."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ws_lab import boundary_cases as bc
from ws_lab.boundary_cases import Verdict
from ws_lab.paged_cases import variants

TRITON_MODES = [name for name in variants() if name != "cuda"]
NAMES = ([f"paged-{m}: {c}" for m in TRITON_MODES for c in bc.PAGED_CASES]
         + [f"fused-static: {c}" for c in bc.FUSED_CASES]
         + [f"fused-paged: {c}" for c in bc.FUSED_PAGED_CASES])


@pytest.fixture(scope="module")
def verdicts():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-m", "tests.cpu.interpret_boundary"], env=env,
                          cwd=Path(__file__).resolve().parents[2], capture_output=True,
                          text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_case_ran(verdicts):
    assert sorted(verdicts) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_boundary_case(verdicts, name):
    v = Verdict(**{k: [tuple(r) for r in x] if k.endswith("rows") else x
                   for k, x in verdicts[name].items()})
    assert v.ok(2e-3), v
    if "outside" in name or "position =" in name or name.split(": ")[1].startswith("id ="):
        assert v.want_nonfinite_rows, "the case must make NaN rows"
