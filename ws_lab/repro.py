"""Repro bundles for upstream TileLang issues.

    python -m ws_lab.repro                 # list the pinned behaviours
    python -m ws_lab.repro NAME [--out F]  # markdown to paste into a TileLang issue
    python -m ws_lab.repro NAME --script repro.py  # and a self-contained script (tilelang only)

The bundle holds the versions, the GPU (if any), the minimal kernel's source, the emitted CUDA
excerpt that shows the behaviour, expected vs actual (with what the kernel computes when a GPU
is present and the pin can run), and the lab's workaround.
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


def bundle(name: str) -> str:
    if name not in names():
        raise ValueError(f"unknown repro {name!r}; known: {', '.join(names())}")
    mod = importlib.import_module(f"ws_lab.upstream.{name}")
    result = mod.check()
    source = mod.lower()
    shows = getattr(mod, "EXCERPT", _EXCERPT)
    body = source[source.rfind("__global__"):]
    excerpt = "\n".join(line for line in body.splitlines() if re.search(shows, line))
    run = getattr(mod, "run", None)
    measured = (f"\n\nOn the GPU ({_gpu()}): {run()}" if run and _gpu() else "")
    return f"""# TileLang: {mod.TITLE}

{inspect.cleandoc(mod.__doc__)}

Related: {mod.UPSTREAM}

## Versions
{_versions()}

## Minimal kernel (pass configs: {mod.PASS_CONFIGS})
```python
{inspect.getsource(mod.kernel)}```

## Emitted CUDA (excerpt)
```cuda
{excerpt}
```

## Expected
{mod.EXPECTED}

## Actual
{result.outcome.value}: {result.detail}{measured}

## Workaround in ws-lab
{mod.WORKAROUND}
"""


_PREAMBLE = '''"""Standalone repro, written by ws-lab (python -m ws_lab.repro {name} --script FILE):
{title}

Needs only tilelang (written against {version}); lowers for sm_90a, no GPU needed. Prints the
outcome and fails its assertion while TileLang shows the behaviour.
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

    if name not in names():
        raise ValueError(f"unknown repro {name!r}; known: {', '.join(names())}")
    mod = importlib.import_module(f"ws_lab.upstream.{name}")
    protocol = "\n\n".join(inspect.getsource(obj) for obj in (Outcome, Result, verdict))
    body = _LAB_IMPORT.sub("", inspect.getsource(mod))
    return (_PREAMBLE.format(name=name, title=mod.TITLE, version=tilelang.__version__)
            + protocol + "\n\n" + body.rstrip() + "\n" + _MAIN)


def _main(argv):
    ap = cli.ArgumentParser(prog="python -m ws_lab.repro", description=__doc__.splitlines()[0])
    ap.add_argument("name", nargs="?",
                    help="a pinned behaviour (without it: list them); known: " + ", ".join(names()))
    ap.add_argument("--out", type=Path,
                    help="write the bundle to this file instead of standard output")
    ap.add_argument("--script", type=Path,
                    help="also write the pin as a self-contained repro.py (only tilelang needed)")
    args = ap.parse_args(argv)
    if not args.name:
        print("\n".join(names()))
        return
    if args.name not in names():
        raise cli.UsageError(f"unknown repro {args.name!r}; known: {', '.join(names())}")
    for option, path in (("--out", args.out), ("--script", args.script)):
        if path is not None and path.is_dir():
            raise cli.UsageError(f"{option} {path} is a directory; give a file path")
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
