"""Random fused-decode problems (RoPE tables, static or paged caches, device positions) and
their check against the float64 oracle, shared by the interpreter tests, the GPU tests and
bench/decode.py. Cache slots at and past each position are poisoned with NaN: a kernel that
reads past its context turns the output NaN, and one that writes a stray slot is caught by the
untouched-slot check."""
import math
import secrets
from dataclasses import dataclass

import torch

from ws_lab import oracle
from ws_lab.rope import rope_tables

# rel-L2 of the output vs the float64 oracle (bf16 meets vLLM's atol 1.5e-2 / rtol 1e-2 too)
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.2e-2}


@dataclass
class DecodeProblem:
    q: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor
    block_table: torch.Tensor | None
    seed: int

    def args(self):
        """The call's positional arguments, in the order of the static or the paged entry."""
        if self.block_table is None:
            return (self.q, self.k_new, self.v_new, self.k_cache, self.v_cache, self.cos,
                    self.sin, self.positions)
        return (self.q, self.k_new, self.v_new, self.k_cache, self.v_cache, self.block_table,
                self.cos, self.sin, self.positions)


def make_decode(batch, heads, kv_heads, head_dim, capacity, positions, dtype, device,
                block_size=None, seed=None) -> DecodeProblem:
    """A fresh problem: N(0, 1) q, k_new, v_new and cache contents before each position, NaN at
    and after it. ``block_size``: paged caches (each sequence its own blocks, pool shuffled)."""
    seed = secrets.randbits(31) if seed is None else seed
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    pos = torch.tensor(positions, dtype=torch.int32, device=device)
    cos, sin = rope_tables(capacity, head_dim, dtype=dtype, device=device)
    live = torch.arange(capacity, device=device)[None, :] < pos[:, None].long()  # (B, capacity)
    if block_size is None:
        k_cache, v_cache = (randn(batch, kv_heads, capacity, head_dim) for _ in range(2))
        for cache in (k_cache, v_cache):
            cache.masked_fill_(~live[:, None, :, None], float("nan"))
        table = None
    else:
        max_blocks = math.ceil(capacity / block_size)
        num_blocks = batch * max_blocks + 5
        k_cache, v_cache = (torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"),
                                       dtype=dtype, device=device) for _ in range(2))
        table = (torch.randperm(num_blocks, generator=gen, device=device)[:batch * max_blocks]
                 .view(batch, max_blocks).to(torch.int32))
        for b in range(batch):
            n = int(positions[b])
            tokens = torch.arange(n, device=device)
            blocks, slots = table[b, tokens // block_size].long(), tokens % block_size
            k_cache[blocks, slots] = randn(n, kv_heads, head_dim)
            v_cache[blocks, slots] = randn(n, kv_heads, head_dim)
    return DecodeProblem(randn(batch, heads, head_dim), randn(batch, kv_heads, head_dim),
                         randn(batch, kv_heads, head_dim), k_cache, v_cache, cos, sin, pos, table,
                         seed)


@dataclass
class DecodeCheck:
    rel_err: float
    tolerance: float
    k_slot_ulps: float  # largest |written − reference| in units of the reference's ulp
    v_slot_exact: bool
    untouched_exact: bool
    seed: int

    @property
    def ok(self) -> bool:
        return (self.rel_err <= self.tolerance and self.k_slot_ulps <= 1 and self.v_slot_exact
                and self.untouched_exact)


def _same(a, b) -> bool:
    """Bitwise equal, NaNs included."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def check_decode(fn, problem: DecodeProblem, softmax_scale=None) -> DecodeCheck:
    """Runs ``fn(*problem.args(), out=)`` into a NaN-poisoned output and compares the output, the
    written slots and every other slot with the float64 oracle's step."""
    out = torch.full_like(problem.q, float("nan"))
    return check_step(problem, lambda: fn(*problem.args(), softmax_scale=softmax_scale, out=out),
                      out, softmax_scale)


def check_step(p: DecodeProblem, run, out, softmax_scale=None) -> DecodeCheck:
    """The oracle's step on the problem as it stands, then ``run()`` (which writes ``out`` and
    the caches, e.g. a CUDA-graph replay), then the comparison."""
    ref, _, (k_after, v_after) = oracle.fused_decode_ref(
        p.q, p.k_new, p.v_new, p.k_cache, p.v_cache, p.cos, p.sin, p.positions, softmax_scale,
        p.block_table)
    written = _written_mask(p)
    run()
    k_ref = k_after[written].to(torch.float64)
    ulp = torch.finfo(p.q.dtype).eps * k_ref.abs().clamp_min(torch.finfo(p.q.dtype).tiny)
    k_ulps = ((p.k_cache[written].to(torch.float64) - k_ref).abs() / ulp).max().item()
    return DecodeCheck(oracle.rel_l2(out, ref), TOLERANCE[p.q.dtype], k_ulps,
                       _same(p.v_cache[written], v_after[written]),
                       _same(p.k_cache[~written], k_after[~written])
                       and _same(p.v_cache[~written], v_after[~written]), p.seed)


def graph_replays(p: DecodeProblem, step, out, steps, seed=1):
    """Runs ``step`` (which writes ``out`` and the caches) once outside a capture (compiles,
    allocates), captures it once as a CUDA graph, then per replay: fresh q / k_new / v_new,
    ``out`` NaN-poisoned, the replay checked against the oracle's step on the caches as they
    stand, every position advanced by one. Yields (sequence 0's position, DecodeCheck)."""
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(steps):
        for t in (p.q, p.k_new, p.v_new):
            t.copy_(torch.randn(t.shape, generator=gen, device="cuda").to(t.dtype))
        out.fill_(float("nan"))
        yield int(p.positions[0]), check_step(p, graph.replay, out)
        p.positions.add_(1)


def _written_mask(p: DecodeProblem) -> torch.Tensor:
    """True at the cache rows (one per sequence and KV head) the step writes."""
    mask = torch.zeros(p.k_cache.shape[:-1], dtype=torch.bool, device=p.k_cache.device)
    for b in range(p.q.shape[0]):
        pos = int(p.positions[b])
        if p.block_table is None:
            mask[b, :, pos] = True
        else:
            bs = p.k_cache.shape[1]
            mask[int(p.block_table[b, pos // bs]), pos % bs] = True
    return mask
