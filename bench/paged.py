"""Paged decode attention: every mode of kernels/decode/paged.py (backend="cuda": kernels/decode/paged_cuda.cu)
vs SDPA (contiguous K/V), TileOPs' and FA-CuTe's paged ops and the HBM floor, in one process,
on block tables where every physical block belongs to one sequence.

    python bench/paged.py                  # the named rows (block size 16)
    python bench/paged.py --sweep          # 82 shapes: how often auto is within 5 % of the best
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # import this checkout's ws_lab

import json
from dataclasses import asdict

from ws_lab import bench_paged as bp
from ws_lab import cli, floors, registry

paged = registry.decode("paged")

ROWS = [bp.PagedRow("llama7b-2k", 8, 32, 32, 2048), bp.PagedRow("llama7b-8k", 8, 32, 32, 8192),
        bp.PagedRow("llama3-8b", 8, 32, 8, 2048), bp.PagedRow("llama3-8b", 32, 32, 8, 2048),
        bp.PagedRow("llama70b", 4, 64, 8, 2048), bp.PagedRow("llama70b", 8, 64, 8, 2048),
        bp.PagedRow("mqa", 16, 32, 1, 4096), bp.PagedRow("long", 4, 32, 8, 32768)]
MODES = ("v1", "gqa", "split_k", "auto", "cuda")  # cuda: n/a where outside its scope


# The latency-bound rows auto sends to split_k (34–67 MB of K/V: its reduce, launch gaps and
# short segments weigh most there).
TUNE_ROWS = [ROWS[2], ROWS[4], ROWS[5], ROWS[6]]


def tune(read_gbps, json_path=None):
    """Times split_k over launch configs (64-token tiles: 128 lost on every tuned row in
    sessions 5 and 16) on TUNE_ROWS (each config checked against the oracle
    first) and prints them ranked by the geometric mean over the rows of time / the row's best;
    returns the winner (``--config`` takes it)."""
    import itertools
    import math

    grid = [paged.LaunchConfig(*c) for c in
            itertools.product((64,), (4, 8), (2, 3), (4, 8), (0, 8), (0, 64))]
    us = {cfg: [] for cfg in grid}
    for row, cfg in itertools.product(TUNE_ROWS, grid):
        r = bp.measure_row(row, ["split_k"], read_gbps, with_peers=False, config=cfg)
        assert r.errors["split_k"] < 2e-3, (row, cfg, r.errors)
        us[cfg].append(r.us["split_k"])
    best = [min(t[i] for t in us.values()) for i in range(len(TUNE_ROWS))]
    score = {cfg: math.exp(sum(math.log(t / b) for t, b in zip(ts, best)) / len(best))
             for cfg, ts in us.items()}
    print("| config (tile,warps,stages,waves,scratch_div,merge_partials) | " + " | ".join(
        f"{r.name} B{r.batch} µs" for r in TUNE_ROWS) + " | geomean ×best |")
    print("|---|" + "---|" * (len(TUNE_ROWS) + 1))
    for cfg in sorted(grid, key=score.get)[:12]:
        print(f"| {cfg} | " + " | ".join(f"{t:.1f}" for t in us[cfg]) + f" | {score[cfg]:.3f} |")
    default = paged.DEFAULTS["split_k"]
    print(f"| (default {default}) | " + " | ".join(
        f"{t:.1f}" for t in us.get(default, [float("nan")] * len(best))) + " | |")
    winner = min(grid, key=score.get)
    if json_path:
        json_path.write_text(json.dumps({str(c): us[c] for c in grid}, indent=1))
    print(f"\nbest: --config {winner}")
    return winner


def _parser():
    ap = cli.ArgumentParser(prog="bench/paged.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", action="store_true",
                    help="time every mode on the 82-shape sweep and count how often auto is "
                         "within 5 %% of the best mode (needs a GPU)")
    ap.add_argument("--block-size", type=int, nargs="+", default=[16],
                    help="KV-cache block sizes (tokens), one row set per size (default 16)")
    ap.add_argument("--json", type=Path,
                    help="write the rows as JSON here (without a GPU: the static report)")
    ap.add_argument("--tune", action="store_true",
                    help="sweep split_k launch configs on TUNE_ROWS (needs a GPU)")
    ap.add_argument("--config", help="launch config 'tile,warps,stages,waves[,scratch_div"
                                     "[,merge_partials]]' (default: each mode's "
                                     "heuristics.launch_config; needs a GPU)")
    return ap


def static_report(block_sizes, json_path):
    from ws_lab import triton_static

    layouts = {(r.heads, r.kv_heads, r.head_dim, bs): r for r in ROWS for bs in block_sizes}
    triton_static.print_reports(
        "the gqa and split_k kernels for each row's head layout",
        [(f"{r.name} ({heads}/{kv_heads}, block {bs})", spec,
          dict(row=r.name, heads=heads, kv_heads=kv_heads, block_size=bs))
         for (heads, kv_heads, head_dim, bs), r in layouts.items()
         for spec in paged.static_specs(heads, kv_heads, head_dim, bs, r.dtype)], json_path)
    print_cuda_report()


def print_cuda_report():
    """backend="cuda"'s kernels: ptxas registers / spills and the SASS counts its design rests on
    (paged_cuda.static_report); skipped without nvcc."""
    from ws_lab.kernels.decode import paged_cuda
    from ws_lab.kernels.decode.cubin import print_static_report

    print_static_report("backend='cuda' (kernels/decode/paged_cuda.cu)", paged_cuda.static_report)


def _main(argv):
    args = _parser().parse_args(argv)
    cli.out_file(args.json)
    import torch

    for bs in args.block_size:
        if bs < 8 or bs > 128 or bs & (bs - 1):
            raise cli.UsageError(f"--block-size must be a power of two in 8..128, got {bs}")
    try:
        config = None if args.config is None else paged.LaunchConfig.parse(args.config)
    except (TypeError, ValueError) as exc:
        raise cli.UsageError(f"--config takes 4 to 6 comma-separated integers, got "
                             f"{args.config!r} ({exc})") from None
    if not torch.cuda.is_available():
        for option in ("sweep", "tune", "config"):
            if getattr(args, option):
                raise cli.UsageError(f"--{option} needs timings, and there is no CUDA device "
                                     "here")
        return static_report(args.block_size, args.json)
    copy, read = floors.copy_bandwidth_gbps(), floors.read_bandwidth_gbps()
    print(f"{torch.cuda.get_device_name()}: device copy {copy:.0f} GB/s (read + write), "
          f"read ceiling {read:.0f} GB/s (floor and % read use it)\n")
    if args.tune:
        return tune(read, args.json)
    rows = bp.sweep_rows() if args.sweep else [
        bp.PagedRow(r.name, r.batch, r.heads, r.kv_heads, r.context, block_size=bs)
        for r in ROWS for bs in args.block_size]
    results = [bp.measure_row(r, MODES, read, with_peers=not args.sweep, config=config)
               for r in rows]
    print(bp.rule_table(results) if args.sweep else bp.table(results, MODES))
    hits, total = bp.within(results)
    print(f"\nauto within 5 % of the best mode on {hits}/{total} rows")
    if args.json:
        args.json.write_text(json.dumps([dict(row=asdict(r.row), us=r.us, errors=r.errors,
                                              peer_errors=r.peer_errors, notes=r.notes,
                                              read_gbps=r.read_gbps)
                                         for r in results], indent=1))


def main(argv=None):
    cli.main(_main, argv, "bench/paged.py")


if __name__ == "__main__":
    main()
