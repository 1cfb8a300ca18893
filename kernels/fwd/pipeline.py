"""The K/V ring's pipeline state (FA-CuTe's ``PipelineState``; CUTLASS's ``PipelineState``): the
n-th block a CTA streams sits in stage n mod stages, and its barrier's phase flips every time
the ring wraps. Every producer and consumer of the lab computes (stage, phase) here, so the
two sides cannot disagree on the arithmetic."""
from dataclasses import dataclass


@dataclass(frozen=True)
class KVRing:
    """A ring of ``stages`` shared-memory buffers; ``n`` counts blocks streamed through it (a
    TileLang expression or a Python int)."""
    stages: int

    def stage(self, n):
        return n % self.stages

    def phase(self, n):
        """The parity a consumer waits for on block n's full barrier (the producer waits for
        the opposite parity on its empty barrier)."""
        return (n // self.stages) % 2

    def at(self, n):
        """(stage, phase) of block n."""
        return self.stage(n), self.phase(n)
