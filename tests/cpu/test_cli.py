"""The lab as a newcomer meets it on a CPU machine: every user mistake is one line on stderr and
exit code 2 (no traceback), options that need a GPU are refused or do what they can, Triton
kernels get a static report, the bench scripts import the checkout they run from, and the
installed distribution holds one import package."""
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ws_lab import cli, emit, sass, shapes
from ws_lab.postproc import postprocess

ROOT = Path(__file__).resolve().parents[2]
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


def _no_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: these options measure instead")


def _run(*argv, cwd=ROOT, env=None):
    return subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=300)


def _assert_usage_error(done, *phrases):
    """Exit code 2, one line on stderr naming the problem, nothing that looks like a traceback."""
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "error: " in lines[0] and "Traceback" not in done.stderr
    for phrase in phrases:
        assert phrase in lines[0], (phrase, lines[0])


@pytest.mark.parametrize("argv,phrases", [
    (["-m", "ws_lab.emit", "no-such-kernel"], ["invalid choice: 'no-such-kernel'"]),
    (["-m", "ws_lab.emit", "pipelined", "--shape", "no-such-shape"], ["no-such-shape"]),
    (["-m", "ws_lab.emit", "largehdv", "--shape", "llama8b-4k"],
     ["largehdv does not support llama8b-4k (D 128, Dv 128)", "largehdv-2k (D 64, Dv 512)"]),
    (["-m", "ws_lab.emit", "pipelined", "--dtype", "fp8"], ["--dtype"]),
    (["-m", "ws_lab.emit", "triton-mha", "--postproc"], ["triton-mha is a Triton kernel"]),
    (["-m", "ws_lab.repro", "no_such_pin"], ["unknown repro 'no_such_pin'", "stripe_fragment_layout"]),
    (["bench/coop.py", "--shape", "largehdv-2k"], ["does not support largehdv-2k", "llama8b-4k"]),
    (["bench/coop.py", "--rounds", "0"], ["--rounds", "must be >= 1"]),
    (["bench/coop.py", "--rounds", "many"], ["not an integer"]),
    (["bench/paged.py", "--block-size", "12"], ["--block-size must be a power of two"]),
    (["bench/paged.py", "--config", "1,2"], ["--config takes 4 to 6"]),
    (["bench/decode.py", "--row", "gpt5"], ["no row starts with ['gpt5']", "qwen2.5-0.5b"]),
    (["bench/bwd.py", "--impl", "fa3"], ["--impl 'fa3' is not timed here", "tileops"]),
    (["bench/bwd.py", "--shape", "largehdv-2k"], ["does not support largehdv-2k"]),
], ids=lambda v: " ".join(v) if isinstance(v, list) and v and v[0] != "no" else None)
def test_user_mistakes_are_one_line_and_exit_2(argv, phrases):
    _assert_usage_error(_run(*argv), *phrases)


def test_out_that_is_a_file_is_refused(tmp_path):
    target = tmp_path / "a-file"
    target.write_text("")
    _assert_usage_error(_run("-m", "ws_lab.emit", "pipelined", "--out", str(target)),
                        f"--out {target} is a file")
    _assert_usage_error(_run("-m", "ws_lab.repro", "stripe_fragment_layout", "--out",
                             str(tmp_path)), "is a directory")


@pytest.mark.parametrize("argv,option", [
    (["bench/pipelined.py", "--tune"], "--tune"),
    (["bench/largehdv.py", "--plot", "out.png"], "--plot"),
    (["bench/paged.py", "--sweep"], "--sweep"),
    (["bench/paged.py", "--tune"], "--tune"),
    (["bench/paged.py", "--config", "64,4,2,4"], "--config"),
])
def test_gpu_only_options_are_refused_without_a_gpu(argv, option):
    _no_gpu()
    _assert_usage_error(_run(*argv), f"{option} needs timings", "no CUDA device")


def _described_options(help_text: str) -> dict:
    """--help's options section as {option: its help text}: an option's block runs from its
    line to the next option's; its help is what follows the option and its metavar (on the
    same line after two spaces, or on the lines below)."""
    section = help_text.split("options:", 1)[1]
    described = {}
    for block in filter(str.strip, re.split(r"\n  (?=-)", "\n" + section)):
        head, _, rest = block.strip().partition("\n")
        option_part, _, inline = head.partition("  ")
        described[option_part.split()[0].rstrip(",")] = f"{inline} {rest}".strip()
    return described


@pytest.mark.parametrize("argv", [["bench/coop.py"], ["bench/pipelined.py"], ["bench/paged.py"],
                                  ["bench/decode.py"], ["-m", "ws_lab.emit"],
                                  ["-m", "ws_lab.repro"]],
                         ids=lambda v: " ".join(v))
def test_help_describes_every_argument(argv):
    done = _run(*argv, "--help")
    assert done.returncode == 0, done.stderr
    described = _described_options(done.stdout)
    usage = done.stdout.split("\n\n", 1)[0]
    for option in set(re.findall(r"\[(--[a-z-]+)", usage)) - {"--help"}:
        assert len(described.get(option, "").split()) >= 3, (option, described.get(option))
    if "positional arguments:" in done.stdout:
        positional = done.stdout.split("positional arguments:", 1)[1].split("options:", 1)[0]
        assert len(positional.split()) >= 4, positional  # the name, then what it is


def test_repro_help_describes_its_arguments():
    done = _run("-m", "ws_lab.repro", "--help")
    assert done.returncode == 0
    assert "a pinned behaviour" in done.stdout and "write the bundle to this file" in done.stdout


def test_emit_defaults_to_a_shape_the_kernel_runs_and_takes_short_dtypes():
    assert emit.shape_for("largehdv", None).head_dim_v == 512
    assert emit.shape_for("pipelined", None).name == "llama8b-4k"
    assert emit.shape_for("coop", None, "bf16").dtype == "bfloat16"
    assert emit.shape_for("coop", None, "fp16", causal=False).causal is False
    with pytest.raises(cli.UsageError, match="largehdv does not support gpt2-d64"):
        emit.shape_for("largehdv", "gpt2-d64")


def test_emit_gives_triton_kernels_their_static_report(tmp_path, capfd):
    """triton-mha used to crash emit with an AttributeError; now Triton compiles it for sm_90,
    the report leaves out the fields a Triton cubin does not have, and a status line shows
    progress while it compiles."""
    text = emit.report("triton-mha", shapes.get("gpt2-d64"), tmp_path)
    assert "mha_fwd" in text and "SASS summary" in text and "HGMMA" in text
    assert "None" not in text and "spill stores" not in text
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".cubin", ".cubin", ".sass", ".sass"]
    err = capfd.readouterr().err
    assert "compiling triton-mha on gpt2-d64" in err and "done in" in err


def test_summary_leaves_out_fields_that_do_not_apply():
    summary = sass.SassSummary(registers=64, stack_frame=0, dyn_smem=1024)
    known = summary.format(only_known=True)
    assert "None" not in known and "USETMAXREG" not in known and "WARPGROUP order" not in known
    assert "registers 64, stack 0 B, dynamic smem 1024 B" in known
    assert "spill stores None B" in summary.format()  # the TileLang report keeps every field


def test_status_line_reports_progress(capsys):
    with cli.status("lowering k on s"):
        pass
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "lowering k on s ..." and err[1].startswith("lowering k on s: done in ")


def test_every_rewrite_names_its_pass():
    from tests.cpu.test_postproc import OVERLAP

    _, report = postprocess(OVERLAP)
    assert report and all(r.pass_name == "fence_after_wait" for r in report)
    assert str(report[0]).startswith("[fence_after_wait] main_kernel:")


def _static_json(tmp_path, script, *argv):
    """Runs a bench script with --json on a machine without a GPU; its static-report records."""
    _no_gpu()
    out = tmp_path / "report.json"
    done = _run(script, *argv, "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text())["static_report"], done


def test_bench_json_without_a_gpu_writes_the_static_report(tmp_path):
    records, _ = _static_json(tmp_path, "bench/mha.py", "--shape", "gpt2-d64")
    assert [r["kernel"] for r in records] == ["triton-mha"]
    assert "SASS summary" in records[0]["report"]


def test_paged_static_report_takes_the_block_size(tmp_path):
    records, _ = _static_json(tmp_path, "bench/paged.py", "--block-size", "32")
    assert records and {r["block_size"] for r in records} == {32}
    assert "BLOCK_SIZE': 32" in records[0]["report"]


def test_decode_bench_without_a_gpu_writes_the_fused_kernels_static_report(tmp_path):
    records, done = _static_json(tmp_path, "bench/decode.py", "--row", "qwen")
    assert [(r["heads"], r["kv_heads"], r["head_dim"]) for r in records] == [(14, 2, 64)]
    assert "fused_decode" in records[0]["report"] and "compiling fused_decode" in done.stderr


def test_rollout_bench_without_a_gpu_writes_the_step_kernels_static_report(tmp_path):
    records, done = _static_json(tmp_path, "bench/rollout.py")
    assert [r["kernel"] for r in records] == ["linear_gate_up", "linear_down", "linear_o",
                                              "prefetch_l2", "prefetch_context_l2",
                                              "fused_decode"]
    assert "no CUDA device" in done.stdout and "UBLKPF 1" in records[3]["report"]
    assert "UBLKPF 0" not in records[4]["report"] and "UBLKPF" in records[4]["report"]
    assert "HGMMA: 64x64x16.F32.BF16" in records[0]["report"]


def test_bwd_bench_without_a_gpu_writes_the_backwards_static_report(tmp_path):
    records, _ = _static_json(tmp_path, "bench/bwd.py", "--shape", "train8b-4k", "--dtype",
                              "bf16")
    assert [r["kernel"] for r in records] == ["bwd-pipelined", "bwd-ws"]
    assert all("64x128x16.F32.BF16.RS" in r["report"] for r in records)
    assert "BAR 1," in records[1]["report"]  # bwd-ws: the barriers' init, nothing in its loop


def test_coop_bench_in_fp8_writes_the_fp8_kernels_static_report(tmp_path):
    records, _ = _static_json(tmp_path, "bench/coop.py", "--dtype", "fp8")
    assert [r["kernel"] for r in records] == ["fp8", "fp8-coop", "fp8-coop-persistent", "fp8-coop-rs",
                                              "fp8-coop-rs-vt", "fp8-coop-rs-persistent",
                                              "fp8-coop-rs-desc",
                                              "fp8-coop-rs-persistent-desc"]
    for record in records:
        assert "(causal, float8_e4m3fn)" in record["report"]
        assert "HGMMA: 64x128x32.F32.E4M3.E4M3" in record["report"]
    assert "64x256x32.F32.E4M3.E4M3 x4" in records[0]["report"]  # fp8's 256-key blocks


def test_bench_scripts_import_the_checkout_they_run_from(tmp_path):
    """A decoy ``ws_lab`` first on PYTHONPATH (an installed copy from another checkout) must not
    be the one a bench script imports."""
    decoy = tmp_path / "ws_lab"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise ImportError('the decoy ws_lab was imported')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    for script in sorted((ROOT / "bench").glob("*.py")):
        done = _run(str(script), "--help", cwd=tmp_path, env=env)
        assert done.returncode == 0, (script.name, done.stderr[-1000:])


def test_the_wheel_installs_one_import_package(tmp_path):
    """No top-level ``kernels`` (Hugging Face's package has that name), ``bench`` or
    ``postproc``: the families install as ws_lab.kernels and ws_lab.postproc."""
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    wheel = zipfile.ZipFile(next(tmp_path.glob("ws_lab-*.whl")))
    tops = {name.split("/")[0] for name in wheel.namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"ws_lab"}
    top_level = next(n for n in wheel.namelist() if n.endswith("top_level.txt"))
    assert wheel.read(top_level).decode().split() == ["ws_lab"]
    names = set(wheel.namelist())
    assert {"ws_lab/kernels/decode/paged.py", "ws_lab/postproc/fences.py", "ws_lab/upstream/__init__.py"} <= names
    metadata = wheel.read(next(n for n in names if n.endswith("METADATA"))).decode().splitlines()
    requires = [line for line in metadata if line.startswith("Requires-Dist: matplotlib")]
    assert requires and all("extra == \"plot\"" in r for r in requires)
    import ws_lab

    assert f"Version: {ws_lab.__version__}" in metadata
    assert "License: MIT" in metadata and any(n.endswith("LICENSE") for n in names)


def test_the_harness_imports_no_kernel_family_by_name():
    """Harness modules (ws_lab/*.py) reach kernel families through the registry, never by
    import: a new family adds a registry line, not an import in the runner."""
    offenders = []
    for path in sorted((ROOT / "ws_lab").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [f"{node.module}"] if isinstance(node, ast.ImportFrom) and node.module else [])
            if isinstance(node, ast.ImportFrom) and node.module == "ws_lab":
                names = [f"ws_lab.{a.name}" for a in node.names]
            offenders += [f"{path.name}: {n}" for n in names
                          if n.startswith("ws_lab.kernels") or n.split(".")[0] == "kernels"]
    assert offenders == []


@pytest.mark.parametrize("argv,message", [
    (["bench/rollout.py", "--batch", "0"], "--batch must be at least 1"),
    (["bench/rollout.py", "--new", "-1"], "--new must be at least 1"),
    (["bench/rollout.py", "--prompt", "100000"], "exceed Qwen2.5-0.5B's 32768 positions"),
    (["bench/rollout.py", "--grpo", "--batch", "12"], "multiple of 8"),
    (["bench/rollout.py", "--grpo"], "needs a CUDA device"),
    (["bench/rollout.py", "--json", "."], "is a directory"),
    (["bench/coop.py", "--json", "no/such/folder/out.json"], "does not exist"),
    (["bench/paged.py", "--json", "."], "is a directory"),
    (["bench/decode.py", "--json", "no/such/folder/out.json"], "does not exist"),
    (["bench/pipelined.py", "--plot", "."], "is a directory"),
])
def test_bench_mistakes_are_one_line_before_any_work(argv, message):
    done = _run(str(ROOT / argv[0]), *argv[1:], cwd=ROOT)
    assert done.returncode == 2, done.stderr[-1000:]
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("argv,message", [
    ([], "data-parallel Dr. GRPO step only"),
    (["--grpo", "--grpo-anchors"], "data-parallel Dr. GRPO step only"),
    (["--grpo", "--batch", "8"], "which 2 ranks do not share evenly"),
])
def test_rollout_bench_mistakes_under_torchrun_are_one_line(argv, message):
    """Under torchrun (RANK / WORLD_SIZE set) the bench times the data-parallel step only."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2"}
    done = _run(str(ROOT / "bench/rollout.py"), *argv, cwd=ROOT, env=env)
    assert done.returncode == 2, done.stderr[-1000:]
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_emit_and_repro_path_and_environment_mistakes_are_one_line(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    cases = [
        (["-m", "ws_lab.emit", "pipelined", "--out", str(a_file / "sub")], "is a file"),
        (["-m", "ws_lab.repro", "stripe_fragment_layout", "--out", str(tmp_path / "no" / "x.md")],
         "does not exist"),
        (["-m", "ws_lab.repro", "stripe_fragment_layout", "--script", str(tmp_path / "no" / "r.py")],
         "does not exist"),
        (["-m", "ws_lab.repro", "--against", str(tmp_path / "no-venv")], "no virtual environment"),
    ]
    for argv, phrase in cases:
        _assert_usage_error(_run(*argv, cwd=tmp_path), phrase)


def test_without_nvcc_emit_and_repro_say_so(tmp_path):
    path = os.pathsep.join([os.path.dirname(sys.executable), "/usr/bin", "/bin"])
    if shutil.which("nvcc", path=path):
        pytest.skip("nvcc is on the reduced PATH too")
    env = dict(os.environ, PATH=path)
    for argv in (["-m", "ws_lab.emit", "pipelined"],
                 ["-m", "ws_lab.repro", "stripe_fragment_layout"]):
        _assert_usage_error(_run(*argv, cwd=ROOT, env=env), "needs nvcc on PATH")


def test_a_closed_pipe_is_no_traceback():
    done = subprocess.run(f"{sys.executable} -m ws_lab.repro | head -c 1", shell=True, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr


def test_the_checkouts_kernels_folder_shadows_no_installed_kernels_package():
    """Run from the checkout (its root first on sys.path, as ``python -m`` and the bench scripts
    put it), importing ws_lab leaves ``import kernels`` to Hugging Face's package where it is
    installed (transformers 5.25 requires it and imports it with its models)."""
    import importlib.metadata

    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("Hugging Face's kernels is not installed here")
    done = _run("-c", "import importlib.util, ws_lab; "
                      "print(importlib.util.find_spec('kernels').origin)")
    assert done.returncode == 0, done.stderr[-2000:]
    assert Path(done.stdout.strip()).parent != ROOT / "kernels", done.stdout
