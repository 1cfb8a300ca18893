"""A Llama / Qwen2 decoder layer at decode time (a few dozen rows), in Triton: the linears as
weight-streaming GEMMs with their epilogues fused, the residual add fused into the RMSNorm that
follows it, and SwiGLU's silu(gate) · up. At batch 64 every launch is a few µs; a 24-layer
step has ~170 of them, so the launch count and each kernel's latency are the cost.

``linear`` (counterparts: vLLM's skinny-GEMM / split-K paths, gpt-fast's int8 GEMV): each
program streams a BLOCK_N-row slice of the weight once while the activations (≤ BLOCK_M rows)
come from L2. Epilogues: the bias (q|k|v), SwiGLU over a [gate | up] weight (the gate and up
slices of the same columns in one program: no (rows, 2·I) intermediate, no SwiGLU launch), or
split-K — fp32 partials whose sum the next ``add_rmsnorm`` takes as it reads them (the o and
down projections have N = hidden, too few columns for one wave; no reduce launch). Every kernel
launches with programmatic dependent launch on sm_90: the next one's launch overlaps this
one's tail, which inside a CUDA graph is most of a small kernel's cost.

Counterparts: vLLM's ``fused_add_rms_norm`` and ``silu_and_mul``. Numerics follow HF's Qwen2:
each GEMM's output is rounded to the model dtype (the bias added in fp32 first, as cuBLASLt's
epilogue), the residual sum is rounded to the model dtype, normalized in fp32, cast back, then
scaled by the weight in the model dtype. On a CPU tensor each function is the same formula in
torch (the rollout's CPU tests), so callers need not branch.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ws_lab.check import require_tensors, triton_supports
from ws_lab.kernels.decode.triton_common import bulk_prefetch_l2, has_pdl, sm_count
from ws_lab.target import H100_SMS


@triton.jit
def _add_rmsnorm_kernel(X, Residual, Weight, Out, eps, n_cols, part_stride, ADD: tl.constexpr,
                        PARTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    # PARTS > 1: X holds a split-K linear's fp32 partials; their sum is its output
    x = tl.load(X + row * n_cols + cols, mask=ok, other=0.0)
    for p in tl.static_range(1, PARTS):
        x += tl.load(X + p * part_stride + row * n_cols + cols, mask=ok, other=0.0)
    x = x.to(Out.dtype.element_ty)
    if PDL:
        gdc_launch_dependents()
    if ADD:
        x = (x + tl.load(Residual + row * n_cols + cols, mask=ok, other=0.0)).to(Out.dtype.element_ty)
        tl.store(Residual + row * n_cols + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(Out.dtype.element_ty)
    w = tl.load(Weight + cols, mask=ok, other=0.0)
    tl.store(Out + row * n_cols + cols, (w * normed).to(Out.dtype.element_ty), mask=ok)


# The paced L2 prefetch: PREFETCH_PROGRAMS programs each ask for a PREFETCH_PIECE every
# PREFETCH_GAP SM cycles, ~1.3 TB/s together at 1.755 GHz. Faster queues the step's own loads
# behind it, slower lets a step's 24 prefetches outlast the step (notes/rollout.md, Session 18).
# 835 cycles (~1.1 TB/s) was best until the attention's context went evict_first in L2; since,
# 700–750 take 9.5 µs off the rollout's step and 1000 adds 32 (notes/rollout.md, Session 27).
PREFETCH_PROGRAMS = 8
PREFETCH_PIECE = 64 * 1024
PREFETCH_GAP = 700


@triton.jit
def _clock():
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _spin_until(t0, cycles):
    """Spins until ``cycles`` SM clocks have passed since ``t0`` (a prefetch's pace)."""
    now = t0
    while now - t0 < cycles:
        now = _clock()


@triton.jit
def _prefetch_l2_kernel(Base, nbytes, PIECE: tl.constexpr, GAP: tl.constexpr):
    """Program p asks the L2 for pieces p, p + P, … of [Base, + nbytes), one
    ``cp.async.bulk.prefetch.L2`` from its first thread every GAP cycles (the bytes are not
    waited for; the program retires once they have landed)."""
    n_pieces = tl.cdiv(nbytes, PIECE)
    t0 = _clock()
    piece = tl.program_id(0)
    issued = 0
    while piece < n_pieces:
        start = piece.to(tl.int64) * PIECE
        size = tl.minimum(nbytes - start, PIECE).to(tl.int32)
        bulk_prefetch_l2(Base.to(tl.pointer_type(tl.int8)) + start, size)
        issued += 1
        _spin_until(t0, issued * GAP)
        piece += tl.num_programs(0)


def prefetch_l2(t: torch.Tensor):
    """Asks the L2 for a contiguous tensor's bytes at a paced ~1.3 TB/s (sm_90; elsewhere a
    no-op): a hint that changes no result. A decode step's kernels are latency-bound and leave
    HBM idle most of the time, and a GEMM whose weights are already in L2 runs faster
    (Qwen2.5-0.5B, B 64, µs cold / in L2: q|k|v 4.65 / 3.59, gate|up 10.15 / 8.01, down
    7.33 / 5.47; notes/rollout.md, Session 18). Launch it on a side stream, ahead of the GEMMs
    that read the bytes: issued from a kernel on the critical path, it lengthens that kernel."""
    if not t.is_contiguous():
        raise ValueError("prefetch_l2: a contiguous tensor expected")
    nbytes = t.numel() * t.element_size() // 16 * 16
    if nbytes and t.data_ptr() % 16 == 0 and has_pdl(t.device):  # the bulk prefetch's alignment
        _prefetch_l2_kernel[(PREFETCH_PROGRAMS,)](t, nbytes, PIECE=PREFETCH_PIECE,
                                                  GAP=PREFETCH_GAP, num_warps=1)


# The paced prefetch of one layer's cached context: CONTEXT_PREFETCH_PROGRAMS programs each ask
# for one (sequence, KV head)'s K and V rows every CONTEXT_PREFETCH_GAP cycles, ~1.3 TB/s at
# the rollout's mean 84 KB a row pair. In the rollout's step, forked once gate|up(i) is done,
# layer i + 1's context lands in L2 over down(i) and q|k|v(i + 1), when HBM carries only the
# weight prefetch: −29 to −33 µs a step. Gaps 600–1200 and 4–16 programs are within 4 µs of
# each other (900 the fastest in two runs); 1800–2400 arrive late (notes/rollout.md,
# Session 29).
CONTEXT_PREFETCH_PROGRAMS = 8
CONTEXT_PREFETCH_GAP = 900
MAX_BULK_PREFETCH = 512 * 1024  # one cp.async.bulk.prefetch asks for < 1 MB (16 bits of 16 B)


@triton.jit
def _prefetch_context_l2_kernel(KCache, VCache, Positions, rows, heads, capacity, row_bytes,
                                TOKEN_BYTES: tl.constexpr, PIECE: tl.constexpr,
                                GAP: tl.constexpr):
    """Program p asks the L2 for rows p, p + P, … of the (B·Hkv, capacity, D) caches: K and V
    of tokens [0, position) of the row's sequence (the position clamped to the capacity), in
    pieces of ≤ PIECE bytes, one row every GAP cycles."""
    t0 = _clock()
    row = tl.program_id(0)
    issued = 0
    while row < rows:
        tokens = tl.minimum(tl.maximum(tl.load(Positions + row // heads), 0), capacity)
        size = tokens.to(tl.int64) * TOKEN_BYTES
        base = row.to(tl.int64) * row_bytes
        start = tl.full((), 0, tl.int64)
        while start < size:
            piece = tl.minimum(size - start, PIECE).to(tl.int32)
            bulk_prefetch_l2(KCache.to(tl.pointer_type(tl.int8)) + base + start, piece)
            bulk_prefetch_l2(VCache.to(tl.pointer_type(tl.int8)) + base + start, piece)
            start += PIECE
        issued += 1
        _spin_until(t0, issued * GAP)
        row += tl.num_programs(0)


def prefetch_context_l2(k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor):
    """Asks the L2 for one layer's cached context, K and V rows [0, positions[b]) of every
    (b, KV head) of contiguous (B, Hkv, capacity, D) caches, at a paced ~1.3 TB/s (sm_90;
    elsewhere a no-op): a hint that changes no result. Launch it on a side stream a few kernels
    ahead of the attention that reads the context."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"prefetch_context_l2: K and V caches of one (B, Hkv, capacity, D) shape "
                         f"expected, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("prefetch_context_l2: contiguous K and V caches expected")
    if k_cache.dtype != v_cache.dtype or k_cache.device != v_cache.device:
        raise TypeError(f"prefetch_context_l2: K and V caches differ: {k_cache.dtype} on "
                        f"{k_cache.device}, {v_cache.dtype} on {v_cache.device}")
    batch, heads, capacity, dim = k_cache.shape
    if positions.dtype != torch.int32 or positions.shape != (batch,):
        raise TypeError(f"prefetch_context_l2: positions must be int32 of shape ({batch},), got "
                        f"{positions.dtype} of shape {tuple(positions.shape)}")
    if positions.device != k_cache.device:
        raise ValueError(f"prefetch_context_l2: positions on {positions.device}, caches on "
                         f"{k_cache.device}")
    token_bytes = dim * k_cache.element_size()
    aligned = k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 16 == 0  # bulk prefetch
    if batch * heads and token_bytes % 16 == 0 and aligned and has_pdl(k_cache.device):
        _prefetch_context_l2_kernel[(CONTEXT_PREFETCH_PROGRAMS,)](
            k_cache, v_cache, positions, batch * heads, heads, capacity, capacity * token_bytes,
            TOKEN_BYTES=token_bytes, PIECE=MAX_BULK_PREFETCH, GAP=CONTEXT_PREFETCH_GAP,
            num_warps=1)


@triton.jit
def _silu_mul(gate, up):
    """silu(gate) · up as HF's Qwen2 MLP rounds it: silu in fp32 of the dtype-rounded gate, cast
    back, times up in the dtype."""
    g = gate.to(tl.float32)
    return (g / (1.0 + tl.exp(-g))).to(up.dtype) * up


@triton.jit
def _linear_kernel(X, W, Bias, Out, ChunkMax, M, N, K, k_per_split, stride_xm,
                   HAS_BIAS: tl.constexpr, GLU: tl.constexpr, SPLIT: tl.constexpr,
                   CHUNK_MAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PDL: tl.constexpr, W_EARLY: tl.constexpr,
                   TRIGGER_AT_TOP: tl.constexpr):
    """Out[m, n] = X[m, :] · W[n, :] over this program's BLOCK_N columns and K range. GLU: W is
    [gate | up] (2N rows); Out = silu(gate) · up. SPLIT: Out is (splits, M, N) fp32 partials.
    CHUNK_MAX > 0: also ChunkMax[m, c] = max(Out[m, c·CHUNK_MAX : (c + 1)·CHUNK_MAX]).
    W_EARLY: the program's K range is one BLOCK_K tile, loaded before the PDL wait.
    TRIGGER_AT_TOP: the next kernel may launch as soon as every program has started (else after
    the main loop)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    k0 = split * k_per_split
    w_rows = W + n.to(tl.int64)[:, None] * K
    if W_EARLY:  # no kernel before a GEMM writes its weights: their latency overlaps its tail
        w_early = tl.load(w_rows + (k0 + tl.arange(0, BLOCK_K))[None, :])
    if PDL and TRIGGER_AT_TOP:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(k0, k0 + k_per_split, BLOCK_K):
        kk = k + tl.arange(0, BLOCK_K)
        x = tl.load(X + m[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None], other=0.0)
        w = w_early if W_EARLY else tl.load(w_rows + kk[None, :])
        acc = tl.dot(x, tl.trans(w), acc)
        if GLU:
            acc_up = tl.dot(x, tl.trans(tl.load(w_rows + N * K + kk[None, :])), acc_up)
    if PDL and not TRIGGER_AT_TOP:
        gdc_launch_dependents()
    out_rows = Out + m[:, None] * N + n[None, :]
    if SPLIT:
        tl.store(out_rows + split * M * N, acc, mask=m_ok[:, None])
    else:
        if HAS_BIAS:
            acc += tl.load(Bias + n).to(tl.float32)[None, :]
        y = acc.to(Out.dtype.element_ty)
        if GLU:
            y = _silu_mul(y, acc_up.to(Out.dtype.element_ty))
        tl.store(out_rows, y, mask=m_ok[:, None])
        if CHUNK_MAX > 0:  # of the rounded outputs, as a pass over Out would find them
            PER: tl.constexpr = BLOCK_N // CHUNK_MAX
            top = tl.max(tl.reshape(y.to(tl.float32), [BLOCK_M, PER, CHUNK_MAX]), axis=2)
            chunk = tl.program_id(0) * PER + tl.arange(0, PER)
            tl.store(ChunkMax + m[:, None] * (N // CHUNK_MAX) + chunk[None, :], top,
                     mask=m_ok[:, None])


@triton.jit
def _silu_mul_kernel(GateUp, Out, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    gate = tl.load(GateUp + row * 2 * n_cols + cols, mask=ok, other=0.0)
    up = tl.load(GateUp + row * 2 * n_cols + n_cols + cols, mask=ok, other=0.0)
    tl.store(Out + row * n_cols + cols, _silu_mul(gate, up), mask=ok)


NORM_MAX_COLS = 32768  # one program holds a whole row (BLOCK = next power of two ≥ H)


def _require_tensors(op, **named):
    """Tensors, all on one device."""
    require_tensors(op, **named)
    devices = {t.device for t in named.values()}
    if len(devices) != 1:
        raise ValueError(f"{op}: inputs are on different devices: {sorted(map(str, devices))}")


def _check_norm(x, weight, residual):
    """``add_rmsnorm``'s boundary: every shape, dtype, layout and device its kernel relies on."""
    named = dict(x=x, weight=weight, **({} if residual is None else {"residual": residual}))
    _require_tensors("add_rmsnorm", **named)
    if x.dim() not in (2, 3) or weight.dim() != 1:
        raise ValueError(f"add_rmsnorm: x must be (rows, H) or split-K partials (splits, rows, H) "
                         f"and weight (H,); got {tuple(x.shape)} and {tuple(weight.shape)}")
    rows, n_cols = x.shape[-2:]
    if weight.shape[0] != n_cols or (residual is not None and residual.shape != (rows, n_cols)):
        raise ValueError(f"add_rmsnorm: weight must be ({n_cols},) and residual ({rows}, {n_cols}); "
                         f"got {tuple(weight.shape)} and "
                         f"{None if residual is None else tuple(residual.shape)}")
    want = torch.float32 if x.dim() == 3 else weight.dtype
    if x.dtype != want or (residual is not None and residual.dtype != weight.dtype):
        raise TypeError(f"add_rmsnorm: x must be {want} (fp32 when split-K partials) and residual "
                        f"{weight.dtype}; got {x.dtype} and "
                        f"{None if residual is None else residual.dtype}")
    for name, t in named.items():
        if not t.is_contiguous():
            raise ValueError(f"add_rmsnorm: {name} must be contiguous, got strides {t.stride()}")
    if n_cols > NORM_MAX_COLS:
        raise ValueError(f"add_rmsnorm: rows of at most {NORM_MAX_COLS} elements (one program a "
                         f"row), got {n_cols}")


def add_rmsnorm(x, weight, eps, residual=None):
    """RMSNorm(x + residual) · weight over the last dim of a (rows, H) tensor; with
    ``residual`` the sum is also written back into it (it carries the stream on). ``x`` may be
    a split-K ``linear``'s (splits, rows, H) fp32 partials: their sum, rounded to the weight's
    dtype, is the input. Returns the normed rows."""
    _check_norm(x, weight, residual)
    if not triton_supports(x.device):
        if x.dim() == 3:
            x = x.sum(0).to(weight.dtype)
        if residual is not None:
            residual.add_(x)
            x = residual
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return weight * normed
    parts = x.shape[0] if x.dim() == 3 else 1
    rows, n_cols = x.shape[-2:]
    out = torch.empty(rows, n_cols, dtype=weight.dtype, device=x.device)
    pdl = has_pdl(x.device)
    no_residual = out  # placeholder: ADD=False never reads or writes the residual pointer
    _add_rmsnorm_kernel[(rows,)](x, no_residual if residual is None else residual, weight, out, eps,
                                 n_cols, rows * n_cols, ADD=residual is not None, PARTS=parts,
                                 BLOCK=triton.next_power_of_2(n_cols), PDL=pdl, num_warps=4,
                                 launch_pdl=pdl)
    return out


@dataclass(frozen=True)
class LinearConfig:
    block_n: int  # weight rows (output columns) per program
    block_k: int
    splits: int  # K ranges (split-K: fp32 partials, summed by add_rmsnorm)
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        """Refused here, before Triton sees it."""
        fields = (self.block_n, self.block_k, self.splits, self.num_warps, self.num_stages)
        if any(isinstance(f, bool) or not isinstance(f, int) for f in fields):
            raise TypeError(f"LinearConfig takes integers, got {fields}")
        pow2 = [n > 0 and n & (n - 1) == 0 for n in (self.block_n, self.block_k, self.num_warps)]
        if not (all(pow2) and self.block_n >= 16 and self.block_k >= 16 and self.num_warps <= 32
                and self.splits >= 1 and self.num_stages >= 1):
            raise ValueError(f"LinearConfig needs block_n and block_k powers of two ≥ 16, num_warps "
                             f"a power of two ≤ 32, splits and num_stages ≥ 1; got {fields}")


BLOCK_M = 64  # activation rows per program: a decode batch of ≤ 64 in one tile


def linear_config(n, k, glu, split_ok, sm_count) -> LinearConfig:
    """About one wave of programs (measured at M 64 on Qwen2.5-0.5B's layer, notes/rollout.md,
    Session 17): the widest column slice (128, 64, 32, 16) that still gives ≥ SMs/2 programs —
    lm_head 128 (110 µs; 64: 120, cuBLAS 117), gate|up 64 (9.5 µs against 11.8 at 32), q|k|v
    16 (4.3 µs; 32: 4.6) — else, with ``split_ok``, 32-column slices with K split into ≤ 2·SMs
    programs of whole BLOCK_K chunks (128 up to K 1024, else 64): o 32 × 7 splits (4.7 µs with
    its norm), down 32 × 4 on 10 stages (8.0 µs with its norm on 6 stages; 4 stages 9.2)."""
    block_k = 128 if k <= 1024 and k % 128 == 0 else 64
    for block_n in (128, 64, 32, 16):
        if n % block_n == 0 and n // block_n >= sm_count // 2:
            if glu:  # two weight tiles a stage: K 64 on 4 stages is 96 KB of smem at 64
                # columns, where K 128 takes 192 KB, fills an SM and keeps the next kernel's
                # early programs off it: −11.8 µs a decode step (K 128 on 3 stages −4.3; K 128
                # on 2, K 64 on 3 or 5, K 32 on 6: slower; notes/rollout.md, Session 22)
                return LinearConfig(block_n, 64, 1)
            return LinearConfig(block_n, block_k, 1)
    block_n = 16 if n % 32 else 32
    if not split_ok:
        return LinearConfig(block_n, block_k, 1)
    chunks = k // block_k
    splits = max(d for d in range(1, chunks + 1)
                 if chunks % d == 0 and (n // block_n) * d <= 2 * sm_count)
    # many K chunks a program (down: 19): a deep cp.async pipeline. 6 stages against 4: 8.0
    # against 9.2 µs alone. 10 stages (120 KB, still room beside gate|up's 96 KB for the early
    # programs) against 6: −12 µs a rollout step since the next layer's context is prefetched
    # beside down (9 / 12 stages: −6 / −8; notes/rollout.md, Session 29). One (o): nothing to
    # pipeline, its weight tile loads before the PDL wait (``linear``) and 2 stages leave room
    # for 3 programs an SM: −11 µs a decode step against 4 stages without the early load
    # (notes/rollout.md, Session 21)
    stages = 10 if chunks // splits > 8 else 2 if chunks == splits else 4
    return LinearConfig(block_n, block_k, splits, num_stages=stages)


def config_for(device, n, k, glu=False, split_ok=False) -> LinearConfig:
    """The config ``linear`` picks for an (N, K) weight on ``device``."""
    return linear_config(n, k, glu, split_ok, sm_count(device))


def linear(x, weight, bias=None, *, glu=False, split_ok=False, config: LinearConfig | None = None,
           chunk_max: torch.Tensor | None = None):
    """x (M, K) @ weight.T for decode-sized M. ``bias`` (N,) added in fp32. ``glu``: weight is
    [gate | up] (2N, K) and the result silu(x·gate.T) · (x·up.T), (M, N). ``split_ok``: the
    result may come back as (splits, M, N) fp32 partials (for ``add_rmsnorm``, which sums
    them). ``config`` overrides ``linear_config`` (for tuning). ``chunk_max``: an (M, N / C)
    fp32 tensor that also receives the maximum of every C consecutive outputs of a row (the
    lm_head hands the top-k sampler its first pass, kernels/step/sampling.py).

    On sm_90, a program whose K range is one BLOCK_K tile (the o projection's split) loads its
    weight tile before its programmatic-dependent-launch wait, so the load overlaps the tail of
    the kernel before: ``weight`` must not be written by the kernel launched just before this
    call (weights are written once; none of the lab's early-launching kernels writes one). A
    split-K linear lets its dependent (``add_rmsnorm``: 64 small programs that then wait for it)
    launch as soon as its own programs have started, not after their main loops: −10 µs a
    Qwen2.5-0.5B decode step, where the same trigger at the top of the norms or the attention
    costs 11–18 µs (notes/rollout.md, Session 21)."""
    _require_tensors("linear", x=x, weight=weight, **({} if bias is None else {"bias": bias}))
    if x.dim() != 2 or weight.dim() != 2 or (glu and weight.shape[0] % 2):
        raise ValueError(f"linear: x must be (M, K) and weight (N, K) ((2N, K) with glu); got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if bias is not None and (glu or bias.shape != (weight.shape[0],)):
        raise ValueError(f"linear: bias must be ({weight.shape[0]},) and goes without glu; got "
                         f"{tuple(bias.shape)} with glu={glu}")
    n = weight.shape[0] // 2 if glu else weight.shape[0]
    # the interpreter's bf16 tl.dot is wrong: there, bf16 takes the torch formula below
    if not triton_supports(x.device, x.dtype):
        y = torch.nn.functional.linear(x, weight, bias)
        y = silu_mul(y) if glu else y
        if chunk_max is not None:
            chunk_max.copy_(y.float().view(y.shape[0], chunk_max.shape[-1], -1).amax(-1))
        return y
    m, k = x.shape
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(f"linear: x, weight and bias must share a dtype, got {x.dtype}, "
                        f"{weight.dtype}, {None if bias is None else bias.dtype}")
    if x.stride(1) != 1 or not weight.is_contiguous() or weight.shape[1] != k:
        raise ValueError(f"linear: x {tuple(x.shape)} (unit stride in K) and a contiguous "
                         f"weight of K = {k} columns expected, got {tuple(weight.shape)}")
    cfg = config or config_for(x.device, n, k, glu, split_ok)
    if bias is not None and cfg.splits > 1:
        raise ValueError("linear: split-K partials carry no bias; give the bias to a linear "
                         "without split_ok")
    if n % cfg.block_n or k % (cfg.block_k * cfg.splits):
        raise ValueError(f"linear: N {n} and K {k} must be multiples of the config's "
                         f"{cfg.block_n} and {cfg.block_k}·{cfg.splits}")
    chunk = _check_chunk_max(chunk_max, x, n, cfg)
    if cfg.splits > 1:
        out = torch.empty(cfg.splits, m, n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    pdl = has_pdl(x.device)
    grid = (n // cfg.block_n, cfg.splits, triton.cdiv(m, BLOCK_M))
    w_early = pdl and k // cfg.splits == cfg.block_k and not glu
    # placeholders: HAS_BIAS=False never reads the bias pointer, CHUNK_MAX=0 never the maxima's
    no_bias, no_chunk_max = weight, out
    _linear_kernel[grid](x, weight, no_bias if bias is None else bias, out,
                         no_chunk_max if chunk_max is None else chunk_max, m, n, k, k // cfg.splits,
                         x.stride(0), HAS_BIAS=bias is not None, GLU=glu, SPLIT=cfg.splits > 1,
                         CHUNK_MAX=chunk, BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n,
                         BLOCK_K=cfg.block_k, PDL=pdl, W_EARLY=w_early,
                         TRIGGER_AT_TOP=cfg.splits > 1,
                         num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl)
    return out


def _check_chunk_max(chunk_max, x, n, cfg) -> int:
    """The chunk width C of an (M, N / C) fp32 ``chunk_max`` on x's device (0 without one); C
    must divide the config's BLOCK_N, and a split-K result has no rounded outputs to take
    maxima of."""
    if chunk_max is None:
        return 0
    m = x.shape[0]
    if chunk_max.device != x.device:
        raise ValueError(f"linear: chunk_max is on {chunk_max.device}, x on {x.device}")
    if chunk_max.dtype != torch.float32 or not chunk_max.is_contiguous():
        raise ValueError(f"linear: chunk_max must be a contiguous float32 tensor, got "
                         f"{chunk_max.dtype} with strides {chunk_max.stride()}")
    chunks = chunk_max.shape[-1] if chunk_max.dim() == 2 else 0
    if not chunks or n % chunks or chunk_max.shape[0] != m:
        raise ValueError(f"linear: chunk_max must be ({m}, {n} / C) for a chunk width C, got "
                         f"{tuple(chunk_max.shape)}")
    if cfg.block_n % (n // chunks) or cfg.splits > 1:
        raise ValueError(f"linear: chunk_max's chunk width {n // chunks} must divide the "
                         f"config's BLOCK_N {cfg.block_n}, without split-K ({cfg.splits} splits)")
    return n // chunks


SILU_BLOCK = 1024


def silu_mul(gate_up):
    """silu(gate) · up for a (rows, 2·I) tensor holding [gate | up] per row -> (rows, I)."""
    _require_tensors("silu_mul", gate_up=gate_up)
    if gate_up.dim() != 2 or gate_up.shape[-1] % 2:
        raise ValueError(f"silu_mul: gate_up must be (rows, 2·I) with [gate | up] per row, got "
                         f"{tuple(gate_up.shape)}")
    n_cols = gate_up.shape[-1] // 2
    if not gate_up.is_cuda:
        gate, up = gate_up[..., :n_cols], gate_up[..., n_cols:]
        return torch.nn.functional.silu(gate.float()).to(up.dtype) * up
    if not gate_up.is_contiguous():
        raise ValueError(f"silu_mul: gate_up must be contiguous, got strides {gate_up.stride()}")
    out = torch.empty(gate_up.shape[0], n_cols, dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_kernel[(gate_up.shape[0], triton.cdiv(n_cols, SILU_BLOCK))](
        gate_up, out, n_cols, BLOCK=SILU_BLOCK, num_warps=4)
    return out


def static_specs(hidden=896, intermediate=4864, dtype="bfloat16"):
    """sm_90 specializations for the static report: the gate|up GEMM (SwiGLU epilogue), the
    split-K down GEMM and the split-K o GEMM (one K tile a program: its weights load before the
    PDL wait) at Qwen2.5-0.5B's sizes, with the configs the rule picks on an H100, and the
    paced L2 prefetches of the weights and of a layer's cached context."""
    from ws_lab.triton_static import StaticSpec

    elem = {"float16": "*fp16", "bfloat16": "*bf16"}[dtype]
    specs = []
    for name, n, k, glu in (("linear_gate_up", intermediate, hidden, True),
                            ("linear_down", hidden, intermediate, False),
                            ("linear_o", hidden, hidden, False)):
        cfg = linear_config(n, k, glu, not glu, H100_SMS)
        types = dict(X=elem, W=elem, Bias=elem, Out="*fp32" if cfg.splits > 1 else elem,
                     ChunkMax="*fp32", M="i32", N="i32", K="i32", k_per_split="i32",
                     stride_xm="i32")
        meta = dict(HAS_BIAS=False, GLU=glu, SPLIT=cfg.splits > 1, CHUNK_MAX=0, BLOCK_M=BLOCK_M,
                    BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PDL=True,
                    W_EARLY=k // cfg.splits == cfg.block_k and not glu,
                    TRIGGER_AT_TOP=cfg.splits > 1)
        specs.append(StaticSpec(name, _linear_kernel, types, meta,
                                dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
                                divisible=("N", "K", "k_per_split", "stride_xm")))
    specs.append(StaticSpec("prefetch_l2", _prefetch_l2_kernel, dict(Base=elem, nbytes="i32"),
                            dict(PIECE=PREFETCH_PIECE, GAP=PREFETCH_GAP), dict(num_warps=1)))
    specs.append(StaticSpec("prefetch_context_l2", _prefetch_context_l2_kernel,
                            dict(KCache=elem, VCache=elem, Positions="*i32", rows="i32",
                                 heads="i32", capacity="i32", row_bytes="i32"),
                            dict(TOKEN_BYTES=128, PIECE=MAX_BULK_PREFETCH,
                                 GAP=CONTEXT_PREFETCH_GAP), dict(num_warps=1)))
    return specs
