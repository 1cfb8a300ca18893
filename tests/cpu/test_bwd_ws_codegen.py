"""bwd-ws (kernels/bwd/ws.py) lowers for sm_90a and compiles on a CPU as its docstring says:
the five GEMMs on wgmma (dV and dK with Pᵀ / dSᵀ from registers, dQ as two 64-key GEMMs), the
register split, no spill, every hand-over an mbarrier (no named barrier past the barriers'
init), and the tile scheduler's grouped launch order covers every K/V tile once."""
import itertools
import re
import shutil

import pytest
import torch

from ws_lab import emit, registry, shapes
from ws_lab.kernels.bwd import heuristics, pipelined, prepost, tile_scheduler, ws

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


@needs_nvcc
@pytest.mark.parametrize("causal", [False, True])
def test_the_ws_backward_compiles_to_five_gemms_on_mbarriers_alone(tmp_path, causal):
    shape = shapes.Shape("bwd-ws-codegen", 2, 8, 2, 1024, 128, 128, causal, "bfloat16")
    kernel = registry.get("bwd-ws")
    emitted = emit.lower_variant("bwd-ws", shape, kernel.prim_func(shape), kernel.pass_configs)
    summary = emit.inspect(emitted, tmp_path)
    k_s, k_q, k_half = 128 // 16, ws.BLOCK_Q // 16, ws.HALF // 16  # K of Sᵀ / dPᵀ, dV / dK, dQ
    per_warpgroup_ss = 2 * k_s + 2 * k_half  # Sᵀ, dPᵀ, dQ's two halves
    ss = sum(n for kind, n in summary.hgmma.items() if not kind.endswith(".RS"))
    rs = sum(n for kind, n in summary.hgmma.items() if kind.endswith(".RS"))
    assert (ss, rs) == (2 * per_warpgroup_ss, 2 * 2 * k_q), summary.hgmma  # 2 consumer branches
    assert sorted(set(summary.setmaxnreg)) == ["DEALLOC 24", "TRY_ALLOC 240"]
    assert summary.spill_bytes == 0 and summary.stack_frame == 0, summary.format()
    assert emitted.threads == ws.CONSUMER_THREADS + 128
    assert summary.counts["BAR"] == 1, summary.format()  # the barriers' init only
    assert len(summary.gemm_loops) == 2 and all(loop.opcodes["BAR"] == 0
                                                for loop in summary.gemm_loops)
    # lse·log2 e read ahead of Sᵀ's GEMM, a thread's 16 columns as LDS.64: behind the GEMMs the
    # loads wait for the tensor core (notes/bwd.md "Session 67, later")
    assert [loop.lds_before_gemm for loop in summary.gemm_loops] == [ws.BLOCK_Q // 8] * 2
    # the mbarriers' arrival counts, as the docstring's table gives them
    inits = dict(re.findall(r"(\w+\[\d\])\.init\((\d+)\)", emitted.source))
    assert inits == {"kv_full[0]": "32", "q_full[0]": "32", "q_full[1]": "32",
                     "do_full[0]": "32", "do_full[1]": "32", "q_empty[0]": "256",
                     "q_empty[1]": "256", "do_empty[0]": "256", "do_empty[1]": "256",
                     "ds_ready[0]": "128", "ds_ready[1]": "128", "ds_ready[2]": "128",
                     "ds_ready[3]": "128", "dq_full[0]": "128", "dq_full[1]": "128",
                     "dq_empty[0]": "1", "dq_empty[1]": "1"}, inits


@pytest.mark.parametrize("n_kvtiles,kv_heads,batch,fill", [(32, 8, 1, 4), (3, 2, 3, 2),
                                                           (4, 8, 2, 1), (5, 4, 2, 8)])
def test_the_grouped_launch_order_runs_every_kv_tile_once(n_kvtiles, kv_heads, batch, fill):
    """Every (K/V tile, KV head, batch) once; within a group of ``fill`` units the tiles come
    in order (tile 0, the longest causal walk, first); ``fill`` 1 is ``kv_grid``'s full order."""
    units = kv_heads * batch
    if units % fill:
        fill = units
    order = [tile_scheduler.grouped_kv_tile(t, n_kvtiles, kv_heads, fill)
             for t in range(n_kvtiles * units)]
    assert sorted(order) == sorted(itertools.product(range(n_kvtiles), range(kv_heads),
                                                     range(batch)))
    span = fill * n_kvtiles
    for g in range(0, len(order), span):
        tiles = [tile for tile, _, _ in order[g:g + span]]
        assert tiles == sorted(tiles)
    if fill == 1:
        gx_n, gy_n = tile_scheduler.kv_grid(n_kvtiles, kv_heads, batch, False)
        assert order == [tile_scheduler.kv_tile(gx, gy, n_kvtiles, kv_heads, False)
                         for gy in range(gy_n) for gx in range(gx_n)]


def test_the_fill_and_backend_rules():
    """TileOPs' fill on the causal 8B rows (4 KV heads' tiles at 4k, 2 at 8k: one wave of 132
    CTAs), 1 on full ones; ws wherever it runs unless a pipelined option is asked for."""
    assert [heuristics.kv_fill(8, n, True, 132) for n in (32, 64)] == [4, 2]
    assert heuristics.kv_fill(8, 32, False, 132) == 1
    assert heuristics.kv_fill(6, 200, True, 132) == 1  # no group fits a wave: one KV head
    assert heuristics.backend(True, False, False) == "ws"
    assert {heuristics.backend(*a) for a in ((False, False, False), (True, True, False),
                                             (True, False, True))} == {"pipelined"}


def test_the_ws_backend_refuses_what_it_does_not_run():
    """Before any launch (CPU tensors reach the check): a ragged S, D 64, pipelined's options,
    an unknown backend."""
    def call(s, d, **kw):
        q = torch.zeros(1, s, 2, d, dtype=torch.float16)
        k = torch.zeros(1, s, 1, d, dtype=torch.float16)
        pipelined.attention_bwd(q, k, k, q, q, torch.zeros(1, 2, s), **kw)

    with pytest.raises(ValueError, match="seq_len 127 is no multiple of 128"):
        call(127, 128, backend="ws")
    with pytest.raises(ValueError, match=r"head_dim 64 \(runs \(128,\)\)"):
        call(128, 64, backend="ws")
    with pytest.raises(ValueError, match="does not run the deterministic mode"):
        call(128, 128, backend="ws", deterministic=True)
    with pytest.raises(ValueError, match="backend must be 'pipelined' or 'ws'"):
        call(128, 128, backend="tileops")
    with pytest.raises(TypeError, match="backend 'ws' takes a ws_lab.kernels.bwd.ws.Config"):
        call(128, 128, backend="ws", config=pipelined.DEFAULT)
    with pytest.raises(TypeError, match="backend 'pipelined' takes a"):
        call(128, 128, backend="pipelined", config=ws.DEFAULT)
    with pytest.raises(ValueError, match="dq_layout must be one of"):
        call(128, 128, config=ws.Config(dq_layout="dense"))
    with pytest.raises(ValueError, match="seq_len 127"):  # a ws.Config asks for ws
        call(127, 128, config=ws.Config())
    assert not registry.get("bwd-ws").supports(shapes.Shape("r", 1, 2, 1, 127, 128, 128, False,
                                                             "bfloat16"))


def test_the_swizzled_dq_staging_is_a_bank_conflict_free_permutation():
    """``prepost.stored_column``'s swizzle: each row's 64 columns permuted, and each float2
    store of the wgmma accumulator (lane l of a warp: rows l / 4 and l / 4 + 8 of its 16,
    columns 8c + 2 (l mod 4) and + 1) reaching 2 wavefronts, the 256 B minimum, with no pad."""
    for row in range(64):
        assert sorted(prepost.stored_column("swizzled", row, c) for c in range(64)) == list(
            range(64))
    width = prepost.dq_accum_shape(1, 128, 1, 128, 2, "swizzled")[-1]
    assert width == 64
    for warp, half, group in itertools.product(range(4), range(2), range(8)):
        banks = []
        for lane in range(32):
            row = warp * 16 + lane // 4 + 8 * half
            col = prepost.stored_column("swizzled", row, 8 * group + 2 * (lane % 4))
            word = row * width + col
            banks += [word % 32, (word + 1) % 32]
        assert max(banks.count(b) for b in range(32)) == 2, (warp, half, group)


@needs_nvcc
def test_the_swizzled_layout_keeps_its_stores_vectorized_in_less_shared_memory(tmp_path):
    """``dq_layout="swizzled"`` (the default): the staging stays float2 stores, the postprocess
    float4 loads, shared memory 4 KB smaller, no spill."""
    shape = shapes.Shape("bwd-ws-swz", 2, 8, 2, 1024, 128, 128, True, "bfloat16")
    swz = emit.lower_variant("bwd-ws", shape, ws.flash_bwd_ws(
        2, 1024, 8, 2, 128, True, "bfloat16", 0.088, 2, "swizzled"), ws.PASS_CONFIGS)
    pad = emit.lower_variant("bwd-ws", shape, ws.flash_bwd_ws(
        2, 1024, 8, 2, 128, True, "bfloat16", 0.088, 2, "padded"), ws.PASS_CONFIGS)
    stores = [line for line in swz.source.splitlines() if "((float*)dq_s) +" in line]
    assert stores and all(line.lstrip().startswith("*(float2*)") for line in stores)
    post = emit.lower_prim_func(prepost.postprocess(2, 1024, 8, 128, "bfloat16", 2,
                                                    "swizzled")).kernel_source
    assert "*(float4*)(acc" in post
    s_swz, s_pad = (emit.inspect(e, tmp_path / n) for e, n in ((swz, "swz"), (pad, "pad")))
    assert s_pad.dyn_smem - s_swz.dyn_smem == 2 * 64 * prepost.DQ_PAD * 4
    assert s_swz.spill_bytes == 0 and s_swz.stack_frame == 0, s_swz.format()


@needs_nvcc
def test_the_pdl_option_waits_before_the_preprocess_outputs(tmp_path):
    """``ws.Config(pdl=True)``: the preprocess lets the main kernel launch at its start; the main
    kernel's producer issues K and V, lets the postprocess launch, then waits before its first
    lse / Δ load; the postprocess waits before its first read; each waiting kernel is marked for
    a programmatic launch. Without it the three kernels hold no PDL call."""
    args = (2, 1024, 8, 2, 128, True, "bfloat16", 0.088, 2, "swizzled")
    on = emit.lower_variant("bwd-ws", shapes.Shape("bwd-ws-pdl", 2, 8, 2, 1024, 128, 128, True,
                                                   "bfloat16"),
                            ws.flash_bwd_ws(*args, pdl=True), ws.PASS_CONFIGS)
    producer = on.source[on.source.index("kv_full[0].arrive()"):]
    trigger = producer.index("cudaTriggerProgrammaticLaunchCompletion()")
    wait = producer.index("cudaGridDependencySynchronize()")
    assert trigger < wait < producer.index("LSElog2")
    assert on.source.count("cudaGridDependencySynchronize()") == 1
    assert emit.inspect(on, tmp_path).spill_bytes == 0
    off = emit.lower_prim_func(ws.flash_bwd_ws(*args), ws.PASS_CONFIGS).kernel_source
    pre_on, pre_off = (emit.lower_prim_func(prepost.preprocess(
        2, 1024, 8, 128, "bfloat16", 0.088, planes=2, layout="swizzled", pdl=pdl)).kernel_source
        for pdl in (True, False))
    post_on, post_off = (emit.lower_prim_func(prepost.postprocess(
        2, 1024, 8, 128, "bfloat16", 2, "swizzled", pdl=pdl)) for pdl in (True, False))
    body = pre_on[pre_on.index("main_kernel("):]
    assert body.index("cudaTriggerProgrammaticLaunchCompletion()") < body.index("(O + ")
    post_src = post_on.kernel_source
    assert post_src.index("cudaGridDependencySynchronize()") < post_src.index("(dQaccum + ")
    marked = {name: "has_cuda_pdl_sync" in str(art.device_mod)
              for name, art in (("post", post_on), ("post_off", post_off))}
    assert marked == {"post": True, "post_off": False}
    for source in (off, pre_off, post_off.kernel_source):
        assert "Programmatic" not in source and "GridDependency" not in source


@pytest.mark.parametrize("n_kvtiles,kv_heads,batch,group,causal",
                         [(32, 8, 1, 4, True), (3, 2, 3, 7, True), (4, 8, 2, 1, False),
                          (5, 4, 2, 8, False)])
def test_steps_before_numbers_every_ctas_steps_once(n_kvtiles, kv_heads, batch, group, causal):
    """``zero_next``'s global step index: the CTAs' step ranges [steps_before, + kv_walk_steps)
    tile [0, all steps) with no gap or overlap, so the zeroer's chunk ranges [g·C / N, (g+1)·C
    / N) cover every chunk once; the number of all steps is steps_before of (0, 0, batch)."""
    n_qtiles, ratio = 2 * n_kvtiles, ws.BLOCK_KV // ws.BLOCK_Q
    spans = sorted((tile_scheduler.steps_before(tile, kvh, b, n_qtiles, n_kvtiles, kv_heads,
                                                group, causal, ratio),
                    tile_scheduler.kv_walk_steps(tile, n_qtiles, group, causal, ratio))
                   for tile, kvh, b in itertools.product(range(n_kvtiles), range(kv_heads),
                                                         range(batch)))
    at = 0
    for start, steps in spans:
        assert start == at and steps > 0
        at += steps
    assert at == tile_scheduler.steps_before(0, 0, batch, n_qtiles, n_kvtiles, kv_heads, group,
                                             causal, ratio)


@pytest.mark.parametrize("chunks,steps,first,count", [(32768, 33792, 0, 256),
                                                      (32768, 33792, 33536, 256),
                                                      (131072, 524288, 1000, 4096),
                                                      (7, 3, 1, 2)])
def test_the_zeroers_int32_stepping_gives_the_chunk_ranges(chunks, steps, first, count):
    """The zeroer steps its chunk start in int32 (``at`` += C // N, and 1 more whenever the
    remainder passes N) from ``first·C // N``: it lands on g·C // N at every step g, so its
    ranges are the formula's."""
    at, rem = first * chunks // steps, first * chunks % steps
    for g in range(first, first + count):
        carry = 1 if rem + chunks % steps >= steps else 0
        assert (at, at + chunks // steps + carry) == (g * chunks // steps,
                                                      (g + 1) * chunks // steps)
        at, rem = at + chunks // steps + carry, rem + chunks % steps - carry * steps


@needs_nvcc
def test_the_zero_next_option_zeroes_the_spare_accumulator_in_the_idle_warp(tmp_path):
    """``ws.Config(zero_next=True)``: warp 11 bulk-stores zeros, evict-first, into the other
    accumulator of the pair (index 1 − parity), the reduce-adds go to ``dQ[parity]``, the
    producer warpgroup stays at 24 registers (3 × 168 = 24 + 2 × 240) with no spill, q_empty
    counts the zeroer; the preprocess stores no accumulator and flips the parity once, the
    postprocess reads the pair at the parity; without the option none of it is there."""
    args = (2, 1024, 8, 2, 128, True, "bfloat16", 0.088, 2, "swizzled")
    shape = shapes.Shape("bwd-ws-zn", 2, 8, 2, 1024, 128, 128, True, "bfloat16")
    on = emit.lower_variant("bwd-ws", shape, ws.flash_bwd_ws(*args, zero_next=True),
                            ws.PASS_CONFIGS)
    summary = emit.inspect(on, tmp_path)
    assert sorted(set(summary.setmaxnreg)) == ["DEALLOC 24", "TRY_ALLOC 240"]
    assert summary.spill_bytes == 0 and summary.stack_frame == 0, summary.format()
    zero_stores = re.findall(r"tl::tma_store<tl::CacheHintSm90::EVICT_FIRST>\(.*", on.source)
    assert len(zero_stores) == 1 and "- (((int64_t)Parity[(int64_t)0]) *" in zero_stores[0]
    adds = re.findall(r"tl::tma_store_add\(.*", on.source)
    assert len(adds) == 2 and all("(int64_t)Parity[(int64_t)0]) * (int64_t)2097152" in a
                                  for a in adds)
    inits = dict(re.findall(r"(\w+\[\d\])\.init\((\d+)\)", on.source))
    assert inits["q_empty[0]"] == inits["q_empty[1]"] == str(ws.CONSUMER_THREADS + 1)
    pre = emit.lower_prim_func(prepost.preprocess(
        2, 1024, 8, 128, "bfloat16", 0.088, clear_dq=False, planes=2, layout="swizzled",
        flip_parity=True)).kernel_source
    assert "dQ" not in pre and pre.count("Parity[0] = (1 - Parity[0]);") == 1
    post = emit.lower_prim_func(prepost.postprocess(2, 1024, 8, 128, "bfloat16", 2, "swizzled",
                                                    paired=True)).kernel_source
    assert "Parity[0]" in post
    off = emit.lower_prim_func(ws.flash_bwd_ws(*args), ws.PASS_CONFIGS).kernel_source
    assert "EVICT_FIRST" not in off and "Parity" not in off
