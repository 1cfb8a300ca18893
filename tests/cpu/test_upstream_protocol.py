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


def test_every_pin_states_triage_impact_links_and_a_control():
    from ws_lab import repro
    from ws_lab.upstream import TRIAGES

    for name in repro.names():
        mod = repro.pin_module(name)
        assert mod.TRIAGE in TRIAGES, (name, mod.TRIAGE)
        assert mod.IMPACT and mod.LINKS and callable(mod.control), name
        assert all(link.startswith(("https://github.com/tile-ai/tilelang/", "none found"))
                   for link in mod.LINKS), (name, mod.LINKS)


@pytest.mark.parametrize("name", ["smem_reuse_without_syncs", "fence_proxy_for_unrelated_smem"])
def test_a_bundle_opens_with_its_triage(name):
    """Triage and impact first; the fence pins add the SASS facts of kernel and control (every
    pin's sections: tests/cpu/test_codegen.py)."""
    from ws_lab import repro

    text = repro.bundle(name)
    mod = repro.pin_module(name)
    assert text.splitlines()[2].startswith(f"**Triage: {mod.TRIAGE}.** Impact: ")
    assert ("## ptxas -v / SASS, kernel and control" in text) == (name in repro.FENCE_PINS)


def test_the_reuse_pin_kernel_has_its_own_barriers():
    """#2416's kernel is race-free but for the reuse: its two T.sync_threads() survive with
    automatic syncs off, around the GEMM and before the TMA store."""
    from ws_lab.upstream import smem_reuse_without_syncs as pin

    body = pin.lower()
    body = body[body.rfind("__global__"):]
    first, gemm = body.find("__syncthreads"), body.find("wgmma_ss")
    assert body.count("__syncthreads") == 2 and 0 <= first < gemm
    assert body.rfind("__syncthreads") < body.find("tma_store")


def test_against_reports_flips(tmp_path):
    """--against with an interpreter whose TileLang prints a fix for one pin: that pin flips;
    one that prints nothing reads as an error, not as fixed."""
    from ws_lab import repro

    fake = tmp_path / "venv" / "bin"
    fake.mkdir(parents=True)
    (fake / "python").write_text(
        "#!/bin/sh\n"
        "case \"$1\" in\n"
        "  fence_operand_num_regs.py) echo 'tilelang 9.9: fixed: counts [32]';;\n"
        "  smem_reuse_without_syncs.py) echo 'Traceback' >&2; exit 1;;\n"
        "  *) echo 'tilelang 9.9: bug signature found: same'; exit 1;;\n"
        "esac\n")
    (fake / "python").chmod(0o755)
    rows = {r[0]: r for r in repro.against(str(tmp_path / "venv"), tmp_path / "work")}
    assert rows["fence_operand_num_regs"][2] == "fixed"
    assert rows["smem_reuse_without_syncs"][2].startswith("error: Traceback")
    assert rows["stripe_fragment_layout"][1:] == ("bug signature found", "bug signature found",
                                                  "9.9")
