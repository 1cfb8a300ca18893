"""Token sampling on the device, inside the captured step: no host sync, shapes fixed.

``Sampling(temperature=0)`` is greedy. Otherwise top-k (keep the k largest), logits /
temperature, top-p (keep the smallest set of tokens whose probability reaches p), then the
Gumbel-max draw: argmax(logits − log(−log u)), u ~ U(0, 1) from torch's generator, which CUDA
graphs replay with a fresh offset each time. (Top-k before the temperature selects the same
tokens: dividing by a positive temperature keeps their order.) Top-k without top-p on CUDA
runs kernels/step/sampling.py's two launches (the same draw: the k largest, then Gumbel-max).
"""
import math
from dataclasses import dataclass

import torch

from ws_lab import registry


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off

    def __post_init__(self):
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise TypeError(f"top_k must be an int, got {type(self.top_k).__name__} {self.top_k!r}")
        # NaN fails every comparison: written so that it is refused, not passed
        if not (self.temperature >= 0 and self.top_k >= 0 and 0 < self.top_p <= 1
                and math.isfinite(self.temperature)):
            raise ValueError(f"temperature ≥ 0 (finite), top_k ≥ 0 and 0 < top_p ≤ 1; got {self}")


def sample(logits: torch.Tensor, cfg: Sampling, chunk_max: torch.Tensor | None = None,
           seed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """(B, V) logits (any float dtype) -> (B,) int64 token ids. With top-k the draw happens on
    the k largest only (torch.topk returns them sorted, so top-p needs no sort of the vocab):
    at a 151936-token vocabulary every full-vocabulary pass costs ~19 µs at B 64 (notes/rollout.md:
    Session 15's profile), and this path makes one. ``chunk_max``: the per-chunk maxima the
    top-k kernel would compute first, when the logits' producer wrote them (``DecodeModel``).
    ``seed``: the top-k kernel's (base, counter) device seed (kernels/step/sampling.py), which the
    decode loop advances with its step counter; the torch paths draw from torch's generator."""
    if cfg.temperature == 0:
        return logits.argmax(dim=-1)
    if cfg.top_k and cfg.top_p == 1:
        kernels = registry.decode("sampling")
        if kernels.supports(logits, cfg.top_k):  # two launches instead of torch.topk's radix passes
            return kernels.top_k_sample(logits, cfg.top_k, cfg.temperature, chunk_max, seed)
    if cfg.top_k:
        values, ids = torch.topk(logits, min(cfg.top_k, logits.shape[-1]), dim=-1)
        return ids.gather(-1, _draw(values.float() / cfg.temperature, cfg.top_p, ordered=True))[:, 0]
    return _draw(logits.float() / cfg.temperature, cfg.top_p, ordered=False)[:, 0]


def _draw(logits, top_p, ordered):
    """Gumbel-max over the columns (after top-p); (B, 1) column index."""
    if top_p < 1:
        if ordered:
            probs = torch.softmax(logits, dim=-1)
            logits = logits.masked_fill(probs.cumsum(dim=-1) - probs > top_p, float("-inf"))
        else:
            ordered_logits, order = torch.sort(logits, dim=-1, descending=True)
            probs = torch.softmax(ordered_logits, dim=-1)
            drop = probs.cumsum(dim=-1) - probs > top_p  # the mass before the token reaches p
            logits = logits.scatter(-1, order, ordered_logits.masked_fill(drop, float("-inf")))
    uniform = torch.rand_like(logits).clamp_(min=1e-20)
    return (logits - torch.log(-torch.log(uniform))).argmax(dim=-1, keepdim=True)
