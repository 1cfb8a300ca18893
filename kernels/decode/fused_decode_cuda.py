"""Fused decode attention in hand-written CUDA (``fused_decode_cuda.cu``) on static caches: what
``fused_decode``'s static entry runs where ``supports`` holds and ``heuristics.fused_prefers_cuda``
says it pays (``backend="auto"``), or on ``backend="cuda"``; the Triton kernel runs elsewhere.

Why it exists: in the rollout's decode step (Qwen2.5-0.5B, B 64, 14/2 heads, D 64, capacity
456, 24 layers) the Triton kernel costs ~9.4 µs a layer against the 3.4 µs its 10.7 MB of K/V
take at the read ceiling. This kernel gives each of 8 warps its own cp.async ring over 16-token
chunks, with no CTA barrier in the main loop and no context segments to merge across CTAs. With
it the step went from 0.894 to 0.876 ms (notes/rollout.md, Session 25, run 170), and to 0.853
with the prologue's loads issued ahead of the ring's (Session 26, runs 175 and 177).

Scope (``supports``): static caches, fp16 / bf16, D 64, query groups of ≤ 16 heads, cos / sin in
q's dtype, sm_90+ (it waits with ``griddepcontrol`` and launches with PDL), capacity ≤ 512
tokens (measured at 456; longer contexts keep the Triton kernel's segments), q / k_new / v_new / the caches / cos / sin
on 16-byte boundaries with batch strides of whole 16-byte pieces (the prologue loads 16-byte
pieces), nvcc on PATH or the cubin cached. A position outside [0, capacity) writes nothing and
gives NaN rows, as in the Triton kernel. ``backend="auto"`` takes it only where B·Hkv ≥ 3/4 of the
SMs (``heuristics.fused_prefers_cuda``: one CTA per (sequence, KV head) must fill the GPU).
"""
import ctypes
from pathlib import Path

import torch

from ws_lab.check import SUPPORTED, Support
from ws_lab.kernels import LOG2E
from ws_lab.kernels.decode.cubin import CudaSource

SOURCE = CudaSource(Path(__file__).with_suffix(".cu"))
HEAD_DIM = 64
MAX_GROUP = 16  # the query group is the 16 rows of one mma tile
MAX_CAPACITY = 512
DTYPE_NAMES = {torch.float16: "f16", torch.bfloat16: "bf16"}
# warps, cp.async ring slots a warp, 16-token chunks a slot; in the rollout's step (run 170):
# 8,3,1 0.876 ms; 4,3,1 0.885; 8,2,1 0.910; 4,2,1 0.902; 4,4,1 0.901; the Triton kernel 0.894.
# The 128 KB configs (8,2,2 / 16,2,1: 0.948 / 0.958) leave no room beside them for the o
# GEMM's early-launched programs.
NUM_WARPS, STAGES, CHUNKS_PER_SLOT = 8, 3, 1
CHUNK = 16


def smem_bytes(head_dim=HEAD_DIM) -> int:
    """q's 16 rows, the new k and v (fp32), and the warps' rings (the merge reuses the rings)."""
    ring = NUM_WARPS * STAGES * CHUNKS_PER_SLOT * 2 * CHUNK * head_dim * 2
    return 16 * head_dim * 2 + 2 * head_dim * 4 + ring


def kernel_name(dtype) -> str:
    return f"fused_decode_{DTYPE_NAMES[dtype]}_{HEAD_DIM}_{NUM_WARPS}_{STAGES}_{CHUNKS_PER_SLOT}"


def shape_supports(batch, heads, kv_heads, head_dim, capacity, dtype, rope_dtype) -> Support:
    """The shape half of ``supports`` (no device needed)."""
    if dtype not in DTYPE_NAMES or rope_dtype != dtype:
        return Support(f"takes fp16 / bf16 with cos / sin in q's dtype, got {dtype} and "
                       f"{rope_dtype}", TypeError)
    if head_dim != HEAD_DIM:
        return Support(f"supports head dim {HEAD_DIM} only, got {head_dim}")
    if heads // kv_heads > MAX_GROUP:
        return Support(f"takes query groups of at most {MAX_GROUP} heads, got {heads // kv_heads}")
    if capacity > MAX_CAPACITY:
        return Support(f"was measured up to a capacity of {MAX_CAPACITY} tokens, got {capacity} "
                       "(longer contexts take the Triton kernel's segments)")
    if max(batch, kv_heads) > 65535:
        return Support(f"grids hold at most 65535 sequences and KV heads, got B={batch}, "
                       f"Hkv={kv_heads}")
    return SUPPORTED


def supports(q, k_new, v_new, k_cache, v_cache, cos, sin, out) -> Support:
    """Whether the static call can run here (inputs already validated by
    ``fused_decode._validate``); ``fused_decode.plan`` decides whether it pays."""
    shape = shape_supports(q.shape[0], q.shape[1], k_cache.shape[1], q.shape[2],
                           k_cache.shape[2], q.dtype, cos.dtype)
    if not shape:
        return shape
    # cp.async moves 16-byte pieces of cache rows, the prologue 16-byte pieces of q, k_new,
    # v_new and the cos / sin rows; the output is written as element pairs
    rows = (q, k_new, v_new, k_cache, v_cache, cos, sin)
    if any(t.data_ptr() % 16 or t.stride(0) % 8 for t in rows) or (out is not None
                                                                   and out.data_ptr() % 4):
        return Support("needs 16-byte aligned rows with batch strides of whole 16-byte pieces")
    if q.device.type != "cuda":
        return Support(f"needs CUDA tensors, got {q.device.type} tensors")
    capability = torch.cuda.get_device_capability(q.device)
    if capability < (9, 0):
        return Support(f"needs sm_90 (griddepcontrol), {q.device} has "
                       f"{capability[0]}.{capability[1]}")
    return SOURCE.supports(capability)


class Params(ctypes.Structure):
    """fused_decode_cuda.cu's ``Params<T>``, field for field."""
    _fields_ = ([(n, ctypes.c_uint64) for n in ("q", "k_new", "v_new", "k_cache", "v_cache",
                                                 "cos", "sin", "positions", "out")]
                + [("scale_log2", ctypes.c_float), ("group", ctypes.c_int),
                   ("capacity", ctypes.c_int)]
                + [(n, ctypes.c_longlong) for n in ("stride_qb", "stride_knb", "stride_vnb")])


def launch(q, k_new, v_new, k_cache, v_cache, cos, sin, positions, out, scale) -> torch.Tensor:
    """One launch on the current stream, with PDL; ``out`` contiguous (B, Hq, D)."""
    batch, heads, _ = q.shape
    kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    params = Params(q.data_ptr(), k_new.data_ptr(), v_new.data_ptr(), k_cache.data_ptr(),
                     v_cache.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
                     out.data_ptr(), scale * LOG2E, heads // kv_heads, capacity, q.stride(0),
                     k_new.stride(0), v_new.stride(0))
    SOURCE.launch(q.device, kernel_name(q.dtype), (kv_heads, batch, 1), NUM_WARPS * 32,
                  smem_bytes(), [params], pdl=True)
    return out


def static_report(capability=(9, 0)) -> list[dict]:
    """No GPU needed: per exported kernel, registers, spill bytes and the SASS counts the design
    rests on (HMMA, LDSM, LDGSTS, BAR)."""
    return SOURCE.static_report(capability, ("HMMA", "LDSM", "LDGSTS", "BAR"))
