"""Top-k sampling over a large vocabulary in two Triton launches, inside a captured decode step.

Counterparts: FlashInfer's ``top_k_sampling_from_probs`` (rejection sampling over a pivot),
vLLM's FlashInfer / PyTorch top-k samplers. At Qwen2's 151936-token vocabulary and B 64,
``torch.topk`` costs ~121 µs a step (multi-block radix select: 2-bit digits, 8 passes over
every row; notes/rollout.md, Session 17) — a tenth of the lab's decode step.

  1. ``_chunk_max_kernel`` (grid rows × blocks of chunks): the maximum of every CHUNK columns,
     one pass over the logits — or none, when the logits' producer hands the maxima in (the
     decode model's lm_head writes them in its epilogue: kernels/step/decode_layer.py).
  2. ``_top_k_sample_kernel`` (one program per row):
     - the K chunks with the largest maxima: every one of the row's K largest values lies in
       one of them (a value ≥ the K-th largest lies in a chunk whose maximum is ≥ it, and at
       least K chunk maxima are ≥ the K-th largest chunk maximum, which is ≤ the K-th largest
       value). Ties at the K-th chunk maximum are filled in column order;
     - among those K · CHUNK candidates, the K largest: a ternary search on the
       order-preserving int32 key of each value (its zero low bits shifted out) for the K-th
       largest key τ, started at the K-th largest chunk maximum (a lower bound of τ), then
       every key > τ plus the first (K − #>τ) keys = τ in column order — the set torch.topk
       returns, up to which of equal values it takes. Each search round is one block-wide sum
       (two thresholds' counts packed in an int32), each selection one scan (the above and tie
       counts packed), which also gives each kept value its slot;
     - the Gumbel-max draw over that set, moved to K slots first: argmax(logit / T −
       log(−log u)), u from Philox at a seed read from device memory, so graph replays draw
       fresh numbers: a fresh ``torch.randint`` each call, or — one launch fewer in a decode
       step — the caller's (base, counter) pair of int64 device tensors, the seed being their
       sum (a decode loop's step counter advances it).
  The chunk ids and the winners pass between the phases of program 2 through a
  (rows, 3, K_PAD) int32 scratch (no register scatter in Triton), with a barrier between each
  store and its load. Against bisection, two scans and Philox over all K · CHUNK candidates:
  18.3 → 14.1 µs a call at (64, 151936) bf16, k 50, the same draws (notes/rollout.md, Session
  22). On sm_90 it launches with programmatic dependent launch, while the logits' writer
  drains, and lets its dependent (the decode loop's one-program bookkeeping) launch at once.

Temperature and top-k only; top-p needs the K values sorted and takes the torch path
(``ws_lab.rollout.sampling``).
"""
import math
import numbers

import torch
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ws_lab.check import SUPPORTED, Support, triton_supports
from ws_lab.kernels.decode.triton_common import has_pdl

# columns per chunk: the candidates are K · CHUNK values a row. 64: 38.6–39.8 µs a call at
# (64, 151936) bf16, k 50; 128: 44.6 (torch.topk: 126; notes/rollout.md, Session 17)
CHUNK = 64
CHUNKS_PER_PROGRAM = 32
MAX_K = 128
MAX_CHUNKS = 32768  # the selection packs two counts of ≤ 65535 keys into an int32 (2.1 M columns)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KEY_SHIFT = {torch.float16: 13, torch.bfloat16: 16, torch.float32: 0}  # zero low bits in fp32


@triton.jit
def order_key(x, SHIFT: tl.constexpr):
    """int32 whose signed order is the float order of x (fp32 bits; negatives flipped),
    shifted right by SHIFT: the fp32 bits of an fp16 (bf16) value end in 13 (16) zero bits,
    so the shift is exact and leaves the search 19 (16) bits instead of 32."""
    bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF) >> SHIFT


@triton.jit
def kth_largest_key(keys, K: tl.constexpr, lo, hi):
    """(τ, count(keys > τ)) for τ the K-th largest key, i.e. the largest t in [lo, hi) with
    count(keys ≥ t) ≥ K, given count(keys ≥ lo) ≥ K and hi above every key. A ternary
    search: two thresholds a round, their counts (≤ 65535 keys) packed into one int32 sum, so
    a round costs one block-wide reduction and cuts the range to a third (bisection: a half).
    (A 16-ary search, four int64 sums a round, was slower: notes/rollout.md, Session 18.)"""
    lo = lo.to(tl.int64)
    hi = hi.to(tl.int64)
    n_hi = tl.zeros([], tl.int32)  # count(keys ≥ hi)
    while hi - lo > 1:
        third = (hi - lo + 2) // 3
        t1 = lo + third
        t2 = tl.minimum(t1 + third, hi - 1)
        packed = tl.sum((keys >= t1).to(tl.int32) + ((keys >= t2).to(tl.int32) << 16))
        c1 = packed & 0xFFFF
        c2 = (packed >> 16) & 0xFFFF  # up to 32768: the sign bit, read back unsigned
        lo, hi, n_hi = (tl.where(c2 >= K, t2, tl.where(c1 >= K, t1, lo)),
                        tl.where(c2 >= K, hi, tl.where(c1 >= K, t2, t1)),
                        tl.where(c2 >= K, n_hi, tl.where(c1 >= K, c2, c1)))
    return lo.to(tl.int32), n_hi


@triton.jit
def first_k(keys, K: tl.constexpr, tau, n_above):
    """The K largest keys, given the K-th largest τ and count(keys > τ): every key above τ,
    then ties in flat order. Returns (mask, each kept key's 0-based rank among the kept in
    flat order), from one scan of the above and tie counts packed into an int32."""
    above = keys > tau
    tie = keys == tau
    upto = tl.cumsum(above.to(tl.int32) + (tie.to(tl.int32) << 16), axis=0)  # inclusive
    ties_upto = (upto >> 16) & 0xFFFF  # up to 32768: the sign bit, read back unsigned
    keep = above | (tie & (ties_upto <= K - n_above))
    return keep, (upto & 0xFFFF) + tl.minimum(ties_upto, K - n_above) - 1


@triton.jit
def min_max(a_min, a_max, b_min, b_max):
    return tl.minimum(a_min, b_min), tl.maximum(a_max, b_max)


@triton.jit
def _chunk_max_kernel(Logits, Maxes, cols, n_chunks, stride_row, CHUNK: tl.constexpr,
                      PER_PROGRAM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)
    col = chunk[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    x = tl.load(Logits + row * stride_row + col, mask=col < cols, other=float("-inf"))
    tl.store(Maxes + row * n_chunks + chunk, tl.max(x.to(tl.float32), axis=1),
             mask=chunk < n_chunks)


@triton.jit
def _top_k_sample_kernel(Logits, Maxes, Scratch, Seed, SeedCounter, Out, cols, n_chunks,
                         stride_row, inv_temperature, K: tl.constexpr, K_PAD: tl.constexpr,
                         CHUNK: tl.constexpr, CHUNKS_PAD: tl.constexpr, SHIFT: tl.constexpr,
                         COUNTER: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        # the step's bookkeeping (one small program) may launch now and wait for the draw
        gdc_launch_dependents()
        gdc_wait()  # launched while the logits' writer drains: its results first
    row = tl.program_id(0).to(tl.int64)
    scratch = Scratch + row * 3 * K_PAD  # chunk ids | winners' columns | their values
    # the K chunks with the largest maxima, compacted through the scratch row
    c = tl.arange(0, CHUNKS_PAD)
    maxes = tl.load(Maxes + row * n_chunks + c, mask=c < n_chunks, other=float("-inf"))
    max_keys = order_key(maxes, SHIFT)
    key_min, key_max = tl.reduce((max_keys, max_keys), 0, min_max)
    # the K-th largest chunk maximum: no more than the K-th largest value (K chunks reach it)
    floor, n_above = kth_largest_key(max_keys, K, key_min, key_max.to(tl.int64) + 1)
    keep, slot = first_k(max_keys, K, floor, n_above)
    tl.store(scratch + slot, c, mask=keep & (c < n_chunks))
    tl.debug_barrier()
    s = tl.arange(0, K_PAD)
    chunk = tl.load(scratch + s, mask=s < K, other=0)
    # the K largest of their K · CHUNK values; the row's maximum is the largest chunk maximum
    col = chunk[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    ok = (s < K)[:, None] & (col < cols)
    x = tl.load(Logits + row * stride_row + col, mask=ok, other=float("-inf")).to(tl.float32)
    flat_x = tl.reshape(x, [K_PAD * CHUNK])
    flat_col = tl.reshape(col, [K_PAD * CHUNK])
    keys = tl.where(tl.reshape(ok, [K_PAD * CHUNK]), order_key(flat_x, SHIFT), -2147483647 - 1)
    tau, n_above = kth_largest_key(keys, K, floor, key_max.to(tl.int64) + 1)
    top, slot = first_k(keys, K, tau, n_above)
    # the Gumbel-max draw over the K winners, moved to the front of the scratch row
    tl.store(scratch + K_PAD + slot, flat_col, mask=top)
    tl.store(scratch + 2 * K_PAD + slot, flat_x.to(tl.int32, bitcast=True), mask=top)
    tl.debug_barrier()
    win_col = tl.load(scratch + K_PAD + s, mask=s < K, other=0)
    win_x = tl.load(scratch + 2 * K_PAD + s, mask=s < K, other=0).to(tl.float32, bitcast=True)
    seed = tl.load(Seed)
    if COUNTER:
        seed += tl.load(SeedCounter)
    u = tl.rand(seed, row * cols + win_col)
    gumbel = -tl.log(-tl.log(tl.maximum(u, 1e-20)))
    score = tl.where(s < K, win_x * inv_temperature + gumbel, float("-inf"))
    token = tl.sum(tl.where(s == tl.argmax(score, axis=0), win_col, 0))
    tl.store(Out + row, token.to(tl.int64))


def supports(logits: torch.Tensor, k: int) -> Support:
    """Whether ``top_k_sample`` takes this call: a CUDA (or interpreted CPU) 2-D float tensor
    with unit column stride, 1 ≤ k ≤ MAX_K and k to MAX_CHUNKS chunks."""
    device = triton_supports(logits.device)
    if not device:
        return device
    if logits.dim() != 2 or logits.dtype not in DTYPES or logits.stride(-1) != 1:
        return Support(f"takes 2-D {DTYPES} logits with unit column stride, got "
                       f"{logits.dtype} {tuple(logits.shape)} strides {logits.stride()}")
    if not (1 <= k <= MAX_K and k <= triton.cdiv(logits.shape[1], CHUNK) <= MAX_CHUNKS):
        return Support(f"takes 1 ≤ k ≤ {MAX_K}, k to {MAX_CHUNKS} chunks of {CHUNK} columns, got "
                       f"k={k} over {logits.shape[1]} columns")
    return SUPPORTED


def top_k_sample(logits: torch.Tensor, k: int, temperature: float,
                 chunk_max: torch.Tensor | None = None,
                 seed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """(rows, V) logits -> (rows,) int64: one draw per row from softmax(logits / temperature)
    restricted to the row's k largest logits. ``chunk_max``: the (rows, ⌈V / CHUNK⌉) float32
    maxima of the first launch, when the logits' producer wrote them (the decode model's
    lm_head does, in its epilogue): one launch and one pass over the logits fewer.
    ``seed``: (base, counter), one-element int64 tensors on the logits' device whose sum seeds
    the draw — a caller that advances ``counter`` between calls (a decode loop's step) saves
    the ``torch.randint`` launch of each call; without it each call draws a seed."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"top_k_sample: logits must be a torch.Tensor, got {type(logits).__name__}")
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"top_k_sample: k must be an int, got {type(k).__name__} {k!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"top_k_sample: temperature must be a real number, got "
                        f"{type(temperature).__name__}")
    support = supports(logits, k)
    if not support:
        raise ValueError(f"top_k_sample: needs a CUDA 2-D {DTYPES} tensor with unit column "
                         f"stride, 1 ≤ k ≤ min({MAX_K}, chunks) and at most {MAX_CHUNKS} chunks "
                         f"of {CHUNK}; got {logits.dtype} {tuple(logits.shape)} on "
                         f"{logits.device}, k={k} ({support.reason})")
    if not (temperature > 0 and math.isfinite(temperature)):  # NaN fails both: refused
        raise ValueError(f"top_k_sample: temperature must be > 0 and finite, got {temperature}")
    rows, cols = logits.shape
    n_chunks = triton.cdiv(cols, CHUNK)
    k_pad = triton.next_power_of_2(k)
    if chunk_max is not None and (chunk_max.shape != (rows, n_chunks)
                                  or not chunk_max.is_contiguous()
                                  or chunk_max.dtype != torch.float32
                                  or chunk_max.device != logits.device):
        raise ValueError(f"top_k_sample: chunk_max must be a contiguous float32 ({rows}, "
                         f"{n_chunks}) tensor on {logits.device}; got {chunk_max.dtype} "
                         f"{tuple(chunk_max.shape)} with strides {chunk_max.stride()} on "
                         f"{chunk_max.device}")
    _check_seed(seed, logits.device)
    scratch = torch.empty(rows, 3, k_pad, dtype=torch.int32, device=logits.device)
    base, counter = seed if seed is not None else (
        torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=logits.device), None)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    maxes = chunk_max
    if chunk_max is None:
        maxes = torch.empty(rows, n_chunks, dtype=torch.float32, device=logits.device)
        _chunk_max_kernel[(rows, triton.cdiv(n_chunks, CHUNKS_PER_PROGRAM))](
            logits, maxes, cols, n_chunks, logits.stride(0), CHUNK=CHUNK,
            PER_PROGRAM=CHUNKS_PER_PROGRAM, num_warps=4)
    pdl = has_pdl(logits.device)
    _top_k_sample_kernel[(rows,)](
        logits, maxes, scratch, base, base if counter is None else counter, out, cols,
        n_chunks, logits.stride(0), 1.0 / temperature, K=k, K_PAD=k_pad, CHUNK=CHUNK,
        CHUNKS_PAD=triton.next_power_of_2(n_chunks), SHIFT=KEY_SHIFT[logits.dtype],
        COUNTER=counter is not None, PDL=pdl, num_warps=8, launch_pdl=pdl)
    return out


def _check_seed(seed, device):
    """A (base, counter) pair of one-element int64 tensors on ``device``, or None."""
    if seed is None:
        return
    if not (isinstance(seed, (tuple, list)) and len(seed) == 2):
        raise TypeError(f"top_k_sample: seed must be a (base, counter) pair of tensors, got "
                        f"{type(seed).__name__}")
    for name, t in zip(("base", "counter"), seed):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"top_k_sample: seed {name} must be a torch.Tensor, got "
                            f"{type(t).__name__}")
        if t.dtype != torch.int64 or t.numel() != 1 or t.device != device:
            raise ValueError(f"top_k_sample: seed {name} must be a one-element int64 tensor on "
                             f"{device}, got {t.dtype} {tuple(t.shape)} on {t.device}")


def static_specs(vocab=151936, k=50, dtype="bfloat16"):
    """sm_90 specialization of the top-k kernel (chunk maxima given, a (base, counter) seed) at
    Qwen2's vocabulary, for the static report."""
    from ws_lab.triton_static import StaticSpec

    types = {n: "i32" for n in _top_k_sample_kernel.arg_names}
    types.update(Logits={"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}[dtype],
                 Maxes="*fp32", Scratch="*i32", Seed="*i64", SeedCounter="*i64",
                 Out="*i64", inv_temperature="fp32")
    meta = dict(K=k, K_PAD=triton.next_power_of_2(k), CHUNK=CHUNK,
                CHUNKS_PAD=triton.next_power_of_2(triton.cdiv(vocab, CHUNK)),
                SHIFT=KEY_SHIFT[getattr(torch, dtype)], COUNTER=True, PDL=True)
    return [StaticSpec("top_k_sample", _top_k_sample_kernel, types, meta, dict(num_warps=8))]
