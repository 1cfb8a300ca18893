"""Hugging Face attention on the lab's op: after ``register()``, a model built or switched to
``attn_implementation="ws_lab"`` runs its attention layers on ``torch.ops.ws_lab.attention``
(``kernels/bwd/attention_op.py``: the TileLang forward with lse, the TileLang backward). It
is for the Dr. GRPO update's scoring forward and backward (issue #47: D 64, Hq 14 / Hkv 2,
causal, the row where the lab's backward leads every peer: notes/bwd.md, "Session 36"). Under
``torch.compile`` the step ran faster on SDPA (notes/rollout.md, "Session 40, later"), but those
runs broke the graph at every layer, at an import since moved into ``register`` ("Session 45").

Only what the op computes is taken: self-attention over the whole sequence with no mask (no
padding; HF passes none for an unpadded causal batch once ``register`` has given the
implementation SDPA's mask function), no dropout, no softcap, no sliding window. Anything
else is refused with a ValueError naming it, before a launch.
"""
from __future__ import annotations

import torch

NAME = "ws_lab"


def lab_attention(q, k, v, causal: bool, softmax_scale):
    """BSHD attention out of the lab's autograd op (q (B, S, Hq, D), k / v (B, S, Hkv, D));
    ``register()`` defines the op. No import here: inside a compiled stack one broke the graph
    at every layer (notes/rollout.md "Session 45")."""
    return torch.ops.ws_lab.attention(q, k, v, causal, softmax_scale)[0]


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """HF's attention-function interface: query (B, Hq, S, D), key / value (B, Hkv, S, D) ->
    ((B, S, Hq, D), no weights)."""
    _refuse_what_the_op_cannot_do(module, query, key, attention_mask, dropout, kwargs)
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    q, k, v = (t.transpose(1, 2).contiguous() for t in (query, key, value))
    return lab_attention(q, k, v, causal, scaling), None


def _refuse_what_the_op_cannot_do(module, query, key, attention_mask, dropout, kwargs):
    name = type(module).__name__
    if attention_mask is not None:
        raise ValueError(f"{NAME} attention ({name}) takes no attention mask: the batch must be "
                         "unpadded (give every sequence the same length) or use sdpa")
    if dropout and module.training:
        raise ValueError(f"{NAME} attention ({name}) has no dropout; got dropout={dropout}")
    for option in ("softcap", "sliding_window"):
        if kwargs.get(option) is not None:
            raise ValueError(f"{NAME} attention ({name}) has no {option}; got "
                             f"{option}={kwargs[option]}")
    if query.shape[2] != key.shape[2]:
        raise ValueError(f"{NAME} attention ({name}) is self-attention over the whole sequence: "
                         f"{query.shape[2]} queries against {key.shape[2]} keys (a KV cache) "
                         "is not supported")


def causal_mask_or_none(*args, **kwargs):
    """HF's mask interface for ``NAME``: None for a batch with no padding mask under the plain
    causal mask function (the op is causal itself), else SDPA's mask, which
    ``attention_forward`` refuses. SDPA's own skip of that mask is off under ``torch.compile``
    before torch 2.14 (transformers' ``_ignore_causal_mask_sdpa``), which made a compiled
    scoring stack refuse every batch (notes/rollout.md, "Session 40, later")."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if (kwargs.get("attention_mask") is None
            and kwargs.get("mask_function", causal_mask_function) is causal_mask_function):
        return None
    return sdpa_mask(*args, **kwargs)


def register() -> str:
    """Defines ``torch.ops.ws_lab.attention`` and registers ``NAME`` with HF's attention and
    mask interfaces (``causal_mask_or_none``); returns the name for ``attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from ws_lab import registry

    registry.decode("attention_op")  # its import defines torch.ops.ws_lab.attention
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, causal_mask_or_none)
    return NAME
