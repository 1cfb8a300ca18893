"""Every paged mode and the MHA kernel under TRITON_INTERPRET=1 vs the float64 oracle (fp32 and
fp16; ragged context lengths 1/17/513, scattered blocks, groups 1/4/8/32, head dims 80/96;
lengths past the table clamped, empty ones zero); the decode layer's linear (bias, SwiGLU,
split-K summed by the RMSNorm; the lm_head's chunk maxima), the top-k sampler (its selection
is exactly the k largest, ties included; draws inside the k largest; a cold draw is the
argmax), the rollout's one-launch bookkeeping, the FP8 forward's Vᵀ pass and its wrapper's
launch path for every design; the LLaMA block traced by Dynamo with fullgraph=True. Input
validation: test_bad_inputs.py."""
import dataclasses
import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.cpu import interpret_cases
from ws_lab.kernels.fwd import fp8
from ws_lab.paged_cases import variants


@pytest.fixture(scope="module")
def interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-m", "tests.cpu.interpret_cases"], env=env,
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# per dtype: every paged variant on every case, every MHA case; then the clamped-lengths case
# per variant, three checks per fused-decode case, and the counter check
EXPECTED = (2 * len(interpret_cases.PAGED) * len(variants()) + 2 * len(interpret_cases.MHA)
            + len(variants()) + 3 * len(interpret_cases.FUSED) + 1
            + len(interpret_cases.LINEAR) + 2 * sum(e == "split" for *_, e, _ in
                                                    interpret_cases.LINEAR)
            + 1 + len(interpret_cases.SAMPLING) + 2 + len(interpret_cases.SELECT) + 2
            + len(interpret_cases.FP8_TRANSPOSE) + len(interpret_cases.FP8_TRANSPOSE_OPERAND)
            + len(fp8.DESIGNS))


def test_every_case_ran(interpreted):
    assert len(interpreted) == EXPECTED


@pytest.mark.parametrize("index", range(EXPECTED))
def test_interpreted_case_matches_oracle(interpreted, index):
    name, (err, tol) = sorted(interpreted.items())[index]
    assert err <= tol, f"{name}: rel_err {err:.3e} > {tol:.1e}"


def test_llama_block_compiles_without_graph_break():
    from tests.llama_block import LlamaAttention

    # bf16: the op refuses fp32 in its fake as in the kernel
    block = LlamaAttention(hidden=256, heads=4, kv_heads=2).to("meta", torch.bfloat16)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(block, fullgraph=True, backend=capture)
    out = compiled(torch.empty(2, 16, 256, device="meta", dtype=torch.bfloat16))
    assert out.shape == (2, 16, 256)
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert any("triton_mha" in t for t in targets), targets


def test_launch_plan_depends_on_shapes_only():
    from ws_lab.kernels.decode import heuristics, paged

    gqa = heuristics.DEFAULTS["gqa"]
    assert paged.tile_for(gqa, 128, 2) == 128
    assert paged.tile_for(gqa, 256, 2) == 64  # 32 KB tiles: D 256 halves the tile
    assert paged.tile_for(gqa, 256, 4) == 32
    assert heuristics.segments_for(8, 8, 4, 2048, 132) == 9  # ceil(4 waves · 132 SMs / 64 programs)
    assert heuristics.segments_for(1, 1, 1, 64, 132) == 1  # never more segments than tiles
    capped = heuristics.LaunchConfig(128, 8, 2, 4, scratch_div=8)
    assert heuristics.segments_for(16, 1, 32, 4096, 132, capped) == 16  # 4096 // (8 · 32)
    split = heuristics.DEFAULTS["split_k"]
    merging = dataclasses.replace(split, merge_partials=64)
    # llama70b B8 (group 8): 8 segments of 256 tokens, 64 partial rows: merged in the kernel
    # where merge_partials allows 64; the defaults always take the reduce kernel
    assert paged.split_plan(8, 8, 8, 2048, 132, merging, 64) == (8, 256, True)
    assert paged.split_plan(8, 8, 8, 2048, 132, split, 64) == (8, 256, False)
    # MQA B16 (group 32): 16 segments, 512 partial rows: the reduce kernel
    assert paged.split_plan(16, 1, 32, 4096, 132, merging, 64) == (16, 256, False)
    assert heuristics.reduce_warps(16, 128) == 1  # 64 partial elements a thread on one warp
    assert heuristics.reduce_warps(512, 128) == 8
    short, long = heuristics.launch_config("gqa", 8, 32, 132), heuristics.launch_config("gqa", 16, 32, 132)
    assert (short.num_warps, short.num_stages) == (4, 3)  # 256 programs: ≤ 2 per SM
    assert (long.num_warps, long.num_stages) == (8, 2)  # 512 programs
    assert heuristics.choose_mode(8, 32, 32, 2048, 132) == "gqa"  # 256 KV heads: ~2 per SM
    assert heuristics.choose_mode(16, 32, 32, 2048, 132) == "split_k"  # 512: between the bands
    assert heuristics.choose_mode(32, 32, 32, 2048, 132) == "gqa"  # 1024: ≥ 4 per SM
    assert heuristics.choose_mode(16, 32, 1, 4096, 132) == "split_k"


def test_split_k_takes_narrow_deep_tiles_on_a_32_head_group_of_16_bit_rows():
    from ws_lab.kernels.decode import heuristics

    mqa = heuristics.launch_config("split_k", 16, 1, 132, group=32, row_bytes=256)
    assert (mqa.tile_n, mqa.num_stages) == (32, 6)
    assert mqa.num_warps == heuristics.DEFAULTS["split_k"].num_warps
    for group, row_bytes in ((8, 256), (16, 256), (64, 256), (32, 512)):  # not timed with it
        assert heuristics.launch_config("split_k", 16, 1, 132, group, row_bytes) == \
            heuristics.DEFAULTS["split_k"]


def test_static_report_compiles_triton_kernels_for_sm90_without_a_gpu():
    from ws_lab.kernels.decode import paged
    from ws_lab.kernels.fwd import triton_mha
    from ws_lab import shapes, triton_static

    mha = triton_static.report(triton_mha.static_specs(shapes.get("llama8b-4k"))[0])
    assert "HGMMA: 64x" in mha  # the MHA tile (128 rows) is on the wgmma path
    split = triton_static.report(paged.static_specs(32, 8, 128, 16)[1])
    assert "decode_split_k" in split and re.search(r"registers \d+", split)


def test_fused_decode_compiles_whole_through_its_fake():
    """A decode layer calling the fused op traces into one graph with ``fullgraph=True`` on meta
    tensors (the fake runs, the kernel does not), and advancing positions (same shapes, other
    values) reuses it: no recompile."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from ws_lab.kernels.decode import fused_decode

    torch._dynamo.reset()
    counters.clear()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def layer(q, k_new, v_new, k_cache, v_cache, cos, sin, positions):
        return fused_decode.fused_decode_attention(q, k_new, v_new, k_cache, v_cache, cos, sin,
                                                   positions).flatten(1)

    meta = dict(device="meta", dtype=torch.bfloat16)
    args = [torch.empty(4, 14, 64, **meta), torch.empty(4, 2, 64, **meta),
            torch.empty(4, 2, 64, **meta), torch.empty(4, 2, 512, 64, **meta),
            torch.empty(4, 2, 512, 64, **meta), torch.empty(512, 64, **meta),
            torch.empty(512, 64, **meta)]
    compiled = torch.compile(layer, fullgraph=True, backend=capture)
    for _ in range(3):
        out = compiled(*args, torch.empty(4, dtype=torch.int32, device="meta"))
        assert out.shape == (4, 14 * 64)
    assert len(graphs) == 1 and counters["stats"]["unique_graphs"] == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert any("fused_decode" in t for t in targets), targets


def _sass_and_wait(out_dir):
    """The SASS lines a static report left in ``out_dir``, and the index of the first
    ``griddepcontrol.wait`` (ACQBULK) among them."""
    sass = next(out_dir.glob("*.sass")).read_text().splitlines()
    return sass, next(i for i, line in enumerate(sass) if "ACQBULK" in line)


def test_fused_decode_static_report_compiles_for_sm90(tmp_path):
    """Both layouts compile for sm_90. The static layout asks the L2 for its segment's K and V
    (two bulk prefetches) before ``griddepcontrol.wait`` (ACQBULK); the one load before the wait
    is the prefetch's position, so everything the kernel computes with is loaded after it."""
    from ws_lab import triton_static
    from ws_lab.kernels.decode import fused_decode

    for paged in (False, True):
        text = triton_static.report(fused_decode.static_specs(14, 2, 64, paged=paged)[0],
                                    tmp_path / str(paged))
        assert "fused_decode" in text and re.search(r"registers \d+", text)
        assert "spill" not in text  # a Triton cubin has no ptxas spill report: left out
        sass, wait = _sass_and_wait(tmp_path / str(paged))
        prefetches = [i for i, line in enumerate(sass) if "UBLKPF.L2" in line]
        assert len(prefetches) == (0 if paged else 2), text
        assert all(i < wait for i in prefetches)
        assert sum("LDG" in line for line in sass[:wait]) == (0 if paged else 1), sass[:wait]


def test_decode_layer_static_report_pipelines_and_prefetches(tmp_path):
    """Specialized as a launch is (16-byte aligned pointers, K divisible by 16), the decode
    GEMMs load through cp.async on a multi-stage pipeline with nothing spilled; down's 10
    stages still fit an SM beside gate|up's, whose programs it launches early beside; the o GEMM
    (one K tile a program) loads its weight tile before ``griddepcontrol.wait`` (ACQBULK), the
    others nothing; the split-K GEMMs (down, o) let their dependents launch (PREEXIT) before
    their wait, gate|up after its main loop; the weight prefetch is one bulk prefetch
    instruction in its issue loop, the context prefetch bulk prefetches of K and V rows."""
    from ws_lab import triton_static
    from ws_lab.kernels.step import decode_layer

    specs = decode_layer.static_specs()
    gate_up, down, o, prefetch, context = [triton_static.report(s, tmp_path / s.name)
                                           for s in specs]
    smem = {}
    for name, text, stages in (("gate_up", gate_up, 4), ("down", down, 10)):
        assert int(re.search(r"LDGSTS (\d+)", text).group(1)) > 0, text
        assert "STL 0" in text and "HGMMA: 64x" in text, text
        smem[name] = int(re.search(r"dynamic smem (\d+)", text).group(1))
        assert smem[name] >= stages * 64 * 64 * 2, text  # one 64-row activation tile a stage
    # gate|up (three 64 x 64 tiles a stage) stays at 96 KB: an SM keeps room for its dependent
    assert smem["gate_up"] <= 96 * 1024, gate_up
    assert smem["gate_up"] + smem["down"] + 2 * 1024 <= 228 * 1024, (smem, down)
    assert "STL 0" in o and "HGMMA: 64x32x16" in o, o
    for spec, early, split in zip(specs[:3], (0, 0, 4), (False, True, True)):
        sass, wait = _sass_and_wait(tmp_path / spec.name)
        trigger = next(i for i, line in enumerate(sass) if "PREEXIT" in line)
        # o: 32 × 128 bf16 weights, 16 B a load
        assert sum("LDG" in line for line in sass[:wait]) == early, (spec.name, sass[:wait])
        assert (trigger < wait) == split, (spec.name, trigger, wait)
    assert "UBLKPF 1" in prefetch, prefetch
    assert int(re.search(r"UBLKPF (\d+)", context).group(1)) >= 2, context
    assert "STL 0" in context, context


def test_sampler_lets_the_bookkeeping_launch_early(tmp_path):
    """The top-k kernel lets its dependent launch (PREEXIT) before its own
    ``griddepcontrol.wait`` (ACQBULK): the dependent is the one-program bookkeeping, which waits
    (ACQBULK) before its first load, so it sits ready while the draw runs."""
    from ws_lab import triton_static
    from ws_lab.kernels.step import rollout_step, sampling

    for spec, trigger_first in ((sampling.static_specs()[0], True),
                                (rollout_step.static_specs()[0], False)):
        text = triton_static.report(spec, tmp_path / spec.name)
        assert "STL 0" in text, text
        sass, wait = _sass_and_wait(tmp_path / spec.name)
        loads = [i for i, line in enumerate(sass) if "LDG" in line]
        assert loads and wait < loads[0], (spec.name, wait, loads[:3])
        triggers = [i for i, line in enumerate(sass) if "PREEXIT" in line]
        assert bool(triggers and triggers[0] < wait) == trigger_first, (spec.name, triggers, wait)
