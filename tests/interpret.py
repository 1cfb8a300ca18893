"""Runs a test's script under Triton's interpreter in a fresh process (TRITON_INTERPRET is read
when Triton is imported, so it cannot be switched on inside the test's own process)."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(script: str, cases=()) -> list:
    """``script`` run as ``python -c script <cases as JSON>`` with TRITON_INTERPRET=1 from the
    checkout's root (a script without cases ignores the argument); what its last line of
    output prints as JSON."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
