"""The pins' three outcomes: a strict xfail accepts only StillBroken (the bug's signature is in
the code), a fix passes (and the strict xfail reports it), and a check that finds neither the
signature nor the fixed form is a hard error — codegen changed, the pin must be rechecked."""
import pytest

from ws_lab.upstream import (Outcome, SignatureMissing, StillBroken, expect_fixed, verdict)


@pytest.mark.parametrize("bug,fixed,outcome", [(True, False, Outcome.BUG),
                                               (False, True, Outcome.FIXED),
                                               (False, False, Outcome.MISSING),
                                               (True, True, Outcome.MISSING)])
def test_verdict(bug, fixed, outcome):
    assert verdict(bug, fixed, "detail").outcome is outcome


def test_only_the_bug_signature_is_what_a_strict_xfail_expects():
    with pytest.raises(StillBroken, match="detail"):
        expect_fixed(verdict(True, False, "detail"))
    with pytest.raises(SignatureMissing, match="codegen changed: recheck this pin"):
        expect_fixed(verdict(False, False, "detail"))
    assert not issubclass(SignatureMissing, StillBroken)
    expect_fixed(verdict(False, True, "detail"))  # fixed: no exception


def test_every_pin_writes_a_self_contained_script():
    """``python -m ws_lab.repro NAME --script F``: the pin with its lowering and outcomes,
    importing nothing of the lab."""
    import re

    from ws_lab import repro

    for name in repro.names():
        source = repro.script(name)
        compile(source, f"{name}.py", "exec")
        imports = re.findall(r"^\s*(?:from|import) ([\w.]+)", source, re.MULTILINE)
        assert not [m for m in imports if m.startswith("ws_lab")], (name, imports)


def test_a_script_runs_alone_and_fails_for_the_stated_reason(tmp_path):
    import subprocess
    import sys

    from ws_lab import repro

    path = tmp_path / "repro.py"
    path.write_text(repro.script("fence_operand_num_regs"))
    done = subprocess.run([sys.executable, "-I", str(path)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode != 0 and "AssertionError" in done.stderr
    assert "bug signature found: fence after the wait covers [4096] registers" in done.stdout
