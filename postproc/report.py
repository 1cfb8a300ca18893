"""What a post-processor pass returns, and what it raises on code it does not know."""
from dataclasses import dataclass, replace


class PostprocError(ValueError):
    """The emitted CUDA does not match the pattern a pass knows; nothing was rewritten."""


@dataclass(frozen=True)
class Rewrite:
    kernel: str
    line: int  # of the rewritten statement (the wait) in the rewritten source, 1-based
    before: str
    after: str
    pass_name: str = ""  # the pass that made it (``postprocess`` fills it in)

    def __str__(self):
        return (f"[{self.pass_name}] {self.kernel}:{self.line}: {self.before.strip()}  ->  "
                f"{self.after.strip()}")

    def by(self, pass_name: str) -> "Rewrite":
        return replace(self, pass_name=pass_name)
