"""CUDA-source post-processor for TileLang's emitted code (fence/wait ordering).

``postprocess(code)`` returns the rewritten source and a report of every rewrite. No pass is
registered yet: the wgmma fence/wait pass arrives with the IntraWGOverlap kernel, and until then
the post-processed source is the emitted source and the report is empty.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rewrite:
    kernel: str
    line: int
    before: str
    after: str

    def __str__(self):
        return f"{self.kernel}:{self.line}: {self.before.strip()}  ->  {self.after.strip()}"


def postprocess(code: str) -> tuple[str, list[Rewrite]]:
    return code, []
