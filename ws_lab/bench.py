"""The lab's one benchmark runner: every kernel and every peer, measured in one process.

For each shape × mask × dtype it checks each implementation once against the float64 oracle
(NaN-poisoned output for the lab's kernels), times it with ``triton.testing.do_bench`` (median,
rotating input sets when they fit in L2) in interleaved rounds — every implementation once per
round, in a fresh seeded shuffle each round, so none is always measured at the same point of
the GPU's clock and temperature drift or right after the same neighbour (``timing.round_orders``); a
row's time is the median of its round medians and
``spread`` their range — and prints one markdown table with the gap columns:
``×peer`` = peer time / row time (> 1: the row is faster). A peer that fails or is absent shows
``n/a`` and never stops the run. Without CUDA it prints the static report (emitted CUDA + SASS
summary) instead.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from ws_lab import floors, registry, shapes, timing
from ws_lab.shapes import DTYPES

PEERS = ["fa3", "sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "pipelined", "tileops", "fa-cute"]
GAP_LABEL = {"fa3": "×FA3", "sdpa-cudnn": "×cuDNN", "sdpa-flash": "×flash",
             "sdpa-efficient": "×mem-eff", "pipelined": "×pipelined", "tileops": "×TileOPs",
             "fa-cute": "×FA-CuTe", "fa3-fp8": "×FA3-FP8", "tileops-fp8": "×TileOPs-FP8",
             "coop-overlap-persistent": "×persistent"}


@dataclass
class Row:
    impl: str
    shape: str
    seq_len: int
    mask: str
    dtype: str
    ms: float | None = None
    tflops: float | None = None
    rel_err: float | None = None
    spread: float | None = None  # (max - min) / median of the round medians
    round_ms: list[float] | None = None  # the median of each round, in measuring order
    note: str = ""


def floor_ms(shape: shapes.Shape) -> float:
    """The shape's floor (``floors.floor_ms``): its FLOPs on the tensor cores, or its bytes at
    the HBM copy rate."""
    return floors.floor_ms(shape.flops(), shape.min_bytes())


# --- implementations: each returns a zero-argument callable producing a BSHD-shaped output ---

def _lab_impl(name: str):
    kernel = registry.get(name)

    def make(q, k, v, causal):
        import torch

        fn = kernel.attention
        out = torch.empty(*q.shape[:3], v.shape[3], dtype=q.dtype, device=q.device)
        return lambda: fn(q, k, v, causal=causal, out=out)

    return make


def sdpa_impl(backend_name: str):
    def make(q, k, v, causal):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        group = q.shape[2] // k.shape[2]

        def call(kk, vv, gqa):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kk, vv, is_causal=causal,
                                                      enable_gqa=gqa).transpose(1, 2)

        try:
            with warnings.catch_warnings():  # the backend's "why not" warning; n/a says it
                warnings.simplefilter("ignore")
                call(kt, vt, group > 1)
            return lambda: call(kt, vt, group > 1)
        except RuntimeError:
            if group == 1:
                raise
        # This backend has no GQA: expand K/V once, outside the timed call.
        ke, ve = (t.repeat_interleave(group, dim=1) for t in (kt, vt))
        call(ke, ve, False)
        return lambda: call(ke, ve, False)

    return make


def _tileops_impl():
    def make(q, k, v, causal):
        from tileops.attention import GQADenseFwdOp

        op = GQADenseFwdOp(is_causal=causal)
        return lambda: op(q, k, v)

    return make


def fa_cute_impl():
    """FlashAttention's CuTe-DSL forward (flash-attn-4's ``flash_attn.cute``; on sm_90 its
    FlashAttentionForwardSm90, the FA3 design), BSHD with native GQA."""
    def make(q, k, v, causal):
        from flash_attn.cute import flash_attn_func

        def call():
            out = flash_attn_func(q, k, v, causal=causal)
            return out[0] if isinstance(out, tuple) else out  # (out, lse) in some versions

        return call

    return make


def _fa3_impl():
    """FlashAttention-3's own C++ Hopper forward (the ``fa3-fwd`` wheel: ``hopper/`` built
    forward-only, bf16 and FP8, no fp16; ``../shared/gpu/bundle-fa3``), BSHD with native GQA and
    the (64, 512) LargeHeadDimV pair."""
    def make(q, k, v, causal):
        import torch
        from fa3_fwd_interface import flash_attn_func

        if q.dtype != torch.bfloat16:
            raise TypeError(f"fa3-fwd is built for bf16 and FP8 only, got {q.dtype}")

        def call():
            out = flash_attn_func(q, k, v, causal=causal)
            return out[0] if isinstance(out, tuple) else out  # (out, lse) on request

        return call

    return make


def implementations(lab_kernels: list[str]) -> dict[str, Callable]:
    impls = {name: _lab_impl(name) for name in dict.fromkeys(lab_kernels + ["pipelined"])}
    impls["sdpa-cudnn"] = sdpa_impl("CUDNN_ATTENTION")
    impls["sdpa-flash"] = sdpa_impl("FLASH_ATTENTION")
    impls["sdpa-efficient"] = sdpa_impl("EFFICIENT_ATTENTION")
    impls["fa3"] = _fa3_impl()
    impls["tileops"] = _tileops_impl()
    impls["fa-cute"] = fa_cute_impl()
    return impls


# --- measuring ---

DEFAULT_ROUNDS = 8


def input_sets(shape: shapes.Shape, device):
    """Enough independent input sets that cycling through them defeats the L2 cache."""
    import torch

    from ws_lab.testing import random_qkv

    count = timing.rotation_count(shape.min_bytes(), device, cap=8)
    dtype = getattr(torch, shape.dtype)
    return [random_qkv(shape.batch, shape.seq_len, shape.heads, shape.kv_heads, shape.head_dim,
                       shape.head_dim_v, dtype, device)[0] for _ in range(count)]


def _checked_call(name, make, shape, sets, ref, is_lab: bool):
    """The implementation's timed call (cycling through the input sets), after one run on the
    first set checked against the oracle (NaN-poisoned output for the lab's kernels); raises
    when the implementation cannot run the shape. Returns (call, rel_err)."""
    import torch

    from ws_lab import oracle

    q, k, v = sets[0]
    calls = [make(*s, shape.causal) for s in sets]
    if is_lab:
        out = torch.full(ref.shape, float("nan"), dtype=q.dtype, device=q.device)
        registry.get(name).attention(q, k, v, causal=shape.causal, out=out)
    else:
        out = calls[0]()
    torch.cuda.synchronize()
    cycle = itertools.cycle(calls)
    return (lambda: next(cycle)()), oracle.rel_l2(out, ref)


def checked_cycle(row: Row, make_calls: Callable[[], list], error_of: Callable):
    """One implementation's timed call for a suite's ``measure``: ``make_calls()`` builds a call
    per input set, the first one's output gives ``row.rel_err`` (``error_of``), and the result
    cycles through the calls. An implementation that cannot run the shape gets its failure in
    ``row.note`` and None: it shows n/a."""
    import torch

    try:
        calls = make_calls()
        row.rel_err = error_of(calls[0]())
        torch.cuda.synchronize()
    except Exception as exc:  # a peer that cannot run this shape shows n/a
        row.note = timing.failure_note(exc)
        return None
    cycle = itertools.cycle(calls)
    return lambda: next(cycle)()


def measure(shape: shapes.Shape, impls: dict[str, Callable], is_lab: set[str],
            rounds: int = DEFAULT_ROUNDS, timer: str = "rounds") -> list[Row]:
    import torch

    from ws_lab import oracle

    sets = input_sets(shape, "cuda")
    ref, _ = oracle.attention_ref(*sets[0], causal=shape.causal)
    mask = "causal" if shape.causal else "full"
    rows, timed = [], {}
    for name, make in impls.items():
        row = Row(name, shape.name, shape.seq_len, mask, shape.dtype)
        try:
            timed[name], row.rel_err = _checked_call(name, make, shape, sets, ref, name in is_lab)
        except Exception as exc:  # a peer that cannot run this shape shows n/a
            row.note = timing.failure_note(exc)
        rows.append(row)
    time_rows(rows, timed, rounds, shape.flops(), timer)
    torch.cuda.empty_cache()
    rows.append(floor_row(shape, floor_ms(shape), shape.flops(), len(sets), rounds, timer))
    return rows


TIMERS = {"rounds": timing.time_rounds, "calls": timing.time_calls}


def time_rows(rows: list[Row], timed: dict[str, Callable], rounds: int, flops: float,
              timer: str = "rounds") -> None:
    """Times ``timed`` in interleaved rounds (``TIMERS[timer]``) and fills each row's figures
    (or its failure)."""
    round_ms, failed = TIMERS[timer](timed, rounds)
    for row in rows:
        if row.impl in failed:
            row.note = timing.failure_note(failed[row.impl])
        elif row.impl in round_ms:
            row.round_ms = ms = round_ms[row.impl]
            row.ms = statistics.median(ms)
            row.spread = (max(ms) - min(ms)) / row.ms
            row.tflops = flops / (row.ms * 1e9)


def floor_row(shape: shapes.Shape, ms: float, flops: float, n_sets: int, rounds: int,
              timer: str = "rounds") -> Row:
    mask = "causal" if shape.causal else "full"
    floor = Row("floor", shape.name, shape.seq_len, mask, shape.dtype, ms, flops / (ms * 1e9))
    floor.note = (f"max({floors.TENSOR_TFLOPS:.0f} TFLOP/s, {floors.HBM_TBPS} TB/s); "
                  f"{n_sets} rotating input set(s), {rounds} interleaved round(s)"
                  + (f" of {timing.CYCLES_PER_ROUND} call cycles" if timer == "calls" else ""))
    return floor


def _fmt(x, spec):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(rows: list[Row], peers: list[str] = PEERS) -> str:
    head = (["impl", "shape", "mask", "dtype", "ms", "spread", "TFLOPS", "rel-err"]
            + [GAP_LABEL[p] for p in peers])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by_case = itertools.groupby(rows, key=lambda r: (r.shape, r.mask, r.dtype))
    for _, case in by_case:
        case = list(case)
        peer_ms = {r.impl: r.ms for r in case}
        for r in case:
            # three decimals: a parity call (≥ 1.0× a peer) needs the third
            gaps = [_fmt(peer_ms.get(p) / r.ms if peer_ms.get(p) and r.ms else None, ".3f")
                    for p in peers]
            spread = "n/a" if r.spread is None else f"{100 * r.spread:.1f}%"
            cells = [r.impl, r.shape, r.mask, r.dtype, _fmt(r.ms, ".4f"), spread,
                     _fmt(r.tflops, ".0f"), _fmt(r.rel_err, ".1e")] + gaps
            lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- {r.impl} {r.shape} {r.mask}: {r.note}" for r in rows if r.note and r.impl != "floor"]
    return "\n".join(lines + ([""] + notes if notes else []))


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    key = lambda r: (r.impl, r.mask, r.dtype)  # noqa: E731
    for (impl, mask, dtype), group in itertools.groupby(sorted(rows, key=key), key=key):
        pts = sorted((r.seq_len, r.tflops) for r in group if r.tflops)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"{impl} ({mask}, {dtype})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("TFLOPS")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def static_report(kernels: list[str], cases: list[shapes.Shape]) -> list[dict]:
    """Prints each kernel's static report on each case (lowering shows a status line per
    kernel); returns them as records for ``--json``."""
    from ws_lab import emit

    print("no CUDA device: printing the static report (emitted CUDA + SASS summary) instead\n")
    records = []
    for shape in cases:
        for name in kernels:
            support = registry.get(name).supports(shape)
            if not support:
                text = f"{name} does not support {shape.name}: {support.reason}"
            else:
                try:
                    text = emit.report(name, shape)
                except Exception as exc:  # e.g. no nvcc on this machine
                    text = f"{name} on {shape.name}: static report failed: {exc}"
            print(text + "\n")
            records.append({"kernel": name, "shape": shape.name, "causal": shape.causal,
                            "dtype": shape.dtype, "report": text})
    return records


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv, default_shapes: list[str], extra: Callable | None = None,
               peers: list[str] = PEERS, suite_dtypes: dict | None = None):
    """``suite_dtypes``: extra ``--dtype`` names a script measures with a suite of their own
    (``main``'s ``by_dtype``), each mapped to the dtype of the shapes' input sets."""
    from ws_lab import cli

    ap = cli.ArgumentParser(description=(sys.modules["__main__"].__doc__ or "").split("\n\n")[0]
                            or None)
    ap.add_argument("--shape", action="append", choices=sorted(shapes.SHAPES),
                    help=f"a registered shape, repeatable; default {', '.join(default_shapes)}")
    ap.add_argument("--causal", choices=["0", "1", "both"], default=None,
                    help="override each shape's default mask (both: one row per mask)")
    suite_dtypes = suite_dtypes or {}
    ap.add_argument("--dtype", choices=sorted(DTYPES) + sorted(suite_dtypes), default="float16",
                    help="element type of q, k, v (fp16 = float16, bf16 = bfloat16"
                         + "".join(f"; {name}: its own suite" for name in sorted(suite_dtypes))
                         + ")")
    ap.add_argument("--rounds", type=_positive_int, default=DEFAULT_ROUNDS,
                    help="interleaved timing rounds per shape, each in its own shuffled order "
                         f"(default {DEFAULT_ROUNDS}; a row is the median of its rounds. A round "
                         "costs about 0.3 s per implementation against tens of seconds of "
                         "compiling per shape, and more rounds narrow the median a parity call "
                         "is read off)")
    ap.add_argument("--timer", choices=sorted(TIMERS), default="rounds",
                    help="rounds (default): each implementation timed once a round by do_bench; "
                         f"calls: each round {timing.CYCLES_PER_ROUND} cycles of one call of "
                         "each implementation, L2 flushed before each, the round's figure the "
                         "median of its calls, the device held before each call until the "
                         "host has queued it (for power-bound kernels, whose clock moves "
                         "between do_bench windows, and for calls shorter than their launch)")
    ap.add_argument("--json", type=Path,
                    help="write the rows as JSON here (without a GPU: the static report)")
    ap.add_argument("--plot", type=Path,
                    help="write a TFLOPS-vs-seqlen PNG here (needs a GPU and matplotlib: "
                         "pip install -e '.[plot]')")
    ap.add_argument("--impl", action="append", default=None,
                    help="time only this implementation (repeatable; a lab kernel of the script "
                         "or a peer: " + ", ".join(peers) + "); for long parity runs")
    if extra:
        extra(ap)
    args = ap.parse_args(argv)
    from ws_lab import cli

    cli.out_file(args.json)
    cli.out_file(args.plot, "--plot")
    args.shape = args.shape or default_shapes
    args.cases = [s.with_dtype(DTYPES.get(args.dtype) or suite_dtypes[args.dtype])
                  for name in args.shape for s in shapes.masks(shapes.get(name), args.causal)]
    return args


@dataclass(frozen=True)
class Suite:
    """What a runner measures: the peers (its gap columns, in order), their implementations
    for a list of lab kernels, and one shape's measurement."""
    peers: list[str]
    implementations: Callable[[list[str]], dict[str, Callable]]
    measure: Callable[..., list[Row]]


FORWARD = Suite(PEERS, implementations, measure)


def main(kernels: list[str], default_shapes: list[str], argv=None,
         suite: Suite = FORWARD, by_dtype: dict | None = None) -> list[Row]:
    """Entry point of every ``bench/*.py``: the lab kernels to measure, the default shapes and
    the suite (the forward's, or ``bench_bwd.BACKWARD``). ``by_dtype``: ``--dtype`` names that
    switch to other kernels and suite, name -> (kernels, suite, the input sets' dtype); e.g.
    ``fp8`` -> ``bench_fp8.FP8`` on bf16 sets."""
    from ws_lab import cli

    by_dtype = by_dtype or {}

    def go(argv):
        args = parse_args(argv, default_shapes, peers=suite.peers,
                          suite_dtypes={name: spec[2] for name, spec in by_dtype.items()})
        run_kernels, run_suite, _ = by_dtype.get(args.dtype, (kernels, suite, None))
        return run(run_kernels, args, run_suite)

    return cli.main(go, argv)


def _refuse_unsupported(kernels: list[str], cases: list[shapes.Shape]) -> None:
    """A case none of ``kernels`` runs is a user mistake: refused before anything is timed."""
    from ws_lab import cli

    for shape in cases:
        if not any(registry.get(k).supports(shape) for k in kernels):
            raise cli.unsupported(" / ".join(kernels), shape,
                                  [s for s in shapes.SHAPES.values()
                                   if any(registry.get(k).supports(s) for k in kernels)])


def needs_gpu(option: str):
    from ws_lab import cli

    return cli.UsageError(f"{option} needs timings, and there is no CUDA device here")


def run(kernels: list[str], args, suite: Suite = FORWARD) -> list[Row]:
    import torch

    _refuse_unsupported(kernels, args.cases)
    order = kernels + [p for p in suite.peers if p not in kernels]
    unknown = sorted(set(args.impl or ()) - set(order))
    if unknown:
        from ws_lab import cli

        raise cli.UsageError(f"--impl {unknown[0]!r} is not timed here; choose from "
                             f"{', '.join(order)}")
    if not torch.cuda.is_available():
        if args.plot:
            raise needs_gpu("--plot")
        records = static_report(kernels, args.cases)
        if args.json:
            args.json.write_text(json.dumps({"device": None, "static_report": records}, indent=1))
        return []
    impls = suite.implementations(kernels)
    impls = {name: impls[name] for name in order if not args.impl or name in args.impl}
    is_lab = {name for name in impls if name in registry.KERNELS}
    device = torch.cuda.get_device_name()
    print(f"\n{device}, torch {torch.__version__}; ×peer = peer ms / row ms", flush=True)
    rows = []
    for shape in args.cases:
        shape_rows = suite.measure(shape, impls, is_lab, args.rounds, args.timer)
        rows += shape_rows
        # each shape's table, and the JSON so far, once the shape is timed: a run stopped at a
        # time limit keeps every shape it finished (notes/bwd.md, "Session 63")
        print(f"\n{table(shape_rows, suite.peers)}", flush=True)
        if args.json:
            args.json.write_text(json.dumps({"device": device,
                                             "rows": [asdict(r) for r in rows]}, indent=1))
    if args.plot:
        plot(rows, args.plot)
    return rows
