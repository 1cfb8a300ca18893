"""Minimal kernels pinning TileLang behaviours the lab works around (one module per issue).

Each module gives ``kernel()`` (the ≤ 40-line prim_func builder showing the behaviour),
``control()`` (the nearest kernel that TileLang gets right), ``check() -> Result`` (one of three
outcomes, below, read from both), ``TITLE``, ``TRIAGE`` (one of ``TRIAGES``), ``IMPACT`` (what
it costs, measured where it could be), ``LINKS`` (related upstream issues and PRs),
``EXPECTED`` and ``WORKAROUND``; optionally ``EXCERPT`` (a regex: the emitted lines the bundle
quotes) and ``run() -> str`` (what the kernel computes on a GPU; the bundle adds it when one is
present). A module's text is written for TileLang's maintainers: it goes into the bundle. ``tests/upstream`` asserts ``check()`` (and ``run()`` on a GPU) under strict
xfail; ``python -m ws_lab.repro NAME`` writes the bundle to paste into a TileLang issue.

A check reads the emitted code for the bug's signature and says one of three things: the
signature is there and the control shows the expected form (``Outcome.BUG``), the kernel shows
the expected form too (``Outcome.FIXED``), or neither can be found, or the control fails (``Outcome.MISSING``: codegen changed, so the pin must be rechecked). The
tests turn them into a ``StillBroken`` (the only exception their strict xfail accepts), a pass
(a strict xfail then fails as XPASS: the fix is reported), or a ``SignatureMissing`` error —
so neither a fix nor a change of codegen can hide behind the xfail.
"""
import enum
from dataclasses import dataclass

# wrong code: TileLang emits code that computes wrong values; latent UB: undefined behaviour
# nvcc compiles as intended today; enhancement: by design, asked to change; rejects valid
# code: an error raised by TileLang itself (not a refusal by design)
TRIAGES = ("wrong code", "latent UB", "enhancement", "rejects valid code")


class Outcome(enum.Enum):
    BUG = "bug signature found"
    FIXED = "fixed"
    MISSING = "signature missing"


@dataclass(frozen=True)
class Result:
    outcome: Outcome
    detail: str

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.FIXED


class StillBroken(AssertionError):
    """The pin's bug signature is in the emitted code (what a strict xfail expects)."""


class SignatureMissing(RuntimeError):
    """Neither the bug's signature nor the fixed form is in the emitted code."""


def verdict(bug: bool, fixed: bool, detail: str) -> Result:
    """The outcome from two readings of the code; a reading that finds neither is MISSING."""
    if fixed and not bug:
        return Result(Outcome.FIXED, detail)
    if bug and not fixed:
        return Result(Outcome.BUG, detail)
    return Result(Outcome.MISSING, detail)


def expect_fixed(result: Result) -> None:
    """Raises StillBroken or SignatureMissing unless the check found the fixed form."""
    if result.outcome is Outcome.BUG:
        raise StillBroken(result.detail)
    if result.outcome is Outcome.MISSING:
        raise SignatureMissing(f"codegen changed: recheck this pin ({result.detail})")


def lower_sm90a(prim_func, pass_configs) -> str:
    """The CUDA TileLang emits for ``prim_func`` on sm_90a (no GPU needed)."""
    import tilelang
    import tvm

    from ws_lab.target import SM90A

    target = tvm.target.Target(SM90A)
    with tilelang.transform.PassContext(config=pass_configs), target:
        return tilelang.lower(prim_func, target=target).kernel_source
