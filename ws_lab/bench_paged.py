"""The runner's decode path: paged decode attention rows, measured in one process.

Each row times every mode of ``kernels.paged``, torch SDPA on the same K/V made contiguous
(``enable_gqa=True``, the copy not timed), TileOPs' ``GQAPagedFwdOp`` and the HBM floor (bytes
that must move over the read ceiling measured in the same process, ``floors``). Correctness of
each mode is checked against the float64 oracle on the row's own inputs first. Every timing
rotates through enough input sets to hold 4× the L2 (``rotation``), so no row times the cache.
"""
from dataclasses import dataclass, field

import torch

from ws_lab import floors, oracle, registry, timing
from ws_lab.paged_cases import make_paged


@dataclass(frozen=True)
class PagedRow:
    name: str
    batch: int
    heads: int
    kv_heads: int
    context: int
    head_dim: int = 128
    block_size: int = 16
    dtype: str = "float16"

    def kv_bytes(self) -> int:
        elem = torch.finfo(getattr(torch, self.dtype)).bits // 8
        return 2 * self.batch * self.context * self.kv_heads * self.head_dim * elem


@dataclass
class PagedResult:
    row: PagedRow
    us: dict = field(default_factory=dict)  # impl -> µs (None: failed)
    errors: dict = field(default_factory=dict)  # mode -> rel-L2 vs oracle
    peer_errors: dict = field(default_factory=dict)  # peer -> rel-L2 vs oracle
    notes: dict = field(default_factory=dict)
    read_gbps: float = 0.0  # the read ceiling (read_bandwidth_gbps)


MAX_SETS = 1024  # the smallest sweep rows (0.3 MB of K/V) need ~700 sets to cover 4× the L2


def rotation(row: PagedRow) -> int:
    """Input sets to rotate through: back-to-back replays over one K/V that fits in L2 would
    time the L2 (a 34 MB row ran at 109 % of HBM copy bandwidth that way)."""
    return max(2, timing.rotation_count(row.kv_bytes(), "cuda", cap=MAX_SETS))


def measure_row(row: PagedRow, modes, read_gbps, with_peers=True, config=None) -> PagedResult:
    """Checks each mode against the oracle on the first input set, then times every
    implementation rotating over ``rotation(row)`` sets (same block tables, own K/V and q)."""
    paged = registry.decode("paged")

    launch = {} if config is None else {"config": config}

    res = PagedResult(row, read_gbps=read_gbps)
    dtype = getattr(torch, row.dtype)
    (q, kc, vc, table, lens), _ = make_paged(row.batch, row.heads, row.kv_heads, row.head_dim,
                                             row.block_size, [row.context] * row.batch, dtype,
                                             "cuda")
    ref = oracle.paged_attention_ref(q, kc, vc, table, lens)
    sets = [(q, kc, vc)] + [(q.clone(), kc.clone(), vc.clone()) for _ in range(rotation(row) - 1)]
    res.notes["sets"] = len(sets)
    for mode in modes:
        out = torch.full_like(q, float("nan"))
        # a column is a Triton mode, "auto", or "cuda" (the CUDA backend)
        kwargs = dict(backend="cuda") if mode == "cuda" else dict(mode=mode, **launch)
        try:
            paged.paged_attention(q, kc, vc, table, lens, out=out, **kwargs)
        except (TypeError, ValueError) as exc:  # outside the backend's scope: n/a
            res.us[mode] = None
            res.notes[mode] = timing.failure_note(exc)
            continue
        res.errors[mode] = oracle.rel_l2(out, ref)
        res.us[mode] = timing.graph_replay_us([
            lambda s=s, kw=kwargs: paged.paged_attention(s[0], s[1], s[2], table, lens, out=out,
                                                         **kw) for s in sets])
    res.notes["auto"] = paged.plan_for(q, kc, table, config=config, v_cache=vc).kernel
    if with_peers:
        _measure_peers(res, sets, table, lens, ref)
    res.us["floor"] = 1e3 * floors.floor_ms(nbytes=row.kv_bytes(), gbps=read_gbps)
    del sets
    torch.cuda.empty_cache()
    return res


def _measure_peers(res, sets, table, lens, ref):
    """SDPA on contiguous copies of the same K/V, TileOPs' and FA-CuTe's paged ops on the same
    cache and table; each checked against the oracle on the first set, then timed."""
    import torch.nn.functional as F

    row = res.row
    n_blocks = -(-row.context // row.block_size)
    rows = table[:, :n_blocks].long()

    def contiguous(cache):
        return cache[rows].flatten(1, 2)[:, :row.context].transpose(1, 2).contiguous()

    try:
        dense = [(q[:, :, None, :], contiguous(kc), contiguous(vc)) for q, kc, vc in sets]
        sdpa = [lambda d=d: F.scaled_dot_product_attention(
            *d, enable_gqa=row.heads != row.kv_heads) for d in dense]
        res.peer_errors["sdpa"] = oracle.rel_l2(sdpa[0]()[:, :, 0], ref)
        res.us["sdpa"] = timing.graph_replay_us(sdpa)
        del dense, sdpa
    except RuntimeError as exc:
        res.notes["sdpa"] = timing.failure_note(exc)
    for name, make in (("tileops", _tileops_calls), ("fa-cute", _fa_cute_calls)):
        try:
            calls = make(sets, table, lens)
            res.peer_errors[name] = oracle.rel_l2(calls[0](), ref)
            res.us[name] = timing.graph_replay_us(calls)
        except Exception as exc:  # absent or refusing: n/a
            res.notes[name] = timing.failure_note(exc)


def _tileops_calls(sets, table, lens):
    from tileops.attention import GQAPagedFwdOp

    op = GQAPagedFwdOp()
    cu = torch.arange(len(lens) + 1, dtype=torch.int32, device=lens.device)
    return [lambda s=s: op(s[0], s[1], s[2], table, lens, cu) for s in sets]


def _fa_cute_calls(sets, table, lens):
    """FlashAttention's CuTe-DSL forward over the paged cache (page_table + seqused_k). On
    sm_90 it has no split-KV, so it runs with num_splits=1: one CTA per (sequence, head
    group) walks the whole context."""
    from flash_attn.cute import flash_attn_varlen_func

    def call(q, kc, vc):
        out = flash_attn_varlen_func(q[:, None], kc, vc, page_table=table, seqused_k=lens,
                                     num_splits=1)
        return (out[0] if isinstance(out, tuple) else out)[:, 0]

    return [lambda s=s: call(*s) for s in sets]


def table(results, modes) -> str:
    cols = list(modes) + ["sdpa", "tileops", "fa-cute", "floor"]
    head = (["row", "B", "Hq/Hkv", "ctx", "KV MB", "sets"] + [f"{c} µs" for c in cols]
            + ["auto picks", "auto GB/s", "auto % read", "auto ×SDPA"]
            + (["cuda ×SDPA"] if "cuda" in modes else []) + ["max rel-err", "peers' max rel-err"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        auto = r.us.get("auto")
        gbps = r.row.kv_bytes() / (auto * 1e-6) / 1e9 if auto else None
        sdpa = r.us.get("sdpa")
        cells = [r.row.name, str(r.row.batch), f"{r.row.heads}/{r.row.kv_heads}", str(r.row.context),
                 f"{r.row.kv_bytes() / 1e6:.0f}", str(r.notes.get("sets", 1))]
        cells += ["n/a" if r.us.get(c) is None else f"{r.us[c]:.1f}" for c in cols]
        cells += [r.notes.get("auto", ""), "n/a" if gbps is None else f"{gbps:.0f}",
                  "n/a" if gbps is None else f"{100 * gbps / r.read_gbps:.0f}",
                  "n/a" if not (auto and sdpa) else f"{sdpa / auto:.2f}"]
        if "cuda" in modes:
            cuda = r.us.get("cuda")
            cells.append("n/a" if not (cuda and sdpa) else f"{sdpa / cuda:.3f}")
        cells += [f"{max(r.errors.values()):.1e}" if r.errors else "n/a",
                  f"{max(r.peer_errors.values()):.1e}" if r.peer_errors else "n/a"]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- {r.row.name}: {k}: {v}" for r in results for k, v in r.notes.items()
             if k not in ("auto", "sets")]
    notes.append("- fa-cute: FlashAttention's CuTe-DSL forward, num_splits=1 (no split-KV on sm_90)")
    return "\n".join(lines + ([""] + notes if notes else []))


def within(results, tolerance=0.05) -> tuple[int, int]:
    """How many rows have auto within ``tolerance`` of the best single mode it chooses from
    (``paged.AUTO_CHOICES``; backend="cuda" where it ran)."""
    paged = registry.decode("paged")

    hits = 0
    for r in results:
        best = min(r.us[m] for m in paged.AUTO_CHOICES if r.us.get(m) is not None)
        hits += r.us["auto"] <= (1 + tolerance) * best
    return hits, len(results)


def sweep_rows() -> list[PagedRow]:
    """B × heads × context: 84 shapes, 82 within 8 GB of KV."""
    rows = [PagedRow("sweep", batch, heads, kv_heads, context)
            for batch in (1, 2, 4, 8, 16, 32, 64)
            for heads, kv_heads in ((32, 32), (32, 8), (64, 8), (32, 1))
            for context in (512, 4096, 16384)]
    return [r for r in rows if r.kv_bytes() <= 8e9]


def rule_table(results) -> str:
    """Per sweep row: the features the auto rule may use and each mode's time (n/a: outside
    backend="cuda"'s scope)."""
    paged = registry.decode("paged")

    modes = paged.AUTO_CHOICES
    lines = ["| B | Hq/Hkv | ctx | B·Hkv | " + " | ".join(f"{m} µs" for m in modes)
             + " | best | auto |", "|" + "---|" * (len(modes) + 6)]
    for r in results:
        timed = [m for m in modes if r.us.get(m) is not None]
        best = min(timed, key=lambda m: r.us[m])
        lines.append(f"| {r.row.batch} | {r.row.heads}/{r.row.kv_heads} | {r.row.context} | "
                     f"{r.row.batch * r.row.kv_heads} | "
                     + " | ".join("n/a" if r.us.get(m) is None else f"{r.us[m]:.1f}"
                                  for m in modes)
                     + f" | {best} | {r.notes['auto']} |")
    return "\n".join(lines)

