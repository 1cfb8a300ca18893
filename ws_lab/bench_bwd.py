"""The backward's suite for the one runner (``ws_lab.bench``): the lab's backward kernels
against TileOPs' GQA backward (``GQADenseBwdOp``, given the same out and lse), and SDPA's
flash / cuDNN / mem-efficient backends and FA-CuTe through autograd (each peer's forward runs
once, outside the timing; a timed call is the backward alone, its GQA sum over the group
included). Every implementation gets the same q, k, v, dout (and out, lse from the float64
oracle); the first set's dq, dk and dv are checked against autograd through the float64 oracle
(the lab's dq / dk / dv NaN-poisoned), the error a row shows being the worst of the three.
TFLOPS count the five backward GEMMs: 2.5 × the forward's FLOPs, as FlashAttention does.
"""
from __future__ import annotations

from typing import Callable

from ws_lab import bench, floors, registry, shapes

PEERS = ["tileops", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "fa-cute"]
BWD_FLOPS = 2.5  # × the forward's: Sᵀ, dPᵀ, dV, dK, dQ against S and PV
# q, k, v, out, dout and lse read once and dq, dk, dv written once: about twice the forward's
BWD_BYTES = 2


def _lab_impl(name: str):
    kernel = registry.get(name)

    def make(q, k, v, out, dout, lse, causal):
        import torch

        grads = {name: torch.full_like(t, float("nan")) for name, t in
                 (("dq", q), ("dk", k), ("dv", v))}
        return lambda: kernel.backward(q, k, v, out, dout, lse, causal, **grads)

    return make


def _tileops_impl():
    def make(q, k, v, out, dout, lse, causal):
        from tileops.attention import GQADenseBwdOp

        op = GQADenseBwdOp(is_causal=causal)
        return lambda: op(dout, q, k, v, out, lse)

    return make


def autograd_impl(forward_make: Callable):
    """A forward peer (``bench``'s make) run once with leaves that need grad; each timed call
    replays its backward through the kept graph."""
    def make(q, k, v, out, dout, lse, causal):
        import torch

        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        result = forward_make(*leaves, causal)()
        return lambda: torch.autograd.grad(result, leaves, dout, retain_graph=True)

    return make


def implementations(lab_kernels: list[str]) -> dict[str, Callable]:
    impls = {name: _lab_impl(name) for name in lab_kernels}
    impls["tileops"] = _tileops_impl()
    impls["sdpa-flash"] = autograd_impl(bench.sdpa_impl("FLASH_ATTENTION"))
    impls["sdpa-cudnn"] = autograd_impl(bench.sdpa_impl("CUDNN_ATTENTION"))
    impls["sdpa-efficient"] = autograd_impl(bench.sdpa_impl("EFFICIENT_ATTENTION"))
    impls["fa-cute"] = autograd_impl(bench.fa_cute_impl())
    return impls


def _problem_sets(shape: shapes.Shape):
    """bench's rotating (q, k, v) sets, each with its dout and the oracle's out (in q's dtype)
    and lse (fp32)."""
    import torch

    from ws_lab import oracle

    sets = []
    for q, k, v in bench.input_sets(shape, "cuda"):
        out, lse = oracle.attention_ref(q, k, v, causal=shape.causal)
        sets.append((q, k, v, out.to(q.dtype).contiguous(), torch.randn_like(q),
                     lse.float().contiguous()))
    return sets


def _worst_error(grads, want) -> float:
    from ws_lab import oracle

    return max(oracle.rel_l2(got, ref) for got, ref in zip(grads, want))


def measure(shape: shapes.Shape, impls: dict[str, Callable], is_lab: set[str],
            rounds: int = bench.DEFAULT_ROUNDS, timer: str = "rounds") -> list[bench.Row]:
    import torch

    from ws_lab import oracle

    sets = _problem_sets(shape)
    q, k, v, _, dout, _ = sets[0]
    want = oracle.attention_bwd_ref(q, k, v, dout, causal=shape.causal)
    mask = "causal" if shape.causal else "full"
    rows, timed = [], {}
    for name, make in impls.items():
        row = bench.Row(name, shape.name, shape.seq_len, mask, shape.dtype)
        call = bench.checked_cycle(row, lambda make=make: [make(*s, shape.causal) for s in sets],
                                   lambda grads: _worst_error(grads, want))
        if call:
            timed[name] = call
        rows.append(row)
    del want
    flops = BWD_FLOPS * shape.flops()
    bench.time_rows(rows, timed, rounds, flops, timer)
    torch.cuda.empty_cache()
    floor = floors.floor_ms(flops, BWD_BYTES * shape.min_bytes())
    rows.append(bench.floor_row(shape, floor, flops, len(sets), rounds, timer))
    return rows


BACKWARD = bench.Suite(PEERS, implementations, measure)
