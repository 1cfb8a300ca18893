"""Paged decode attention in hand-written CUDA (``paged_cuda.cu``): ``paged.paged_attention``'s
``backend="cuda"``.

Why it exists: on the big rows of ``bench/paged.py`` (B·Hkv ≥ 256, or 32k-token contexts) the
Triton kernels stream K/V 2–5 % slower than SDPA reads its contiguous copy, and no Triton
lever closed that (notes/triton.md, sessions 16–20). This kernel gives each warp its own
cp.async ring over whole cache blocks and no CTA barrier in its main loop; it is 1–3 % faster
than the Triton modes on those rows (notes/triton.md, Session 23).

Scope: head dim 128, 16-token blocks, fp16 / bf16, query groups of ≤ 16 heads, compute
capability ≥ 8.0 (cp.async, ldmatrix, mma.sync). The source is compiled with ``nvcc`` for the
device's architecture on first use and cached under ``$WS_LAB_CACHE`` (default
``~/.cache/ws_lab``), keyed by the source's hash; the cubin is launched through the CUDA driver
API (ctypes), on the current torch stream, so it is captured by CUDA graphs like any kernel.

``paged.plan`` (backend "auto") picks it where ``supports`` holds and the Triton rule would pick gqa (on
the 13 sweep shapes that go to gqa it was 0.960–1.015 × the best Triton mode, notes/triton.md,
Session 23, run 153), or split_k on ≥ 200 MiB of K/V or B·Hkv ≥ 3/4 of the SMs (0.87–1.001 ×
split_k there, Session 24, runs 156 and 158).

Plan (``plan``): one CTA per (sequence, KV head) when that fills the GPU (2 warps, 2 stages of
2 blocks: 64 KB of shared memory for the rings, and up to 8 KB for the CTA's sorted walk);
otherwise the context is split into segments, about one CTA an SM (4 warps, 128 KB + up to
16 KB), and ``paged_merge`` combines them. Where it costs no CTA an SM, the launch adds room
for the walk's sort (``CudaConfig.launch_smem``), so the kernel issues every ring stage before
it sorts.
"""
import ctypes
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ws_lab.check import Support
from ws_lab.kernels import LOG2E
from ws_lab.kernels.decode.cubin import CudaSource

SOURCE = CudaSource(Path(__file__).with_suffix(".cu"))
HEAD_DIM = 128
BLOCK_SIZE = 16
MAX_GROUP = 16  # the query group is the 16 rows of one mma tile
DTYPE_NAMES = {torch.float16: "f16", torch.bfloat16: "bf16"}
MIN_CAPABILITY = (8, 0)
MAX_WARP_SLOTS = 1024  # paged_cuda.cu's: the most blocks one warp walks (a CTA sorts NW×)
RESERVED_SMEM = 1024  # the shared memory the driver keeps a CTA on sm_80+ (past the request)


def sort_scratch_ints(n, threads) -> int:
    """paged_cuda.cu's ``WalkSort<threads>::scratch_ints(n)``: its by-bucket copy of the n ids,
    a counter a bucket (a power of two, at least an id and a thread each), 3 ints a warp."""
    buckets = max(threads, 1 << max(0, (n - 1).bit_length()))
    return n + buckets + 3 * (threads // 32)


@dataclass(frozen=True)
class CudaConfig:
    num_warps: int
    stages: int  # cp.async ring slots per warp
    blocks_per_step: int  # cache blocks per slot (one online-softmax step)

    def warp_slots(self, blocks_per_seg) -> int:
        """The blocks each warp walks in a segment (its steps, round-robin, × blocks a step)."""
        return -(-blocks_per_seg // (self.num_warps * self.blocks_per_step)) * self.blocks_per_step

    def smem_bytes(self, blocks_per_seg, sort_ahead=False) -> int:
        """The rings, then the CTA's walk (its block ids in visiting order), then, with
        ``sort_ahead``, the sort's scratch (without, it borrows the rings' last stage)."""
        ring = self.num_warps * self.stages * self.blocks_per_step * 2 * BLOCK_SIZE * HEAD_DIM * 2
        # the warps' m and l (16 rows each), and the O fragments of every warp but the first
        merge = self.num_warps * 2 * 16 * 4 + (self.num_warps - 1) * 16 * HEAD_DIM * 4
        walk = self.num_warps * self.warp_slots(blocks_per_seg)
        scratch = sort_scratch_ints(walk, self.num_warps * 32) if sort_ahead else 0
        return max(ring, merge) + 4 * (walk + scratch)

    def launch_smem(self, blocks_per_seg, sm_smem) -> int:
        """The shared memory to launch with on an SM of ``sm_smem`` bytes. The kernel reads its
        size: with room for the sort's scratch past the walk it issues every ring stage before
        it sorts (the sort then hides behind more loads), and it gets that room wherever it
        costs no CTA an SM."""
        tight = self.smem_bytes(blocks_per_seg)
        roomy = self.smem_bytes(blocks_per_seg, sort_ahead=True)
        per_sm = lambda smem: sm_smem // (smem + RESERVED_SMEM)
        return roomy if per_sm(roomy) >= max(per_sm(tight), 1) else tight

    def kernel_name(self, dtype) -> str:
        return (f"paged_decode_{DTYPE_NAMES[dtype]}_{self.num_warps}_{self.stages}_"
                f"{self.blocks_per_step}")


# Measured on the H100 (notes/triton.md, Session 23, runs 149–151): 2,2,2 best with one CTA per
# (sequence, KV head) on all three B·Hkv = 256 rows; 4,2,2 best on every split row.
WHOLE = CudaConfig(2, 2, 2)
SPLIT = CudaConfig(4, 2, 2)
CONFIGS = (WHOLE, SPLIT)  # the instantiations in paged_cuda.cu


def plan(batch, kv_heads, max_blocks, sm_count) -> tuple[CudaConfig, int, int]:
    """(config, segments, blocks per segment). Segments: about one CTA an SM when B·Hkv alone
    does not fill the GPU, each at least one step per warp; and in any case enough that no warp
    walks more than MAX_WARP_SLOTS blocks (32k tokens a CTA on WHOLE, 64k on SPLIT)."""
    pairs = batch * kv_heads
    cfg = WHOLE if pairs >= sm_count else SPLIT
    step_blocks = cfg.num_warps * cfg.blocks_per_step
    n_seg = 1 if cfg is WHOLE else max(1, min(sm_count // pairs,
                                              math.ceil(max_blocks / step_blocks)))
    n_seg = max(n_seg, math.ceil(max_blocks / (MAX_WARP_SLOTS * cfg.num_warps)))
    if n_seg == 1:
        return cfg, 1, max_blocks
    per_seg = math.ceil(math.ceil(max_blocks / n_seg) / cfg.blocks_per_step) * cfg.blocks_per_step
    return cfg, math.ceil(max_blocks / per_seg), per_seg


def supports(q, k_cache, v_cache) -> Support:
    """Whether this kernel runs these inputs (already through ``paged._validate``'s checks):
    its scope, then the device, then whether it can be built (nvcc on PATH, or its cubin
    cached). The reason names what is outside; ``backend='cuda'`` raises it."""
    if q.dtype not in DTYPE_NAMES:
        return Support(f"takes float16 or bfloat16, got {q.dtype}", TypeError)
    _, block_size, kv_heads, head_dim = k_cache.shape
    if head_dim != HEAD_DIM:
        return Support(f"supports head dim {HEAD_DIM} only, got {head_dim}")
    if block_size != BLOCK_SIZE:
        return Support(f"supports block_size {BLOCK_SIZE} only, got {block_size}")
    group = q.shape[1] // kv_heads
    if group > MAX_GROUP:
        return Support(f"takes query groups of at most {MAX_GROUP} heads (one mma tile), got "
                       f"Hq/Hkv = {group}")
    if q.shape[0] > 65535 or kv_heads > 65535:
        return Support(f"grids hold at most 65535 sequences and KV heads, got B={q.shape[0]}, "
                       f"Hkv={kv_heads}")
    # Q is read as 4-byte pairs, K/V rows as 16-byte chunks.
    if q.stride(1) % 2 or q.stride(0) % 2 or q.data_ptr() % 4:
        return Support(f"needs q 4-byte aligned with even strides, got strides {q.stride()}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.data_ptr() % 16:
            return Support(f"needs {name} 16-byte aligned")
    if q.device.type != "cuda":
        return Support(f"needs CUDA tensors, got {q.device.type} tensors (the interpreter runs "
                       "the Triton modes only)")
    capability = torch.cuda.get_device_capability(q.device)
    if capability < MIN_CAPABILITY:
        return Support(f"needs compute capability >= 8.0 (cp.async, mma.sync), {q.device} has "
                       f"{capability[0]}.{capability[1]}")
    return SOURCE.supports(capability)


def paged_attention(q, k_cache, v_cache, block_table, context_lens, out, scale, cfg: CudaConfig,
                    n_seg, per_seg) -> torch.Tensor:
    """Launches the plan ``paged.plan`` made (``cfg``, ``n_seg`` segments of ``per_seg``
    blocks) on validated inputs; ``paged.paged_attention(backend="cuda")`` is the entry point."""
    batch, heads, _ = q.shape
    max_blocks = block_table.shape[1]
    kv_heads = k_cache.shape[2]
    props = torch.cuda.get_device_properties(q.device)
    no_partials = (0, 0, 0)  # null pointers: one segment writes out directly, no merge
    if n_seg > 1:
        m_part = torch.empty(batch * heads * n_seg, dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        o_part = torch.empty(batch * heads * n_seg * HEAD_DIM, dtype=torch.float32,
                             device=q.device)
        parts = (m_part.data_ptr(), l_part.data_ptr(), o_part.data_ptr())
    else:
        parts = no_partials
    params = Params(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                    block_table.data_ptr(), context_lens.data_ptr(), out.data_ptr(), *parts,
                    scale * LOG2E, heads // kv_heads, max_blocks, per_seg, k_cache.shape[0],
                    q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
                    block_table.stride(0), out.stride(0), out.stride(1))
    SOURCE.launch(q.device, cfg.kernel_name(q.dtype), (n_seg, kv_heads, batch),
                  cfg.num_warps * 32,
                  cfg.launch_smem(per_seg, getattr(props, "shared_memory_per_multiprocessor", 0)),
                  [params])
    if n_seg > 1:
        SOURCE.launch(q.device, f"paged_merge_{DTYPE_NAMES[q.dtype]}", (batch * heads, 1, 1),
                      HEAD_DIM, 0,
                      [ctypes.c_uint64(p) for p in parts] + [
                          ctypes.c_uint64(out.data_ptr()), ctypes.c_int(n_seg),
                          ctypes.c_int(heads), ctypes.c_longlong(out.stride(0)),
                          ctypes.c_longlong(out.stride(1))])
    return out


class Params(ctypes.Structure):
    """paged_cuda.cu's ``Params<T>``, field for field."""
    _fields_ = ([(n, ctypes.c_uint64) for n in ("q", "k_cache", "v_cache", "block_table",
                                                 "context_lens", "out", "m_part", "l_part",
                                                 "o_part")]
                + [("scale_log2", ctypes.c_float), ("group", ctypes.c_int),
                   ("max_blocks", ctypes.c_int), ("blocks_per_seg", ctypes.c_int),
                   ("num_blocks", ctypes.c_int)]
                + [(n, ctypes.c_longlong) for n in (
                    "stride_qb", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb",
                    "stride_vs", "stride_vh", "stride_bt", "stride_ob", "stride_oh")])


def static_report(capability=(9, 0)) -> list[dict]:
    """No GPU needed (nvcc, cuobjdump): per exported kernel of ``paged_cuda.cu`` for
    ``capability``, ptxas's registers and spill bytes and the SASS counts of the instructions
    the design rests on: HMMA (mma.sync), LDSM (ldmatrix), LDGSTS (cp.async), BAR (CTA
    barriers: only the warps' merge after the main loop)."""
    return SOURCE.static_report(capability, ("HMMA", "LDSM", "LDGSTS", "BAR"))
