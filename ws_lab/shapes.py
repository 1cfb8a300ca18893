"""Named attention shapes. Each carries its default mask; ``--causal {0,1,both}`` overrides it."""
from __future__ import annotations

from dataclasses import dataclass, replace

# --dtype's names: the element type of q, k, v
DTYPES = {"float16": "float16", "fp16": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    heads: int
    kv_heads: int
    seq_len: int
    head_dim: int
    head_dim_v: int
    causal: bool
    dtype: str = "float16"

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    def with_mask(self, causal: bool) -> "Shape":
        return replace(self, causal=causal)

    def with_dtype(self, dtype: str) -> "Shape":
        return replace(self, dtype=dtype)

    def flops(self) -> float:
        """Forward FLOPs: 2·S²·(D + Dv) per (batch, head), halved for causal."""
        full = 2.0 * self.batch * self.heads * self.seq_len ** 2 * (self.head_dim + self.head_dim_v)
        return full / 2 if self.causal else full

    def min_bytes(self) -> int:
        """Each of q, k, v read once and out written once (2-byte elements)."""
        s, b = self.seq_len, self.batch
        elems = b * s * (self.heads * self.head_dim + self.kv_heads * self.head_dim
                         + self.kv_heads * self.head_dim_v + self.heads * self.head_dim_v)
        return 2 * elems


def _llama8b(name, seq_len, batch=1, causal=True):
    return Shape(name, batch, 32, 8, seq_len, 128, 128, causal)


SHAPES: dict[str, Shape] = {s.name: s for s in [
    _llama8b("llama8b-1k", 1024),
    _llama8b("llama8b-4k", 4096),
    _llama8b("llama8b-8k", 8192),
    _llama8b("llama8b-16k", 16384),
    _llama8b("train8b-4k", 4096, batch=2, causal=False),
    _llama8b("train8b-8k", 8192, batch=2, causal=False),
    Shape("largehdv-1k", 2, 32, 32, 1024, 64, 512, False),
    Shape("largehdv-2k", 2, 32, 32, 2048, 64, 512, False),
    Shape("gpt2-d64", 16, 12, 12, 512, 64, 64, False),
    Shape("d64-4k", 2, 32, 32, 4096, 64, 64, False),
    Shape("d256-4k", 2, 16, 16, 4096, 256, 256, False),
]}


def register(shape: Shape) -> Shape:
    """Adds a bench script's own shape (e.g. bench/mha.py's LLaMA-7B sweep) to the registry."""
    SHAPES.setdefault(shape.name, shape)
    return shape


def get(name: str) -> Shape:
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}") from None


def masks(shape: Shape, causal: str | None) -> list[Shape]:
    """Expand a ``--causal`` choice ('0', '1', 'both' or None for the default) for one shape."""
    if causal is None:
        return [shape]
    choices = {"0": [False], "1": [True], "both": [False, True]}
    if causal not in choices:
        raise ValueError(f"--causal must be 0, 1 or both, got {causal!r}")
    return [shape.with_mask(c) for c in choices[causal]]
