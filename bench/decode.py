"""Per-layer decode attention: the fused RoPE + KV-write + attention kernel vs the unfused HF
path (eager and CUDA-graph captured), the lab's paged ``auto`` with a separate RoPE / write, and
the HBM floor, in one process (µs; CUDA-graph replays; ws_lab/bench_decode.py says how).

    python bench/decode.py                 # Qwen2.5-0.5B and Llama-3-8B rows
    python bench/decode.py --row qwen      # the rows whose name starts with qwen
"""
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # import this checkout's ws_lab

from ws_lab import cli, floors, registry
from ws_lab.bench_decode import DecodeRow

QWEN = dict(heads=14, kv_heads=2, head_dim=64)  # Qwen2.5-0.5B attention
LLAMA3 = dict(heads=32, kv_heads=8, head_dim=128)  # Llama-3-8B attention
ROWS = ([DecodeRow("qwen2.5-0.5b", 64, capacity=4096, position=p, **QWEN)
         for p in (32, 128, 511, 1023, 4095)]
        + [DecodeRow("llama3-8b", b, capacity=8192, position=p, **LLAMA3)
           for b in (8, 32) for p in (2047, 8191)])


def _parser():
    ap = cli.ArgumentParser(prog="bench/decode.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", action="append",
                    help="keep the rows whose name starts with this (repeatable; default all)")
    ap.add_argument("--json", type=Path,
                    help="write the rows as JSON here (without a GPU: the static report)")
    return ap


def static_report(rows, json_path):
    from ws_lab import triton_static

    fused = registry.decode("fused")
    layouts = dict.fromkeys((r.heads, r.kv_heads, r.head_dim, r.dtype) for r in rows)
    triton_static.print_reports(
        "the fused kernel for each row's head layout",
        [(f"{heads}/{kv_heads}, D {head_dim}", spec,
          dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim))
         for heads, kv_heads, head_dim, dtype in layouts
         for spec in fused.static_specs(heads, kv_heads, head_dim, dtype)], json_path)
    from ws_lab.kernels.decode import fused_decode_cuda
    from ws_lab.kernels.decode.cubin import print_static_report

    print_static_report("\nthe CUDA kernel static calls at the rollout's shape run "
                        "(kernels/decode/fused_decode_cuda.cu)", fused_decode_cuda.static_report)


def _main(argv):
    args = _parser().parse_args(argv)
    cli.out_file(args.json)
    rows = [r for r in ROWS if not args.row or any(r.name.startswith(p) for p in args.row)]
    if not rows:
        raise cli.UsageError(f"no row starts with {args.row}; rows: "
                             f"{', '.join(dict.fromkeys(r.name for r in ROWS))}")
    import torch

    if not torch.cuda.is_available():
        return static_report(rows, args.json)
    from ws_lab import bench_decode

    copy, read = floors.copy_bandwidth_gbps(), floors.read_bandwidth_gbps()
    print(f"{torch.cuda.get_device_name()}: device copy {copy:.0f} GB/s (read + write), "
          f"read ceiling {read:.0f} GB/s (floor and % read use it)\n")
    results = []
    for row in rows:
        with cli.status(f"measuring {row.label()}"):
            results.append(bench_decode.measure_row(row, read))
    print(bench_decode.table(results))
    if args.json:
        args.json.write_text(json.dumps([dict(row=asdict(r.row), us=r.us, errors=r.errors,
                                              notes=r.notes, read_gbps=r.read_gbps)
                                         for r in results], indent=1))


def main(argv=None):
    cli.main(_main, argv, "bench/decode.py")


if __name__ == "__main__":
    main()
