"""Edge inputs for the decode kernels (issue #45): block ids outside the pool, positions outside
the cache, non-finite q / k / v, empty contexts. Each case lays its caches and output inside
guarded buffers (a fill value on both sides), runs one entry point and returns a ``Verdict``:
the rows that came out NaN or inf against those the float64 oracle makes so, the error on the rest,
and whether every guard and every cache slot the step must not write is bit for bit as before.
The CPU interpreter (tests/cpu/interpret_boundary.py) and the GPU suite
(tests/triton/test_boundary.py) run the same cases."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ws_lab import oracle
from ws_lab.decode_cases import make_decode
from ws_lab.paged_cases import make_paged

GUARD = 4096  # elements of fill value on each side of a guarded buffer
FILL = -1024.0  # exact in fp16, bf16 and fp32


@dataclass
class Verdict:
    nonfinite_rows: list  # (b, head) pairs that came out NaN or inf
    want_nonfinite_rows: list  # those the oracle makes so
    rel_err: float  # on the other rows, against the oracle
    guards_intact: bool  # the fill around the caches and the output
    unwritten_intact: bool  # cache slots the step must not write, bit for bit

    def ok(self, tol: float) -> bool:
        return (self.nonfinite_rows == self.want_nonfinite_rows and self.rel_err < tol and self.guards_intact
                and self.unwritten_intact)


def guarded(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a copy of t inside a buffer with GUARD fill elements on each side, that buffer)."""
    buf = torch.full((2 * GUARD + t.numel(),), FILL, dtype=t.dtype, device=t.device)
    view = buf[GUARD:GUARD + t.numel()].view(t.shape)
    view.copy_(t)
    return view, buf


def _fill_intact(buf: torch.Tensor) -> bool:
    edges = torch.cat([buf[:GUARD], buf[-GUARD:]])
    return torch.equal(edges, torch.full_like(edges, FILL))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _verdict(out, ref, bufs, unwritten) -> Verdict:
    finite = ref.isfinite().all(-1)
    got = sorted(map(tuple, (~out.isfinite().all(-1)).nonzero().tolist()))
    want = sorted(map(tuple, (~finite).nonzero().tolist()))
    err = oracle.rel_l2(out[finite], ref[finite]) if finite.any() else 0.0
    return Verdict(got, want, err, all(_fill_intact(b) for b in bufs), unwritten)


# --- paged decode -------------------------------------------------------------------------------

PAGED_CASES = ("id = num_blocks", "id = -1", "id = 2^31 - 1", "bad id past the context",
               "NaN in q", "inf in q", "NaN in k", "inf in v", "NaN in k past the context",
               "empty context, NaN q")


def paged_case(case: str, entry, dtype, device, heads=8, kv_heads=2, head_dim=128,
               block_size=16, lens=(40, 70, 0)) -> Verdict:
    """``entry(q, k_cache, v_cache, table, lens, out=...)`` on a 3-sequence problem (the third
    empty) with one edge of ``case``."""
    (q, k, v, table, ctx), _ = make_paged(len(lens), heads, kv_heads, head_dim, block_size,
                                          list(lens), dtype, device)
    num_blocks = k.shape[0]
    last = (lens[1] - 1) // block_size  # sequence 1's last block column
    if case.startswith("id ="):
        table[1, last] = {"id = num_blocks": num_blocks, "id = -1": -1,
                          "id = 2^31 - 1": 2**31 - 1}[case]
    elif case == "bad id past the context":  # sequence 0 is the shorter: its row has room
        table[0, (lens[0] - 1) // block_size + 1] = num_blocks
    elif case in ("NaN in q", "inf in q"):
        q[0, 3, 5] = float("nan") if case == "NaN in q" else float("inf")
    elif case in ("NaN in k", "inf in v", "NaN in k past the context"):
        token = lens[1] + 3 if case.endswith("context") else 17
        cache = v if case == "inf in v" else k
        cache[table[1, token // block_size], token % block_size, 1, 9] = (
            float("inf") if case == "inf in v" else float("nan"))
    elif case == "empty context, NaN q":
        q[2] = float("nan")
    ref = oracle.paged_attention_ref(q, k, v, table, ctx)
    (k, k_buf), (v, v_buf) = guarded(k), guarded(v)
    out, out_buf = guarded(torch.full_like(q, float("nan")))
    k_before, v_before = k.clone(), v.clone()
    entry(q, k, v, table, ctx, out=out)
    return _verdict(out, ref, (k_buf, v_buf, out_buf),
                    torch.equal(_bits(k), _bits(k_before)) and torch.equal(_bits(v), _bits(v_before)))


# --- fused decode -------------------------------------------------------------------------------

FUSED_CASES = ("position = capacity", "position = -1", "position = 2^31 - 1", "NaN in q",
               "NaN in k_new", "inf in v_new")
FUSED_PAGED_CASES = FUSED_CASES + ("written block outside the pool", "read block outside the pool")


def fused_case(case: str, entry, dtype, device, block_size=None, heads=14, kv_heads=2,
               head_dim=64, capacity=96, positions=(40, 70, 5)) -> Verdict:
    """``entry(*problem.args(), out=...)`` (static caches, or paged with ``block_size``) with
    one edge of ``case``; sequence 1 carries it."""
    p = make_decode(len(positions), heads, kv_heads, head_dim, capacity, list(positions), dtype,
                    device, block_size=block_size)
    bad = {"position = capacity": capacity, "position = -1": -1,
           "position = 2^31 - 1": 2**31 - 1}.get(case)
    if bad is not None:
        p.positions[1] = bad
    elif case == "NaN in q":
        p.q[1, 2, 7] = float("nan")
    elif case == "NaN in k_new":
        p.k_new[1, 0, 3] = float("nan")
    elif case == "inf in v_new":
        p.v_new[1, 1, 3] = float("inf")
    elif case.endswith("outside the pool"):
        column = positions[1] // block_size if case.startswith("written") else 0
        p.block_table[1, column] = p.k_cache.shape[0] + 3
    ref, _, (k_after, v_after) = oracle.fused_decode_ref(*(
        t.clone() if isinstance(t, torch.Tensor) else t for t in (
            p.q, p.k_new, p.v_new, p.k_cache, p.v_cache, p.cos, p.sin, p.positions)),
        block_table=p.block_table)
    k_before, v_before = p.k_cache.clone(), p.v_cache.clone()
    (p.k_cache, k_buf), (p.v_cache, v_buf) = guarded(p.k_cache), guarded(p.v_cache)
    out, out_buf = guarded(torch.full_like(p.q, float("nan")))
    entry(*p.args(), out=out)
    # slots the oracle leaves as they were must be as they were, bit for bit
    same = [(_bits(a) == _bits(b)) for a, b in ((k_after, k_before), (v_after, v_before))]
    unwritten = all(torch.equal(_bits(c)[s], _bits(b)[s])
                    for c, b, s in zip((p.k_cache, p.v_cache), (k_before, v_before), same))
    return _verdict(out, ref.to(out.device), (k_buf, v_buf, out_buf), unwritten)
