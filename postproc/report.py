"""What a post-processor pass returns, and what it raises on code it does not know."""
from dataclasses import dataclass


class PostprocError(ValueError):
    """The emitted CUDA does not match the pattern a pass knows; nothing was rewritten."""


@dataclass(frozen=True)
class Rewrite:
    kernel: str
    line: int  # of the rewritten statement (the wait) in the rewritten source, 1-based
    before: str
    after: str

    def __str__(self):
        return f"{self.kernel}:{self.line}: {self.before.strip()}  ->  {self.after.strip()}"
