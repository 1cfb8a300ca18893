"""The lab's command-line contract, shared by ``python -m ws_lab.emit``, ``python -m
ws_lab.repro`` and ``bench/*.py``: a user mistake (unknown kernel, shape or bundle, a bad
``--out``, a shape the kernel does not support, an option that needs a GPU) is one line on
stderr and exit code 2, never a traceback."""
from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager


class UsageError(Exception):
    """A mistake in how the command was called; ``main`` turns it into one line and exit 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line (``prog: error: ...``) and exit code 2, without the
    usage block; ``--help`` still shows every argument."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(entry, argv=None, prog: str | None = None):
    """Runs ``entry(argv)``; a ``UsageError`` becomes ``prog: error: ...`` and exit code 2."""
    try:
        return entry(argv)
    except UsageError as exc:
        print(f"{prog or sys.argv[0]}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except BrokenPipeError:  # the reader left (``| head``): no traceback, nothing more to say
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1) from None


def unsupported(kernel: str, shape, supported: list) -> UsageError:
    """The refusal for a shape a kernel cannot run: names the shape and what the kernel runs."""
    runs = ", ".join(f"{s.name} (D {s.head_dim}, Dv {s.head_dim_v})" for s in supported)
    return UsageError(f"{kernel} does not support {shape.name} (D {shape.head_dim}, Dv "
                      f"{shape.head_dim_v}); it runs {runs or 'no registered shape'}")


def out_file(path, option: str = "--json") -> None:
    """Refuses, before any work, an output file the run could not write at its end: a
    directory, or one whose folder does not exist."""
    if path is None:
        return
    if path.is_dir():
        raise UsageError(f"{option} {path} is a directory; give a file path")
    if not path.parent.is_dir():
        raise UsageError(f"{option} {path}: the folder {path.parent} does not exist")


def out_dir(path) -> None:
    """Refuses an ``--out`` that exists and is not a directory, or one that could not be
    created because a file stands where one of its folders would."""
    if path is None:
        return
    if path.exists() and not path.is_dir():
        raise UsageError(f"--out {path} is a file; give a directory (it is created if missing)")
    ancestor = next(p for p in path.parents if p.exists())
    if not ancestor.is_dir():
        raise UsageError(f"--out {path}: {ancestor} is a file, so the directory cannot be made")


def require_nvcc(what: str) -> None:
    """An environment problem, said before the work starts: ``what`` compiles with nvcc."""
    import shutil

    if shutil.which("nvcc") is None:
        raise UsageError(f"{what} needs nvcc on PATH to compile the emitted CUDA, and it is not "
                         "there (the CUDA toolkit, 12.4 or newer)")


@contextmanager
def status(what: str):
    """A status line on stderr around a slow step (TileLang lowers a kernel in 5-30 s)."""
    start = time.perf_counter()
    print(f"{what} ...", file=sys.stderr, flush=True)
    yield
    print(f"{what}: done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
