"""The FP8 forward's suite for the one runner (``ws_lab.bench``): ``python bench/coop.py --dtype
fp8``. Each rotating bf16 input set (``bench.input_sets``) is quantised once (``fp8.quantize``:
e4m3 with per-(B, Hkv) descales), and every FP8 implementation runs on those same bytes and
descales: the lab's FP8 kernels (``fp8``, ``fp8-coop``, ``fp8-coop-persistent``,
``fp8-coop-rs``, ``fp8-coop-rs-vt``, ``fp8-coop-rs-persistent``, ``fp8-coop-rs-desc``), FA3's
own FP8 forward (``fa3-fp8``) and TileOPs' FP8 op (``tileops-fp8``).
Beside them the lab's persistent bf16 kernel and FA3's bf16 forward (``fa3``) run on the bf16
sets the FP8 ones came from: the ×FA3 column of an FP8 row is its FP8 ÷ bf16 speed-up. rel-err:
an FP8 row's against the float64 oracle on its dequantised inputs (the kernel's own error), a
bf16 row's against the oracle on the bf16 inputs. TFLOPS count the shape's FLOPs (the same work
in either precision). Every row of a case is labelled dtype "fp8". The floor row assumes twice
the bf16 tensor ceiling (FP8's rate on the H100's data sheet; not measured by the lab)."""
from __future__ import annotations

from typing import Callable

from ws_lab import bench, floors, registry, shapes

PEERS = ["fa3-fp8", "tileops-fp8", "fa3", "coop-overlap-persistent"]
PEER_FP8_IMPLS = ("fa3-fp8", "tileops-fp8")
SOURCE_DTYPE = "bfloat16"  # the input sets the e4m3 ones are quantised from


def _lab_impl(name: str):
    registered = registry.get(name)
    attention_fp8 = registered.fp8_attention

    def make(z, causal):
        import torch

        out = torch.full(z.q.shape, float("nan"), dtype=registered.module_object().OUT_DTYPE,
                         device=z.q.device)
        return lambda: attention_fp8(z.q, z.k, z.v, causal, out=out, **z.descales())

    return make


def _fa3_fp8_impl():
    def make(z, causal):
        from fa3_fwd_interface import flash_attn_func

        def call():
            out = flash_attn_func(z.q, z.k, z.v, causal=causal, **z.descales())
            return out[0] if isinstance(out, tuple) else out

        return call

    return make


def _tileops_fp8_impl():
    def make(z, causal):
        import torch
        from tileops.attention import GQADenseFwdOp

        op = GQADenseFwdOp(is_causal=causal, out_dtype=torch.bfloat16)
        return lambda: op(z.q, z.k, z.v, z.q_descale, z.k_descale, z.v_descale)

    return make


def implementations(lab_kernels: list[str]) -> dict[str, Callable]:
    """The lab's FP8 kernels (``lab_kernels``), the FP8 peers, and the bf16 pair."""
    bf16 = bench.implementations(["coop-overlap-persistent"])
    return {**{name: _lab_impl(name) for name in lab_kernels}, "fa3-fp8": _fa3_fp8_impl(),
            "tileops-fp8": _tileops_fp8_impl(), "fa3": bf16["fa3"],
            "coop-overlap-persistent": bf16["coop-overlap-persistent"]}


def measure(shape: shapes.Shape, impls: dict[str, Callable], is_lab: set[str],
            rounds: int = bench.DEFAULT_ROUNDS, timer: str = "rounds") -> list[bench.Row]:
    import torch

    from ws_lab import oracle

    fp8 = registry.get("fp8").module_object()
    sets = bench.input_sets(shape, "cuda")
    quantised = [fp8.quantize(*s) for s in sets]
    refs = {"fp8": oracle.attention_ref(*quantised[0].dequantised(), causal=shape.causal)[0],
            "bf16": oracle.attention_ref(*sets[0], causal=shape.causal)[0]}
    mask = "causal" if shape.causal else "full"
    rows, timed = [], {}
    for name, make in impls.items():
        row = bench.Row(name, shape.name, shape.seq_len, mask, "fp8")
        if name in PEER_FP8_IMPLS or (name in is_lab and registry.get(name).kind == "fp8"):
            calls, ref = (lambda make=make: [make(z, shape.causal) for z in quantised]), refs["fp8"]
        else:
            calls, ref = (lambda make=make: [make(*s, shape.causal) for s in sets]), refs["bf16"]
        call = bench.checked_cycle(row, calls, lambda out, ref=ref: oracle.rel_l2(out, ref))
        if call:
            timed[name] = call
        rows.append(row)
    del refs
    bench.time_rows(rows, timed, rounds, shape.flops(), timer)
    torch.cuda.empty_cache()
    floor = floors.floor_ms(shape.flops() / 2, shape.min_bytes() / 2)
    floor_row = bench.floor_row(shape, floor, shape.flops(), len(sets), rounds, timer)
    floor_row.dtype = "fp8"
    floor_row.note = f"FP8 at twice the bf16 ceiling (assumed); {floor_row.note}"
    return rows + [floor_row]


FP8 = bench.Suite(PEERS, implementations, measure)
