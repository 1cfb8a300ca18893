"""Paged decode attention: every mode of kernels/paged.py vs SDPA (contiguous K/V), TileOPs'
paged op and the HBM floor, in one process.

    python bench/paged.py                  # the named rows (block size 16)
    python bench/paged.py --sweep          # 60 shapes: how often auto is within 5 % of the best
"""
import argparse
import json
from dataclasses import asdict
from pathlib import Path

from ws_lab import bench_paged as bp

ROWS = [bp.PagedRow("llama7b-2k", 8, 32, 32, 2048), bp.PagedRow("llama7b-8k", 8, 32, 32, 8192),
        bp.PagedRow("llama3-8b", 8, 32, 8, 2048), bp.PagedRow("llama3-8b", 32, 32, 8, 2048),
        bp.PagedRow("llama70b", 4, 64, 8, 2048), bp.PagedRow("llama70b", 8, 64, 8, 2048),
        bp.PagedRow("mqa", 16, 32, 1, 4096), bp.PagedRow("long", 4, 32, 8, 32768)]
MODES = ("v1", "gqa", "split_k", "auto")


TUNE_ROWS = [ROWS[2], ROWS[5], ROWS[6]]  # llama3-8b B8, llama70b B8, mqa: auto furthest from SDPA


def tune(copy_gbps):
    """Times gqa and split_k over launch configs on TUNE_ROWS (each config checked first)."""
    import itertools

    from kernels import paged

    grid = [paged.LaunchConfig(t, w, s, waves) for t, w, s, waves in
            itertools.product((64, 128), (4, 8), (2, 3), (2, 4))]
    for row in TUNE_ROWS:
        results = []
        for mode, cfg in itertools.product(("gqa", "split_k"), grid):
            if mode == "gqa" and cfg.waves != 2:
                continue
            r = bp.measure_row(row, [mode], copy_gbps, with_peers=False, config=cfg)
            results.append((r.us[mode], mode, cfg, r.errors[mode]))
        for us, mode, cfg, err in sorted(results, key=lambda t: t[0])[:6]:
            print(f"{row.name} B{row.batch}: {mode} {cfg}: {us:.1f} µs (rel-err {err:.1e})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--block-size", type=int, nargs="+", default=[16])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--tune", action="store_true", help="sweep launch configs on three rows")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        from kernels import paged
        from ws_lab import triton_static

        print("no CUDA device: printing the static report (sm_90 SASS summary of the gqa and "
              "split_k kernels for each row's head layout) instead\n")
        for r in {(r.heads, r.kv_heads, r.head_dim, r.block_size): r for r in ROWS}.values():
            for spec in paged.static_specs(r.heads, r.kv_heads, r.head_dim, r.block_size, r.dtype):
                print(f"{r.name} ({r.heads}/{r.kv_heads}): " + triton_static.report(spec) + "\n")
        return
    copy = bp.copy_bandwidth_gbps()
    print(f"{torch.cuda.get_device_name()}: device copy {copy:.0f} GB/s (read + write)\n")
    if args.tune:
        return tune(copy)
    rows = bp.sweep_rows() if args.sweep else [
        bp.PagedRow(r.name, r.batch, r.heads, r.kv_heads, r.context, block_size=bs)
        for r in ROWS for bs in args.block_size]
    results = [bp.measure_row(r, MODES, copy, with_peers=not args.sweep) for r in rows]
    print(bp.rule_table(results) if args.sweep else bp.table(results, MODES))
    hits, total = bp.within(results)
    print(f"\nauto within 5 % of the best mode on {hits}/{total} rows")
    if args.json:
        args.json.write_text(json.dumps([dict(row=asdict(r.row), us=r.us, errors=r.errors,
                                              notes=r.notes, copy_gbps=r.copy_gbps)
                                         for r in results], indent=1))


if __name__ == "__main__":
    main()
