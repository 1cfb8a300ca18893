"""Runs ws_lab.boundary_cases under TRITON_INTERPRET=1 (fp16: the interpreter's bf16 dot is
wrong) on every Triton paged mode and both fused layouts; prints {case: verdict} as JSON. Run
in a subprocess by test_boundary_interpret.py (the variable must be set before Triton loads)."""
import dataclasses
import json
import os


def main():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    import torch

    from ws_lab import boundary_cases as bc
    from ws_lab.kernels.decode import fused_decode
    from ws_lab.paged_cases import variants

    results = {}
    for name, fn in variants().items():
        if name == "cuda":
            continue
        for case in bc.PAGED_CASES:
            v = bc.paged_case(case, fn, torch.float16, "cpu", head_dim=64)
            results[f"paged-{name}: {case}"] = dataclasses.asdict(v)
    for layout, entry, cases, block_size in (
            ("static", fused_decode.fused_decode_attention, bc.FUSED_CASES, None),
            ("paged", fused_decode.fused_paged_decode_attention, bc.FUSED_PAGED_CASES, 16)):
        for case in cases:
            v = bc.fused_case(case, entry, torch.float16, "cpu", block_size=block_size)
            results[f"fused-{layout}: {case}"] = dataclasses.asdict(v)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
