"""Every attention kernel of the lab, by name, with ``supports(shape)``: a forward
(``attention(q, k, v, causal=False, softmax_scale=None, out=None) -> out``, BSHD, fp16/bf16 on
CUDA), a backward (``backward(q, k, v, out, dout, lse, causal, softmax_scale) -> (dq, dk,
dv)``) or an FP8 forward (kind "fp8": e4m3 inputs with descales, its module's
``attention_fp8``).

A TileLang kernel also gives ``prim_func(shape)`` so that ``ws_lab.emit`` can lower it
without a GPU. A new kernel adds one ``_register`` line here.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Callable

from ws_lab.shapes import Shape


@dataclass(frozen=True)
class Kernel:
    name: str
    module: str  # import path of the kernel family's file, loaded on first use
    options: tuple = ()  # (keyword, value) pairs selecting a variant of the family
    kind: str = "fwd"  # "fwd" (``attention``), "bwd" (``backward``) or "fp8"

    def _mod(self):
        return importlib.import_module(self.module)

    def module_object(self):
        """The kernel family's module (for family-specific tools such as a config sweep)."""
        return self._mod()

    @property
    def attention(self) -> Callable:
        self._require("fwd")
        return functools.partial(self._mod().attention, **dict(self.options))

    @property
    def fp8_attention(self) -> Callable:
        """An FP8 kernel's op: e4m3 q, k, v with (B, Hkv) descales (its module's
        ``attention_fp8``, this variant's options bound)."""
        self._require("fp8")
        return functools.partial(self._mod().attention_fp8, **dict(self.options))

    @property
    def backward(self) -> Callable:
        self._require("bwd")
        return functools.partial(self._mod().attention_bwd, **dict(self.options))

    def _require(self, kind: str) -> None:
        if self.kind != kind:
            raise TypeError(f"{self.name} is a {self.kind} kernel, not a {kind} one")

    def supports(self, shape: Shape):
        """A ``check.Support``: true when the kernel runs the shape, else false with the reason."""
        return self._mod().supports(shape, **dict(self.options))

    @property
    def pass_configs(self) -> dict:
        """TileLang pass configs the variant compiles with (emit lowers with the same): the
        module's ``pass_configs_for(**options)`` where a family's variants differ, else its
        PASS_CONFIGS."""
        per_variant = getattr(self._mod(), "pass_configs_for", None)
        if per_variant is not None:
            return per_variant(**dict(self.options))
        return getattr(self._mod(), "PASS_CONFIGS", {})

    @property
    def postproc_passes(self) -> tuple:
        """The ``postproc`` passes this variant compiles under: the module's
        ``postproc_passes_for(**options)`` where a family's variants differ, else its
        POSTPROC_PASSES; none by default."""
        per_variant = getattr(self._mod(), "postproc_passes_for", None)
        if per_variant is not None:
            return per_variant(**dict(self.options))
        return getattr(self._mod(), "POSTPROC_PASSES", ())

    @property
    def static_specs(self):
        """Triton families: ``static_specs(shape)`` for the no-GPU report; None for TileLang."""
        return getattr(self._mod(), "static_specs", None)

    def prim_func(self, shape: Shape):
        return self._mod().prim_func_for(shape, **dict(self.options))


KERNELS: dict[str, Kernel] = {}


def _register(name: str, module: str, kind: str = "fwd", **options) -> None:
    KERNELS[name] = Kernel(name, module, tuple(sorted(options.items())), kind)


_register("pipelined", "ws_lab.kernels.fwd.pipelined")
_register("coop", "ws_lab.kernels.fwd.coop", pingpong=True)
_register("coop-nopp", "ws_lab.kernels.fwd.coop", pingpong=False)
_register("coop-overlap", "ws_lab.kernels.fwd.coop_overlap", pingpong=True)
_register("coop-overlap-nopp", "ws_lab.kernels.fwd.coop_overlap", pingpong=False)
_register("coop-overlap-persistent", "ws_lab.kernels.fwd.coop_overlap", pingpong=True, persistent=True)
_register("coop-overlap-desc", "ws_lab.kernels.fwd.coop_overlap", pingpong=True, kv_descending=True)
_register("coop-overlap-persistent-desc", "ws_lab.kernels.fwd.coop_overlap", pingpong=True,
          persistent=True, kv_descending=True)
_register("largehdv", "ws_lab.kernels.fwd.largehdv")
_register("triton-mha", "ws_lab.kernels.fwd.triton_mha")
_register("bwd-pipelined", "ws_lab.kernels.bwd.pipelined", kind="bwd", backend="pipelined")
_register("bwd-ws", "ws_lab.kernels.bwd.pipelined", kind="bwd", backend="ws")
_register("fp8", "ws_lab.kernels.fwd.fp8", kind="fp8", design="pipelined")
_register("fp8-coop", "ws_lab.kernels.fwd.fp8", kind="fp8", design="coop-overlap")
_register("fp8-coop-persistent", "ws_lab.kernels.fwd.fp8", kind="fp8",
          design="coop-overlap-persistent")
_register("fp8-coop-rs", "ws_lab.kernels.fwd.fp8", kind="fp8", design="coop-overlap-rs")
_register("fp8-coop-rs-vt", "ws_lab.kernels.fwd.fp8", kind="fp8", design="coop-overlap-rs-vt")
_register("fp8-coop-rs-persistent", "ws_lab.kernels.fwd.fp8", kind="fp8",
          design="coop-overlap-rs-persistent")
_register("fp8-coop-rs-desc", "ws_lab.kernels.fwd.fp8", kind="fp8", design="coop-overlap-rs-desc")
_register("fp8-coop-rs-persistent-desc", "ws_lab.kernels.fwd.fp8", kind="fp8",
          design="coop-overlap-rs-persistent-desc")


def get(name: str) -> Kernel:
    try:
        return KERNELS[name]
    except KeyError:
        raise ValueError(f"unknown kernel {name!r}; registered: {', '.join(KERNELS)}") from None


def supported_shapes(name: str) -> list[Shape]:
    """The registered shapes the kernel runs (what a refusal names)."""
    from ws_lab import shapes

    return [s for s in shapes.SHAPES.values() if get(name).supports(s)]


# Decode and RL-step families: their own call signatures (paged / static KV caches, the
# lm_head's log-probs, the update's autograd attention op), so they are not ``Kernel``s; the
# harness reaches them through ``decode(name)``, never by module path.
DECODE: dict[str, str] = {"paged": "ws_lab.kernels.decode.paged",
                          "fused": "ws_lab.kernels.decode.fused_decode",
                          "layer_ops": "ws_lab.kernels.step.decode_layer",
                          "sampling": "ws_lab.kernels.step.sampling",
                          "rollout_step": "ws_lab.kernels.step.rollout_step",
                          "token_logprobs": "ws_lab.kernels.step.token_logprobs",
                          # torch.ops.ws_lab.rope_qkv, the training decoder's split + RoPE
                          "rope_qkv": "ws_lab.kernels.step.rope_qkv",
                          # torch.ops.ws_lab.attention, the update's trainable attention
                          "attention_op": "ws_lab.kernels.bwd.attention_op"}


def decode(name: str):
    """The module of a decode kernel family (``paged_attention``, ``MODES``, ``static_specs``…)."""
    try:
        return importlib.import_module(DECODE[name])
    except KeyError:
        raise ValueError(f"unknown decode family {name!r}; registered: {', '.join(DECODE)}") from None
