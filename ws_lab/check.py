"""Input validation for every kernel entry point: types, shapes, layouts, devices, scales and
overlaps, refused with a TypeError / ValueError naming the problem before any launch. Test
helpers (random inputs, the check against the oracle) live in ``ws_lab.testing``."""
from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass

import numpy
import torch


_TL_DTYPE = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class AttentionDims:
    batch: int
    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype
    softmax_scale: float

    @property
    def tl_dtype(self) -> str:
        return _TL_DTYPE[self.dtype]


def require_tensors(who: str = "", **named) -> None:
    """TypeError naming the first argument that is not a tensor (``who``: the op, as a prefix)."""
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{who + ': ' if who else ''}{name} must be a torch.Tensor, got "
                            f"{type(t).__name__}")


def validate_attention_inputs(q, k, v, *, supported_head_dims, out=None, softmax_scale=None,
                              causal=False, dtypes=(torch.float16, torch.bfloat16),
                              contiguous=True, devices="cuda") -> AttentionDims:
    """Checks BSHD q/k/v (and out) before any launch; raises TypeError/ValueError naming the problem.

    q (B, S, Hq, D), k (B, S, Hkv, D), v (B, S, Hkv, Dv), out (B, S, Hq, Dv): one dtype from
    ``dtypes``, contiguous, on one device; Hq a multiple of Hkv; (D, Dv) in
    ``supported_head_dims``; out sharing no memory with q/k/v; causal a bool; softmax_scale None
    (1/sqrt(D)) or a finite real > 0 (numpy scalars too). With ``contiguous=False`` (kernels
    that take strides) only the head dim must have stride 1. ``devices``: "cuda" (TileLang
    kernels), "triton" (CUDA, or the CPU under TRITON_INTERPRET=1) or "any" (a fake/meta
    implementation).
    """
    if not isinstance(causal, (bool, numpy.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        require_tensors(**{name: t})
        if t.dtype not in dtypes:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: {', '.join(map(str, dtypes))}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D BSHD (batch, seq, heads, head_dim), got shape "
                             f"{tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    batch, seq_len, heads, head_dim = q.shape
    if k.shape[:2] != (batch, seq_len) or v.shape[:2] != (batch, seq_len):
        raise ValueError(f"batch/seq mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    kv_heads = k.shape[2]
    if v.shape[2] != kv_heads:
        raise ValueError(f"k has {kv_heads} heads but v has {v.shape[2]}")
    if k.shape[3] != head_dim:
        raise ValueError(f"q head_dim {head_dim} != k head_dim {k.shape[3]}")
    if min(batch, seq_len, heads, kv_heads) == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if heads % kv_heads:
        raise ValueError(f"Hq={heads} is not a multiple of Hkv={kv_heads} (GQA needs whole groups)")
    head_dim_v = v.shape[3]
    if (head_dim, head_dim_v) not in supported_head_dims:
        raise ValueError(f"unsupported head dim (D={head_dim}, Dv={head_dim_v}); supported (D, Dv): "
                         f"{sorted(supported_head_dims)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not (t.is_contiguous() if contiguous else t.stride(-1) == 1):
            need = "contiguous BSHD" if contiguous else "stride 1 in the head dim"
            raise ValueError(f"{name} must be {need}; got strides {t.stride()} for shape "
                             f"{tuple(t.shape)}")
    if out is not None:
        require_tensors(out=out)
        want = (batch, seq_len, heads, head_dim_v)
        if tuple(out.shape) != want or out.dtype != q.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {q.dtype} tensor of shape {want}, got "
                             f"{out.dtype} {tuple(out.shape)} strides {out.stride()}")
    scale = validate_scale(softmax_scale, head_dim)
    tensors = [q, k, v] + ([out] if out is not None else [])
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"inputs are on different devices: {[str(t.device) for t in tensors]}")
    refuse_overlapping_out(out, q=q, k=k, v=v)
    require_device(q.device, devices, q.dtype)
    return AttentionDims(batch, seq_len, heads, kv_heads, head_dim, head_dim_v, q.dtype, scale)


def validate_scale(softmax_scale, head_dim: int) -> float:
    """1/sqrt(D) for None; else a finite real > 0 (Python or numpy scalar) as a float."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    softmax_scale = float(softmax_scale)
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale}")
    return float(softmax_scale)


@dataclass(frozen=True)
class Support:
    """The answer of every ``supports`` predicate of the lab: true when the kernel runs the call,
    else false with the reason (and the exception type a call that needs it raises)."""
    reason: str = ""
    error: type = ValueError

    def __bool__(self) -> bool:
        return not self.reason

    def require(self, who: str) -> None:
        """Raises ``error`` naming ``who`` and the reason when the call is not supported."""
        if self.reason:
            raise self.error(f"{who}: {self.reason}")


SUPPORTED = Support()


def head_dims_supported(head_dim, head_dim_v, supported) -> Support:
    """A TileLang family's ``supports`` on head dims: the (D, Dv) pairs it runs, named when not."""
    if (head_dim, head_dim_v) in supported:
        return SUPPORTED
    return Support(f"runs (D, Dv) in {sorted(supported)}, not ({head_dim}, {head_dim_v})")


def triton_supports(device, dtype=None) -> Support:
    """Whether Triton kernels run on ``device``: CUDA, or the CPU under TRITON_INTERPRET=1.
    With ``dtype`` (a kernel that multiplies with ``tl.dot``): the interpreter computes a bf16
    ``tl.dot`` wrong (outputs ~1e9 off, no warning), so it is refused there."""
    if device.type == "cuda":
        return SUPPORTED
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        if dtype == torch.bfloat16:
            return Support("Triton's interpreter computes bf16 tl.dot wrong (~1e9 off): run bf16 "
                           "on a GPU, or fp16 / fp32 under TRITON_INTERPRET=1", TypeError)
        return SUPPORTED
    return Support(f"inputs must be CUDA tensors (CPU tensors only under TRITON_INTERPRET=1), "
                   f"got {device.type} tensors")


def capturing(device) -> bool:
    """Whether the current stream of ``device`` is being captured into a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def refuse_in_capture(device, what: str) -> None:
    """A host check that synchronizes cannot run inside CUDA-graph capture (it would invalidate
    the capture): refused with a message saying so."""
    if capturing(device):
        raise ValueError(f"{what} synchronizes with the host and cannot run inside CUDA-graph "
                         "capture: check the inputs once before capturing, then capture without it")


def refuse_grad(op: str, **tensors) -> None:
    """Inputs that need grad are refused until the op has a backward (their grad would be lost
    silently)."""
    needing = [n for n, t in tensors.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    if needing and torch.is_grad_enabled():
        raise ValueError(f"{op} has no backward: {', '.join(needing)} require grad (detach them, "
                         "or call under torch.no_grad())")


def refuse_expanded(name: str, t: torch.Tensor) -> None:
    """An expanded (stride-0) output would have every row written to the same memory."""
    if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
        raise ValueError(f"{name} must not be expanded (a stride of 0 makes rows share memory), "
                         f"got strides {t.stride()} for shape {tuple(t.shape)}")


def require_device(device, devices: str, dtype=None) -> None:
    """``devices``: "cuda" — CUDA only; "triton" — ``triton_supports`` (CUDA, or the CPU under
    Triton's interpreter); "any" — no check (fake tensors)."""
    if devices == "any" or device.type == "cuda":
        return
    if devices == "triton":
        support = triton_supports(device, dtype)
        if support:
            return
        raise support.error(support.reason)
    raise ValueError(f"inputs must be CUDA tensors, got {device.type} tensors")


def _has_memory(*tensors: torch.Tensor) -> bool:
    return not any(t.device.type == "meta" or isinstance(t, torch._subclasses.FakeTensor)
                   for t in tensors)


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte addresses a tensor's elements occupy (its strided extent)."""
    start = t.data_ptr()
    extent = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride())) + 1
    return start, start + extent * t.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two non-empty tensors on one device may share memory (their byte extents meet).
    Tensors without memory (meta, or torch.compile's fake tensors while it traces) never do:
    the real call that follows the trace checks again."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0 or not _has_memory(a, b):
        return False
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    return a0 < b1 and b0 < a1


def refuse_overlapping_out(out, **inputs) -> None:
    """An ``out`` that shares memory with an input would be read after being written."""
    for name, t in inputs.items():
        if out is not None and isinstance(t, torch.Tensor) and overlaps(out, t):
            raise ValueError(f"out overlaps {name} in memory; give a separate output buffer")
