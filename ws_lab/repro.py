"""Repro bundles for upstream TileLang issues.

    python -m ws_lab.repro                 # list the pinned behaviours
    python -m ws_lab.repro NAME [--out F]  # markdown to paste into a TileLang issue
    python -m ws_lab.repro NAME --script repro.py  # and a self-contained script (tilelang only)
    python -m ws_lab.repro --against SPEC  # every pin under another TileLang: which flip

The bundle opens with its triage (wrong code, latent UB, enhancement) and measured impact, links
the related upstream issues, and holds the versions, the self-contained repro.py and what it
prints, the control kernel, the emitted CUDA of both, ptxas/SASS facts for the fence pins, the
expected form and a workaround. Nothing in it refers to this repository.
"""
import importlib
import inspect
import pkgutil
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

from ws_lab import cli, upstream


_EXCERPT = r"buf_dyn_shmem \+|__syncthreads|wgmma|fence_operand|fence_proxy_async|warpgroup_arrive"


def _gpu() -> str | None:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(upstream.__path__))


def _versions() -> str:
    import tilelang
    import torch
    import triton

    nvcc = shutil.which("nvcc")
    nvcc_version = (subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
                    .strip().splitlines()[-1] if nvcc else "not found")
    gpu = _gpu() or "none (lowered on CPU)"
    return (f"- tilelang {tilelang.__version__}, torch {torch.__version__}, triton "
            f"{triton.__version__}, Python {platform.python_version()}\n- nvcc: {nvcc_version}\n"
            f"- GPU: {gpu}; target sm_90a")


FENCE_PINS = ("fence_operand_num_regs", "gemm_fence_two_warpgroups", "wgmma_fence_before_wait",
              "fence_proxy_for_unrelated_smem")


def pin_module(name: str):
    if name not in names():
        raise ValueError(f"unknown repro {name!r}; known: {', '.join(names())}")
    return importlib.import_module(f"ws_lab.upstream.{name}")


def _excerpt(source: str, shows: str) -> str:
    body = source[source.rfind("__global__"):]
    return "\n".join(line for line in body.splitlines() if re.search(shows, line))


def control_configs(mod) -> dict:
    """The pass configs the control is lowered with (the kernel's, unless the module says)."""
    return getattr(mod, "CONTROL_PASS_CONFIGS", mod.PASS_CONFIGS)


def configs_as_code(configs: dict) -> str:
    return "{" + ", ".join(f"tilelang.PassConfigKey.{key.name}: {value!r}"
                           for key, value in configs.items()) + "}"


def sass_facts(mod) -> str:
    """ptxas -v and SASS of the kernel against its control, compiled as TileLang compiles them
    (nvcc 13, sm_90a): registers, spills, HGMMA, WARPGROUP order, proxy fences, and whether
    the two instruction streams differ beyond the kernel's own code."""
    import tempfile

    from ws_lab import emit, sass
    from ws_lab.upstream import lower_sm90a

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, func, configs in (("kernel", mod.kernel(), mod.PASS_CONFIGS),
                                     ("control", mod.control(), control_configs(mod))):
            cubin = Path(tmp) / f"{label}.cubin"
            ptxas = emit.nvcc_cubin(lower_sm90a(func, configs), cubin)
            text = sass.dump_sass(cubin)
            summary = sass.parse_ptxas(ptxas, sass.summarize_sass(text))
            ops = [i.split()[0] for i in sass.sass_instructions(text) if i.split()]
            rows.append((label, summary, ops))
    lines = []
    for label, summary, ops in rows:
        hgmma = ", ".join(f"{k} ×{n}" for k, n in sorted(summary.hgmma.items())) or "none"
        lines.append(f"- {label}: {summary.registers} registers, spill stores "
                     f"{summary.spill_stores} B, spill loads {summary.spill_loads} B, stack "
                     f"{summary.stack_frame} B; HGMMA {hgmma}; WARPGROUP "
                     f"{' '.join(summary.warpgroup_sync) or 'none'}; FENCE.VIEW.ASYNC.S "
                     f"{sum(op.startswith('FENCE.VIEW.ASYNC.S') for op in ops)}; "
                     f"{len(ops)} instructions")
    same = rows[0][2] == rows[1][2]
    lines.append(f"- instruction streams {'identical' if same else 'differ'} "
                 f"(opcodes in program order)")
    return "\n".join(lines)


def bundle(name: str) -> str:
    """The report to paste into a TileLang issue: triage and impact first, the self-contained
    repro.py, what it prints here, the control, the emitted code of both, the SASS facts of the
    fence pins."""
    import tilelang

    from ws_lab.upstream import lower_sm90a

    mod = pin_module(name)
    result = mod.check()
    shows = getattr(mod, "EXCERPT", _EXCERPT)
    run = getattr(mod, "run", None)
    measured = f"\n\nOn the GPU ({_gpu()}): {run()}" if run and _gpu() else ""
    facts = (f"\n## ptxas -v / SASS, kernel and control (nvcc, sm_90a)\n{sass_facts(mod)}\n"
             if name in FENCE_PINS else "")
    links = "\n".join(f"- {link}" for link in mod.LINKS)
    return f"""# TileLang: {mod.TITLE}

**Triage: {mod.TRIAGE}.** Impact: {mod.IMPACT}.

Related upstream:
{links}

{inspect.cleandoc(mod.__doc__)}

## Environment
{_versions()}

## Reproduce
Save as `repro.py`; `python repro.py` needs only `pip install tilelang` (lowers for sm_90a, no
GPU). It prints the outcome and fails its assertion while TileLang shows the behaviour.
```python
{script(name)}```

Output here:
```
tilelang {tilelang.__version__}: {result.outcome.value}: {result.detail}
```{measured}

## The control (what works)
Pass configs: kernel `{configs_as_code(mod.PASS_CONFIGS)}`, control
`{configs_as_code(control_configs(mod))}`.
```python
{inspect.getsource(mod.control)}```

## Emitted CUDA (excerpt): kernel
```cuda
{_excerpt(mod.lower(), shows)}
```

## Emitted CUDA (excerpt): control
```cuda
{_excerpt(lower_sm90a(mod.control(), control_configs(mod)), shows)}
```
{facts}
## Expected
{mod.EXPECTED}

## Workaround
{mod.WORKAROUND}
"""


_PREAMBLE = '''"""Standalone TileLang repro: {title}

Triage: {triage}. Needs only tilelang (written against {version}); lowers for sm_90a, no GPU
needed. Prints the outcome and fails its assertion while TileLang shows the behaviour.
"""
import enum
from dataclasses import dataclass

import tilelang
import tvm

SM90A = {{"kind": "cuda", "arch": "sm_90a"}}


def lower_sm90a(prim_func, pass_configs):
    """The CUDA TileLang emits for ``prim_func`` on sm_90a."""
    target = tvm.target.Target(SM90A)
    with tilelang.transform.PassContext(config=pass_configs), target:
        return tilelang.lower(prim_func, target=target).kernel_source


def compile_sm90a(func, pass_configs=None):
    return tilelang.compile(func, target=SM90A, pass_configs=pass_configs)


'''

_MAIN = '''

if __name__ == "__main__":
    result = check()
    print(f"tilelang {tilelang.__version__}: {result.outcome.value}: {result.detail}")
    assert result.outcome is Outcome.FIXED, f"{TITLE}: {result.detail}"
'''

# the pin modules' lab imports, which the preamble above replaces
_LAB_IMPORT = re.compile(r"^\s*from ws_lab\.[\w.]+ import .*\n", re.MULTILINE)


def script(name: str) -> str:
    """A self-contained ``repro.py`` for one pin: the preamble (lowering for sm_90a, the three
    outcomes), the pin's module without its lab imports, and a main that runs its check."""
    import tilelang

    from ws_lab.upstream import Outcome, Result, verdict

    mod = pin_module(name)
    protocol = "\n\n".join(inspect.getsource(obj) for obj in (Outcome, Result, verdict))
    body = _LAB_IMPORT.sub("", inspect.getsource(mod))
    return (_PREAMBLE.format(title=mod.TITLE, triage=mod.TRIAGE, version=tilelang.__version__)
            + protocol + "\n\n" + body.rstrip() + "\n" + _MAIN)


class InstallError(Exception):
    """``--against``'s TileLang could not be installed (an environment problem, one line)."""


def _check_against(spec: str) -> None:
    """A SPEC written as a path must be an existing virtual environment."""
    looks_like_path = spec.startswith(("/", "./", "../", "~")) and "://" not in spec
    if looks_like_path and not (Path(spec).expanduser() / "bin" / "python").exists():
        raise cli.UsageError(f"--against {spec}: no virtual environment there (no bin/python)")


def _interpreter(spec: str, workdir: Path) -> str:
    """The Python that has ``spec``'s TileLang: an existing virtual environment's, or a fresh
    one's (``python -m venv``, then ``pip install SPEC``: a version pin, a wheel, or a
    ``git+https://…`` source that pip can build here)."""
    given = Path(spec) / "bin" / "python"
    if given.exists():
        return str(given)
    venv = workdir / ("venv-" + re.sub(r"[^\w.=-]+", "_", spec))
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        done = subprocess.run([str(python), "-m", "pip", "install", "-q", spec],
                              capture_output=True, text=True)
        if done.returncode:
            shutil.rmtree(venv)
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise InstallError(f"--against {spec}: pip install failed: {last}")
    return str(python)


_SCRIPT_LINE = re.compile(r"^tilelang (\S+): (" + "|".join(o.value for o in upstream.Outcome)
                          + r"): (.*)$", re.MULTILINE)


def against(spec: str, workdir: Path) -> list[tuple[str, str, str, str]]:
    """Runs every pin's standalone script under ``spec``'s TileLang (a clean interpreter: no
    PYTHONPATH, nothing of this checkout) and returns (pin, outcome here, outcome there,
    TileLang version there) per pin."""
    import os

    workdir.mkdir(parents=True, exist_ok=True)
    python = _interpreter(spec, workdir)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    rows = []
    for name in names():
        path = workdir / f"{name}.py"
        path.write_text(script(name))
        done = subprocess.run([python, path.name], capture_output=True, text=True, cwd=workdir,
                              env=env)
        found = _SCRIPT_LINE.search(done.stdout)
        there = (found.group(2) if found else
                 f"error: {(done.stderr.strip().splitlines() or ['no output'])[-1][:120]}")
        rows.append((name, pin_module(name).check().outcome.value, there,
                     found.group(1) if found else "?"))
    return rows


def _print_against(rows, spec):
    import tilelang

    print(f"| pin | tilelang {tilelang.__version__} (here) | {spec} | flipped |")
    print("|---|---|---|---|")
    for name, here, there, version in rows:
        print(f"| {name} | {here} | {there} (tilelang {version}) | "
              f"{'yes' if here != there else 'no'} |")
    flipped = [r[0] for r in rows if r[1] != r[2]]
    print(f"\n{len(flipped)} of {len(rows)} pins flip" + (f": {', '.join(flipped)}" if flipped
                                                          else ""))


def _main(argv):
    ap = cli.ArgumentParser(prog="python -m ws_lab.repro", description=__doc__.splitlines()[0])
    ap.add_argument("name", nargs="?",
                    help="a pinned behaviour (without it: list them); known: " + ", ".join(names()))
    ap.add_argument("--out", type=Path,
                    help="write the bundle to this file instead of standard output")
    ap.add_argument("--script", type=Path,
                    help="also write the pin as a self-contained repro.py (only tilelang needed)")
    ap.add_argument("--against", metavar="SPEC",
                    help="run every pin under another TileLang and print which flip: a pip "
                         "requirement (tilelang==0.1.14, a wheel, git+https://…), installed "
                         "into a fresh venv under --workdir, or an existing venv's directory")
    ap.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "ws_lab" / "against",
                    help="where --against keeps its venvs and scripts (default %(default)s)")
    args = ap.parse_args(argv)
    if args.against:
        if args.name:
            raise cli.UsageError("--against runs every pin; give no NAME")
        _check_against(args.against)
        try:
            rows = against(args.against, args.workdir)
        except InstallError as exc:
            raise cli.UsageError(str(exc)) from None
        return _print_against(rows, args.against)
    if not args.name:
        print("\n".join(names()))
        return
    if args.name not in names():
        raise cli.UsageError(f"unknown repro {args.name!r}; known: {', '.join(names())}")
    for option, path in (("--out", args.out), ("--script", args.script)):
        cli.out_file(path, option)
    cli.require_nvcc("a repro bundle (its SASS facts)")
    if args.script:
        args.script.write_text(script(args.name))
        print(f"wrote {args.script}")
    text = bundle(args.name)
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}")
    else:
        sys.stdout.write(text)


def main(argv=None):
    cli.main(_main, argv, "python -m ws_lab.repro")


if __name__ == "__main__":
    main()
