"""The GEMM weights of a HF ``Qwen2ForCausalLM`` as the lab's forwards read them: grouped as the
decode step runs them (q|k|v, o, gate|up, down), and packed back to back in one buffer that the
HF parameters become views of (``shared_weights``), so the decode step (``model.py``) and the
training decoder (``train_stack.py``) read one copy that every optimizer step updates."""
from __future__ import annotations

import weakref

import torch

GEMM_WEIGHTS = ("qkv_w", "o_w", "gate_up_w", "down_w")  # in the order a layer runs them


def gemm_params(layer) -> dict:
    """A HF decoder layer's GEMM weights, grouped as the decode step runs them
    (``GEMM_WEIGHTS``); a group's weights are stacked along their output rows."""
    att, mlp = layer.self_attn, layer.mlp
    return {"qkv_w": (att.q_proj.weight, att.k_proj.weight, att.v_proj.weight),
            "o_w": (att.o_proj.weight,),
            "gate_up_w": (mlp.gate_proj.weight, mlp.up_proj.weight),
            "down_w": (mlp.down_proj.weight,)}


def qkv_biases(layer) -> tuple:
    att = layer.self_attn
    return att.q_proj.bias, att.k_proj.bias, att.v_proj.bias


# HF model -> (GEMM weights, q|k|v biases): the buffers its parameters are views of
_SHARED = weakref.WeakKeyDictionary()


def shared_weights(hf_model) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat GEMM weights, flat q|k|v biases) of a HF Qwen2 model, in the decode step's order.
    The first call copies the weights in and points the model's parameters at views of the
    buffers (``Parameter.data``: the optimizer's references stay valid), so every later
    update of the HF model is an update of the buffers; decode models built later on the same
    HF model reuse them (notes/rollout.md, "Session 43")."""
    layers = hf_model.model.layers
    weights = [p for layer in layers for name in GEMM_WEIGHTS for p in gemm_params(layer)[name]]
    biases = [b for layer in layers for b in qkv_biases(layer)]
    shared = _SHARED.get(hf_model)
    if shared is None or not all(map(_views_of, (weights, biases), shared)):
        shared = (_repoint(weights), _repoint(biases))
        _SHARED[hf_model] = shared
    return shared


def _repoint(params) -> torch.Tensor:
    """``params`` copied back to back into one new buffer, each then a view of it."""
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    at = 0
    for p in params:
        p.data = flat[at:at + p.numel()].view(p.shape)
        at += p.numel()
    return flat


def _views_of(params, flat) -> bool:
    """Whether ``params`` are still the back-to-back views of ``flat`` (``_repoint``)."""
    at = 0
    for p in params:
        if p.data_ptr() != flat.data_ptr() + at * flat.element_size() or not p.is_contiguous():
            return False
        at += p.numel()
    return at == flat.numel()
