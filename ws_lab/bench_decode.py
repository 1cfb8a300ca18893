"""The runner's per-layer decode path: one decode step of one attention layer (RoPE on q and the
new k, the KV-cache write, attention over [0, position]), every implementation in one process,
on the same inputs, each checked against the float64 oracle once and timed by CUDA-graph
replays (``timing.graph_replay_us``) cycling through enough input sets that the bytes they read
hold 4× the L2 (at most MAX_SETS):

  fused        kernels/decode/fused_decode.py on HF-StaticCache-layout caches (B, Hkv, Lmax, D);
  unfused      HF's apply_rotary_pos_emb, index_copy_ of k / v into the static cache, then SDPA:
               "eager" over a length slice of the cache (plain do_bench: host launches
               included), "graph" over the whole cache with a mask (HF's static-cache path);
  paged+rope   the same RoPE and a scatter into a paged cache (16-token blocks, each sequence
               its own), then kernels/decode/paged.py's ``auto``;
  floor        the K/V bytes the step must read over the measured read ceiling (``floors``).

cos / sin per step and the mask are built once per step in a model and shared by its layers:
they are made outside the timed call.
"""
import math
from dataclasses import dataclass, field

import torch

from ws_lab import floors, oracle, registry, timing
from ws_lab.decode_cases import TOLERANCE
from ws_lab.rope import apply_rope, rope_tables

MAX_SETS = 32


@dataclass(frozen=True)
class DecodeRow:
    name: str
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    capacity: int  # Lmax of the static cache
    position: int  # every sequence decodes this position (context position + 1 tokens)
    dtype: str = "bfloat16"

    def kv_bytes_read(self) -> int:
        elem = torch.finfo(getattr(torch, self.dtype)).bits // 8
        return 2 * self.batch * self.kv_heads * (self.position + 1) * self.head_dim * elem

    def label(self) -> str:
        return f"{self.name} B{self.batch} pos {self.position}"


@dataclass
class DecodeResult:
    row: DecodeRow
    us: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)
    notes: dict = field(default_factory=dict)
    read_gbps: float = 0.0  # the read ceiling (bench_paged.read_bandwidth_gbps)


def hf_rope():
    """HF's ``apply_rotary_pos_emb`` (Qwen2's) where transformers is installed, else the same
    formula written here; returns (function, where it came from)."""
    try:
        from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb
        return apply_rotary_pos_emb, "transformers"
    except ImportError:
        def apply(q, k, cos, sin, unsqueeze_dim=1):
            cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
            return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return apply, "local copy"


class _Set:
    """One input set of a row: the step's q, k_new, v_new, static and paged caches with random
    contents before the position, and everything a model builds once per step."""

    def __init__(self, row: DecodeRow, cos, sin, gen):
        dtype, dev = getattr(torch, row.dtype), "cuda"
        b, hq, hkv, d, cap = row.batch, row.heads, row.kv_heads, row.head_dim, row.capacity

        def randn(*shape):
            return torch.randn(*shape, generator=gen, device=dev).to(dtype)

        self.q, self.k_new, self.v_new = randn(b, hq, d), randn(b, hkv, d), randn(b, hkv, d)
        self.k_cache, self.v_cache = randn(b, hkv, cap, d), randn(b, hkv, cap, d)
        self.positions = torch.full((b,), row.position, dtype=torch.int32, device=dev)
        self.cache_position = torch.tensor([row.position], device=dev)
        self.cos_b, self.sin_b = cos[self.positions.long()][:, None], sin[self.positions.long()][:, None]
        self.mask = (torch.arange(cap, device=dev)[None, :] <= self.positions[:, None])[:, None, None]
        bs = 16
        blocks = math.ceil(cap / bs)
        self.table = (torch.randperm(b * blocks, generator=gen, device=dev).view(b, blocks)
                      .to(torch.int32))
        # paged caches holding the same tokens: block table[b, j] holds tokens j·bs … j·bs + 15
        self.kp_cache = torch.empty(b * blocks, bs, hkv, d, dtype=dtype, device=dev)
        self.vp_cache = torch.empty_like(self.kp_cache)
        for dst, src in ((self.kp_cache, self.k_cache), (self.vp_cache, self.v_cache)):
            dst[self.table.long()] = src.transpose(1, 2).reshape(b, blocks, bs, hkv, d)
        pos = self.positions.long()
        self.write_block = self.table.long()[torch.arange(b, device=dev), pos // bs]
        self.write_slot = pos % bs
        self.lens = self.positions + 1


def _implementations(row: DecodeRow, apply_rope):
    import torch.nn.functional as F

    fused, paged = registry.decode("fused"), registry.decode("paged")
    gqa = row.heads != row.kv_heads

    def fused_call(s, cos, sin, out):
        return lambda: fused.fused_decode_attention(s.q, s.k_new, s.v_new, s.k_cache, s.v_cache,
                                                    cos, sin, s.positions, out=out)

    def unfused(s, masked):
        def call():
            q, k = apply_rope(s.q[:, :, None], s.k_new[:, :, None], s.cos_b, s.sin_b)
            s.k_cache.index_copy_(2, s.cache_position, k)
            s.v_cache.index_copy_(2, s.cache_position, s.v_new[:, :, None])
            if masked:
                o = F.scaled_dot_product_attention(q, s.k_cache, s.v_cache, attn_mask=s.mask,
                                                   enable_gqa=gqa)
            else:
                n = row.position + 1
                o = F.scaled_dot_product_attention(q, s.k_cache[:, :, :n], s.v_cache[:, :, :n],
                                                   enable_gqa=gqa)
            return o[:, :, 0]
        return call

    def paged_rope(s):
        def call():
            q, k = apply_rope(s.q[:, :, None], s.k_new[:, :, None], s.cos_b, s.sin_b)
            s.kp_cache[s.write_block, s.write_slot] = k[:, :, 0]
            s.vp_cache[s.write_block, s.write_slot] = s.v_new
            return paged.paged_attention(q[:, :, 0], s.kp_cache, s.vp_cache, s.table, s.lens)
        return call

    return fused_call, unfused, paged_rope


def measure_row(row: DecodeRow, read_gbps: float) -> DecodeResult:
    import triton.testing

    res = DecodeResult(row, read_gbps=read_gbps)
    apply_rope, source = hf_rope()
    res.notes["rope"] = source
    dtype = getattr(torch, row.dtype)
    cos, sin = rope_tables(row.capacity, row.head_dim, dtype=dtype, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    n_sets = timing.rotation_count(row.kv_bytes_read(), "cuda", cap=MAX_SETS)
    sets = [_Set(row, cos, sin, gen) for _ in range(n_sets)]
    res.notes["sets"] = n_sets
    s0 = sets[0]
    ref, _, _ = oracle.fused_decode_ref(s0.q, s0.k_new, s0.v_new, s0.k_cache, s0.v_cache, cos,
                                        sin, s0.positions)
    fused_call, unfused, paged_rope = _implementations(row, apply_rope)
    out = torch.full_like(s0.q, float("nan"))
    calls = {"fused": [fused_call(s, cos, sin, out) for s in sets],
             "unfused graph": [unfused(s, True) for s in sets],
             "paged+rope": [paged_rope(s) for s in sets]}
    for name, impl in calls.items():
        try:
            res.errors[name] = oracle.rel_l2(impl[0](), ref)  # fused: into the NaN-filled out
            res.us[name] = timing.graph_replay_us(impl)
        except Exception as exc:  # a peer that cannot run the row shows n/a
            res.notes[name] = timing.failure_note(exc)
    eager = unfused(s0, False)
    res.errors["unfused eager"] = oracle.rel_l2(eager(), ref)
    res.us["unfused eager"] = 1e3 * triton.testing.do_bench(eager, warmup=25, rep=100,
                                                            return_mode="median")
    res.us["floor"] = 1e3 * floors.floor_ms(nbytes=row.kv_bytes_read(), gbps=read_gbps)
    for name, err in res.errors.items():
        if not err <= TOLERANCE[dtype]:
            res.notes[name + " rel-err"] = f"{err:.2e} over the tolerance {TOLERANCE[dtype]:.1e}"
    del sets
    torch.cuda.empty_cache()
    return res


COLUMNS = ["fused", "unfused graph", "unfused eager", "paged+rope", "floor"]


def table(results) -> str:
    head = (["row", "Hq/Hkv", "D", "Lmax", "sets"] + [f"{c} µs" for c in COLUMNS]
            + ["fused ×unfused graph", "fused ×eager", "fused ×paged+rope", "fused % read",
               "max rel-err"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        us = r.us
        fused = us.get("fused")

        def gap(peer):
            return f"{us[peer] / fused:.2f}" if fused and us.get(peer) else "n/a"

        pct = (f"{100 * r.row.kv_bytes_read() / (fused * 1e-6) / 1e9 / r.read_gbps:.0f}"
               if fused else "n/a")
        cells = [r.row.label(), f"{r.row.heads}/{r.row.kv_heads}", str(r.row.head_dim),
                 str(r.row.capacity), str(r.notes.get("sets", 1))]
        cells += ["n/a" if us.get(c) is None else f"{us[c]:.1f}" for c in COLUMNS]
        cells += [gap("unfused graph"), gap("unfused eager"), gap("paged+rope"), pct,
                  f"{max(r.errors.values()):.1e}" if r.errors else "n/a"]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- {r.row.label()}: {k}: {v}" for r in results for k, v in r.notes.items()
             if k not in ("sets",)]
    return "\n".join(lines + ([""] + sorted(set(notes)) if notes else []))
