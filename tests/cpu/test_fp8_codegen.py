"""The FP8 forward (kernels/fwd/fp8.py) on a CPU: the designs lower for sm_90a and compile
as their docstrings say (every GEMM on e4m3 wgmma (QGMMA) from shared memory, P through shared
memory or, in the RS design, from registers, Vᵀ K-major, the producer / consumer register split, no spill, the kernels' own
barriers only); bad inputs are refused before a launch; the registry binds each design;
``quantize`` and its Hadamard option do what they say, measured with the float64 oracle (Vᵀ's
Triton pass: tests/cpu/interpret_cases.py); the exp2 of the FMA-pipe option is 2^x after TVM's
simplifier and moves its share of the exp2s off MUFU."""
import dataclasses
import re
import shutil

import numpy as np
import pytest
import torch
from tilelang import tvm

from ws_lab import emit, oracle, registry, shapes
from ws_lab.kernels.fwd import coop, coop_overlap, fp8, heuristics, softmax
from ws_lab.kernels.fwd.barriers import EPILOGUES, NamedBarrier
from ws_lab.postproc import drop_anchor_fences
from ws_lab.target import H100_L2_BYTES

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


@needs_nvcc
@pytest.mark.parametrize("head_dim,causal,seq_len", [(128, False, 4096), (64, True, 127)])
def test_fp8_forward_compiles_to_e4m3_wgmma_without_spills(tmp_path, head_dim, causal, seq_len):
    shape = shapes.Shape("fp8-codegen", 2, 8, 2, seq_len, head_dim, head_dim, causal,
                         "bfloat16")
    emitted = emit.lower_variant("fp8", shape, fp8.prim_func_for(shape), fp8.PASS_CONFIGS)
    summary = emit.inspect(emitted, tmp_path)
    cfg = fp8.config_for(causal)
    # a warpgroup's 64 rows a GEMM; K = 32 e4m3 a wgmma: Q Kᵀ over D, P Vᵀᵀ over the block
    want = {f"64x{cfg.block_n}x32.F32.E4M3.E4M3": head_dim // 32}
    want[f"64x{head_dim}x32.F32.E4M3.E4M3"] = want.get(
        f"64x{head_dim}x32.F32.E4M3.E4M3", 0) + cfg.block_n // 32
    assert dict(summary.hgmma) == want, summary.format()
    assert sorted(set(summary.setmaxnreg)) == ["DEALLOC 24", "TRY_ALLOC 240"]
    assert summary.spill_bytes == 0 and summary.stack_frame == 0, summary.format()
    assert "mma_sync" not in emitted.source and "ldmatrix" not in emitted.source
    # the kernel's own barriers only: each warpgroup waits for its 128 threads' P, and all 256
    # consumer threads for O before its TMA store; none of TileLang's consumer-wide syncs
    syncs = re.findall(r"__sync_thread_partial\(([^;]*)\);", emitted.source)
    # (the consumers are threads 128–383: warpgroup w's id is threadIdx.x / 128 − 1 + WG1's)
    syncs = [s.replace(" ", "") for s in syncs]
    assert syncs == [f"((((int)threadIdx.x)>>7)+{NamedBarrier.FP8_P_WG1 - 1}),128",
                     f"{NamedBarrier.FP8_O_TILE},256"], syncs


@needs_nvcc
@pytest.mark.parametrize("head_dim,causal,seq_len", [(128, False, 4096), (64, True, 127)])
def test_the_coop_design_compiles_to_e4m3_wgmma_with_a_p_tile_per_warpgroup(
        tmp_path, head_dim, causal, seq_len):
    """kernels/fwd/coop.py on e4m3 (``design="coop-overlap"``): every GEMM an e4m3 wgmma from
    shared memory, the explicit roles' register split, no spill; each warpgroup publishes its
    P through its own tile and 128-thread barrier and issues its PV from that tile; O leaves
    through a bf16 tile, V's descale applied."""
    shape = shapes.Shape("fp8-codegen", 2, 8, 2, seq_len, head_dim, head_dim, causal,
                         "bfloat16")
    func = fp8.prim_func_for(shape, design="coop-overlap")
    emitted = emit.lower_variant("fp8-coop", shape, func, fp8.coop.PASS_CONFIGS)
    summary = emit.inspect(emitted, tmp_path)
    assert summary.hgmma and all(k.endswith(".F32.E4M3.E4M3") for k in summary.hgmma), \
        summary.format()
    assert sorted(set(summary.setmaxnreg)) == ["DEALLOC 24", "TRY_ALLOC 240"]
    assert summary.spill_bytes == 0 and summary.stack_frame == 0, summary.format()
    source = emitted.source
    for wg, barrier in enumerate((NamedBarrier.FP8_P_WG1, NamedBarrier.FP8_P_WG2)):
        published = rf"fence_proxy_async\(\);\s*tl::__sync_thread_partial\({int(barrier)}, 128\)"
        assert re.search(published, source), f"warpgroup {wg + 1}'s P barrier"
    p_operands = re.findall(r"initialize_wgmma_descriptor<[^>]*>\(desc_a_\d+, (.*?p_s.*?)\);",
                            source)
    wg2_offset = f"+ {64 * fp8.coop_config_for(causal).block_n})"  # bytes: 64 rows of e4m3 P
    assert any(wg2_offset in d for d in p_operands), p_operands
    assert any("+" not in d for d in p_operands), p_operands
    assert "VDescale[" in source and "bfloat16_t*)o_s" in source
    # P's register fences cover its e4m3 registers, not more: 64 × bn bytes over 128 threads
    p_fences = re.findall(
        r"warpgroup_fence_operand\(reinterpret_cast<uint32_t\*>\(p \+ 0\), (\d+)\)", source)
    block_n = fp8.coop_config_for(causal).block_n
    assert set(p_fences) <= {str(64 * block_n // 512)}, p_fences
    assert p_fences or seq_len <= block_n  # a single K/V block has no overlapped step


@needs_nvcc
@pytest.mark.parametrize("name,cluster", [("train8b-8k", 2), ("llama8b-4k", 1)])
def test_the_persistent_design_fits_256_key_blocks_and_stores_o_from_registers(
        tmp_path, name, cluster):
    """The persistent coop-overlap design at bn 256: e4m3 wgmma only, no spill, within the
    227 KB of shared memory because O leaves from registers (no TMA store, no O tile); CTA
    pairs where the e4m3 K / V exceed half of the H100's L2 (train8b-8k: 32 MB)."""
    shape = shapes.SHAPES[name]
    func = fp8.prim_func_for(shape, design="coop-overlap-persistent")
    emitted = emit.lower_variant("fp8-coop-persistent", shape, func, fp8.coop.PASS_CONFIGS)
    summary = emit.inspect(emitted, tmp_path)
    assert summary.hgmma and all(k.endswith(".F32.E4M3.E4M3") for k in summary.hgmma), \
        summary.format()
    assert summary.spill_bytes == 0 and summary.stack_frame == 0, summary.format()
    assert summary.dyn_smem <= 227 * 1024 and summary.counts["UTMASTG"] == 0, summary.format()
    assert fp8.coop_config_for(shape.causal, persistent=True).block_n == 256
    assert ("tl::cluster_sync()" in emitted.source) == (cluster == 2)
    assert "VDescale[" in emitted.source and "o_s" not in emitted.source


@needs_nvcc
@pytest.mark.parametrize("name,cluster", [("train8b-8k", 2), ("llama8b-4k", 1)])
def test_the_rs_persistent_design_keeps_o_in_its_tile(tmp_path, name, cluster):
    """``design="coop-overlap-rs-persistent"``: the RS design on the persistent walk. With no
    P tile, O keeps its bf16 tile and TMA store within the 227 KB (176 KB at bn 224), no
    spill; each epilogue waits on its warpgroup's barrier before it writes the tile again
    (the last store has read it), as well as before the store."""
    shape = shapes.SHAPES[name]
    func = fp8.prim_func_for(shape, design="coop-overlap-rs-persistent")
    passes = registry.get("fp8-coop-rs-persistent").postproc_passes
    emitted = emit.lower_variant("fp8-coop-rs-persistent", shape, func, fp8.coop.PASS_CONFIGS,
                                 passes)
    summary = emit.inspect(emitted, tmp_path)
    d = shape.head_dim
    assert set(summary.hgmma) == {f"64x{d}x32.F32.E4M3.E4M3.RS", "64x224x32.F32.E4M3.E4M3"}, \
        summary.format()
    assert summary.spill_bytes == 0 and summary.stack_frame == 0, summary.format()
    assert summary.dyn_smem <= 227 * 1024 and summary.counts["UTMASTG"] > 0, summary.format()
    assert ("tl::cluster_sync()" in emitted.source) == (cluster == 2)
    for wg_barrier in EPILOGUES:
        assert emitted.source.count(f"tl::__sync_thread_partial({int(wg_barrier)}, 128)") == 2


def test_the_operand_key_order_moves_no_register_between_threads():
    """coop.operand_key permutes each 16 columns so that P's e4m3 A-operand columns of lane q
    (4q … 4q+3) are the fp32 accumulator columns that lane already holds (2q, 2q+1, 2q+8,
    2q+9)."""
    for base in (0, 16, 208):
        keys = [fp8.coop.operand_key(base + a) for a in range(16)]
        assert sorted(keys) == list(range(base, base + 16))
        for q in range(4):
            held = {base + 2 * q, base + 2 * q + 1, base + 2 * q + 8, base + 2 * q + 9}
            assert set(keys[4 * q:4 * q + 4]) == held


@needs_nvcc
@pytest.mark.parametrize("name,causal", [("train8b-8k", False), ("llama8b-4k", True),
                                         ("d64-4k", True)])
def test_the_rs_design_takes_p_from_registers_at_224_keys_without_spills(tmp_path, name,
                                                                         causal):
    """``design="coop-overlap-rs"``: the PV GEMM an e4m3 wgmma with P from registers (RS),
    S = Q Kᵀ on 224-key blocks, no P tile and no P barrier, no spill and no wgmma serialised
    (ptxas C7512: S, P and O in flight at 256 keys pass the 240 registers), P copied in the
    operand key order."""
    shape = shapes.SHAPES[name]
    shape = shapes.Shape(shape.name, shape.batch, shape.heads, shape.kv_heads, shape.seq_len,
                         shape.head_dim, shape.head_dim_v, causal, shape.dtype)
    func = fp8.prim_func_for(shape, design="coop-overlap-rs")
    passes = registry.get("fp8-coop-rs").postproc_passes  # what the kernel compiles under
    emitted = emit.lower_variant("fp8-coop-rs", shape, func, fp8.coop.PASS_CONFIGS, passes)
    summary = emit.inspect(emitted, tmp_path)
    d = shape.head_dim
    assert set(summary.hgmma) == {f"64x{d}x32.F32.E4M3.E4M3.RS", "64x224x32.F32.E4M3.E4M3"}, \
        summary.format()
    assert summary.spill_bytes == 0 and summary.stack_frame == 0, summary.format()
    assert not summary.ptxas_remarks, summary.format()  # C7512: wgmmas serialised
    assert "p_s" not in emitted.source
    # the wait anchor's proxy fences (a MEMBAR and a FENCE a block) are gone, as when it runs
    arrive_fence = re.compile(r"tl::warpgroup_arrive\(\);\n\s*tl::fence_proxy_async\(\);")
    assert arrive_fence.search(emitted.source) and not arrive_fence.search(emitted.postprocessed)
    for barrier in (NamedBarrier.FP8_P_WG1, NamedBarrier.FP8_P_WG2):
        assert f"__sync_thread_partial({int(barrier)}, 128)" not in emitted.source


@needs_nvcc
@pytest.mark.parametrize("name,causal", [("llama8b-4k", True), ("train8b-4k", False)])
def test_the_descending_design_walks_kv_down_with_the_masked_blocks_first(tmp_path, name,
                                                                          causal):
    """``design="coop-overlap-rs-desc"`` (``coop.Config.kv_descending``, FA3's order): the
    producer loads key block n − 1 − kb into iteration kb's stage; causal, each warpgroup's
    loop runs its masked iterations (the mask's FSELs) before the unmasked ones, and only the
    first block's softmax checks for a wholly masked row (-inf max), and no key's test adds
    its column (FA3's form); full and ragged, one unmasked loop (the ragged block is the
    first); no spill."""
    shape = shapes.SHAPES[name]
    emitted = emit.lower("fp8-coop-rs-desc", shape)
    summary = emit.inspect(emitted, tmp_path)
    assert summary.spill_bytes == 0 and summary.stack_frame == 0, summary.format()
    assert sorted(set(summary.setmaxnreg)) == ["DEALLOC 24", "TRY_ALLOC 240"]
    k_loads = re.findall(r"tl::tma_load\(K_desc, .*", emitted.source)
    assert len(k_loads) == 1 and "- (kb * 224)" in k_loads[0]  # the key row falls with kb
    masked = [loop.opcodes["FSEL"] >= 100 for loop in summary.gemm_loops]
    assert masked == ([True, False] * 2 if causal else [False] * 2), summary.format()
    # FA3's mask: each key's column an immediate against its row's limit, no add a key
    # (58 VIADD a masked block before, notes/fp8.md "Session 65")
    assert all(loop.opcodes.get("VIADD", 0) < 8 for loop in summary.gemm_loops), summary.format()
    assert emitted.source.count("float safe_max") == (2 if causal else 0)


@pytest.mark.parametrize("seq_len,block_n", [(4096, 224), (1000, 128), (8192, 176)])
def test_the_descending_split_masks_exactly_the_blocks_that_need_it(seq_len, block_n):
    """``first_unmasked_iteration``: for every warpgroup of every causal tile, iterations
    [1, it) of the downward walk hold key blocks with a key past some row of the warpgroup and
    [it, n) none; iteration 0, the diagonal block, can mask a whole row, iteration 1 cannot (so
    the -inf check is the first block's alone)."""
    bm, half = 128, 64
    for row0 in range(0, seq_len, half):
        tile_end = (row0 // bm + 1) * bm
        loop_range = min(-(-seq_len // block_n), -(-tile_end // block_n))
        it = int(softmax.first_unmasked_iteration(True, seq_len, block_n, row0, loop_range))
        for kb in range(1, loop_range):
            first_key = (loop_range - 1 - kb) * block_n
            needs_mask = first_key + block_n - 1 > row0
            assert needs_mask == (kb < it), (row0, kb, it)
        if loop_range > 1:
            assert (loop_range - 2) * block_n <= row0  # every row keeps a key at iteration 1


def test_kv_descending_refuses_the_kernels_that_walk_upward():
    """The one-Q-slot persistent producer, the transposing producer and the serial mainloop
    load or mask K/V ascending: with ``kv_descending`` each refuses before lowering."""
    args = (1, 4096, 8, 2, 128, 128, True, coop.FP8_DTYPE, 0.088)
    for cfg in (fp8.coop_config_for(True, persistent=True, p_in_registers=True),
                fp8.coop_config_for(True, p_in_registers=True, transpose_v=True)):
        cfg = dataclasses.replace(cfg, kv_descending=True, q_slots=1 if cfg.persistent else 2)
        with pytest.raises(ValueError, match="kv_descending runs without transpose_v"):
            coop.coop_fwd(*args, cfg, fp8.coop_mainloop(cfg))
    with pytest.raises(ValueError, match="kv_descending is the IntraWGOverlap mainloop's"):
        coop.coop_fwd(1, 4096, 8, 2, 128, 128, True, "bfloat16", 0.088,
                      coop.Config(128, 2, True, kv_descending=True), coop.serial_mainloop)


# the per-row shift of P's exp2 as TileLang emits it: (row_max[..] * the scale: FP8's run-time
# scale_log2[_n], bf16's constant), then " - 0x1p+3f" where FP8_PROB_LOG2_OFFSET is folded in
PROB_SHIFT = re.compile(r"make_float2\(\(*(?:row|safe)_max(?:_\d+)?\[[^]]*\] \* [\w.+-]+"
                        r"(?:/\*[^*]*\*/)?\)"
                        r"( - 0x1p\+3f)?")


@pytest.mark.parametrize("design", fp8.DESIGNS)
def test_every_fp8_design_shifts_p_up_by_the_offset(design):
    """P = exp2(s·scale − (max·scale − 8)) in each FP8 design (FA3's Max_offset: e4m3 P in
    [0, 256]), the offset in the per-row shift, not per element (the lse taking it back out:
    tests/ws/test_fp8.py)."""
    shape = shapes.Shape("fp8-codegen", 1, 4, 2, 127, 64, 64, True, "bfloat16")
    source = emit.lower_variant(design, shape, fp8.prim_func_for(shape, design=design),
                                fp8.PASS_CONFIGS).source
    offsets = PROB_SHIFT.findall(source)
    assert offsets and all(offsets), offsets


def test_the_bf16_coop_kernel_shifts_p_by_its_row_max_only():
    shape = shapes.Shape("bf16-codegen", 1, 4, 2, 127, 64, 64, True, "bfloat16")
    func = coop.coop_fwd(1, 127, 4, 2, 64, 64, True, "bfloat16", 0.125, coop.Config(128, 2, True),
                         coop_overlap.overlap_mainloop())
    offsets = PROB_SHIFT.findall(emit.lower_variant("coop-overlap", shape, func,
                                                    coop.PASS_CONFIGS).source)
    assert offsets and not any(offsets), offsets


def test_the_fp8_offset_refuses_a_lazy_rescale():
    """A lazy rescale lets P reach 2^8 before the offset's 2^8: past e4m3's 448."""
    with pytest.raises(ValueError, match="FP8 forward takes no lazy rescale"):
        coop.coop_fwd(1, 127, 4, 2, 64, 64, True, coop.FP8_DTYPE, 0.125,
                      fp8.coop_config_for(True), coop_overlap.overlap_mainloop(lazy_rescale=True))


def test_fp8_forward_refuses_bad_inputs_before_a_launch():
    q = torch.zeros(1, 8, 4, 128, dtype=fp8.FP8)
    kv = torch.zeros(1, 8, 2, 128, dtype=fp8.FP8)
    with pytest.raises(TypeError, match="q has dtype torch.bfloat16"):
        fp8.attention_fp8(q.to(torch.bfloat16), kv, kv)
    with pytest.raises(ValueError, match=r"k_descale must be a float32 tensor of shape \(B, Hkv\)"):
        fp8.attention_fp8(q, kv, kv, k_descale=torch.ones(1, 4))
    with pytest.raises(ValueError, match="out must be a contiguous torch.bfloat16 tensor"):
        fp8.attention_fp8(q, kv, kv, out=torch.empty(1, 8, 4, 128))
    with pytest.raises(ValueError, match="unsupported head dim"):
        fp8.attention_fp8(q[..., :32], kv[..., :32], kv[..., :32])
    with pytest.raises(ValueError, match="inputs must be CUDA tensors"):
        fp8.attention_fp8(q, kv, kv)
    with pytest.raises(ValueError, match="design must be 'auto' or one of"):
        fp8.attention_fp8(q, kv, kv, design="persistent-coop")
    with pytest.raises(ValueError, match="return_lse needs design='pipelined'"):
        fp8.attention_fp8(q, kv, kv, return_lse=True, design="coop-overlap")
    with pytest.raises(ValueError, match="cluster must be None, 1 or 2 with a persistent design"):
        fp8.attention_fp8(q, kv, kv, cluster=2, design="coop-overlap")
    with pytest.raises(ValueError, match="cluster must be None, 1 or 2 with a persistent design"):
        fp8.attention_fp8(q, kv, kv, cluster=4, design="coop-overlap-persistent")


def test_the_registry_binds_each_fp8_design():
    q = torch.zeros(1, 8, 4, 128, dtype=fp8.FP8)
    kv = torch.zeros(1, 8, 2, 128, dtype=fp8.FP8)
    coop_op = registry.get("fp8-coop").fp8_attention
    assert coop_op.keywords == {"design": "coop-overlap"}
    with pytest.raises(ValueError, match="return_lse needs design='pipelined'"):
        coop_op(q, kv, kv, return_lse=True)
    assert registry.get("fp8-coop-persistent").fp8_attention.keywords == {
        "design": "coop-overlap-persistent"}
    assert registry.get("fp8-coop-rs").fp8_attention.keywords == {"design": "coop-overlap-rs"}
    assert registry.get("fp8-coop-rs-vt").fp8_attention.keywords == {
        "design": "coop-overlap-rs-vt"}
    assert registry.get("fp8-coop-rs-persistent").fp8_attention.keywords == {
        "design": "coop-overlap-rs-persistent"}
    assert registry.get("fp8-coop-rs-desc").fp8_attention.keywords == {
        "design": "coop-overlap-rs-desc"}
    assert registry.get("fp8-coop-rs-persistent-desc").fp8_attention.keywords == {
        "design": "coop-overlap-rs-persistent-desc"}
    assert registry.get("fp8").fp8_attention.keywords == {"design": "pipelined"}
    # ws_lab.emit shows each design through the passes it compiles under
    assert registry.get("fp8").postproc_passes == ()
    for name in ("fp8-coop", "fp8-coop-persistent", "fp8-coop-rs", "fp8-coop-rs-vt",
                 "fp8-coop-rs-persistent", "fp8-coop-rs-desc", "fp8-coop-rs-persistent-desc"):
        assert registry.get(name).postproc_passes == (drop_anchor_fences,), name
    with pytest.raises(TypeError, match="fp8 is a fp8 kernel, not a fwd one"):
        registry.get("fp8").attention


@pytest.mark.parametrize("shape,design", [
    ("train8b-8k", "coop-overlap-rs-desc"),  # 32 MB of e4m3 K / V: past half of L2
    ("train8b-4k", "coop-overlap-rs-persistent-desc"),
    ("llama8b-8k", "coop-overlap-rs-persistent-desc"),
    ("llama8b-4k", "coop-overlap-rs-persistent-desc"),
    ("d64-4k", "coop-overlap-rs-desc"),  # 32 KV heads: 32 MB
])
def test_the_default_design_follows_the_measured_rule(shape, design):
    s = shapes.get(shape)
    assert fp8.DESIGNS.count(design) == 1
    args = (s.batch, s.seq_len, s.kv_heads, s.head_dim)
    assert heuristics.fp8_design(*args, False, H100_L2_BYTES) == design
    assert heuristics.fp8_design(*args, True, H100_L2_BYTES) == "pipelined"  # the lse's design
    # the rule's line is the persistent walk's own: past it, CTA pairs or Q-tile groups
    assert heuristics.fp8_design(*args, False, 2 * H100_L2_BYTES) == (
        "coop-overlap-rs-persistent-desc")


@needs_nvcc
@pytest.mark.parametrize("name,turns", [("llama8b-4k", False), ("train8b-4k", True)])
def test_the_persistent_desc_design_drops_pingpong_on_causal_calls(tmp_path, name, turns):
    """``heuristics.fp8_pingpong``: the persistent downward walk runs causal calls without the
    warpgroups' issue turns (1.021 × pingpong on llama8b-4k, notes/fp8.md "Session 68") and
    full ones with them; every other design keeps them."""
    shape = shapes.get(name)
    design = "coop-overlap-rs-persistent-desc"
    assert heuristics.fp8_pingpong(design, shape.causal) == turns
    assert all(heuristics.fp8_pingpong(d, shape.causal) for d in fp8.DESIGNS if d != design)
    summary = emit.inspect(emit.lower("fp8-coop-rs-persistent-desc", shape), tmp_path)
    assert bool(summary.issue_turns) == turns, summary.format()


def test_the_hadamard_rotation_is_orthogonal_and_keeps_every_score():
    rotation = fp8.hadamard_rotation(128, seed=3)
    assert torch.allclose(rotation @ rotation.T, torch.eye(128, dtype=torch.float64),
                          atol=1e-12)
    q, k = torch.randn(2, 128, dtype=torch.float64), torch.randn(5, 128, dtype=torch.float64)
    assert torch.allclose((q @ rotation) @ (k @ rotation).T, q @ k.T, atol=1e-10)
    with pytest.raises(ValueError, match="power-of-two head dim, got 96"):
        fp8.hadamard_rotation(96, seed=0)


def quantisation_error(q, k, v, hadamard):
    """rel-L2 of attention on the dequantised e4m3 inputs against attention on q, k, v (both
    by the float64 oracle): the error FP8 inputs add before any kernel runs."""
    z = fp8.quantize(q, k, v, hadamard=hadamard)
    got = oracle.attention_ref(*z.dequantised(), causal=True)[0]
    return oracle.rel_l2(got, oracle.attention_ref(q, k, v, causal=True)[0])


def test_quantize_scales_each_kv_heads_group_to_the_e4m3_range():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 64, h, 64).to(torch.bfloat16) for h in (8, 2, 2))
    z = fp8.quantize(q, k, v)
    assert z.q.dtype == z.k.dtype == z.v.dtype == fp8.FP8 and z.q_descale.shape == (2, 2)
    assert z.q.float().abs().amax().item() == fp8.E4M3_MAX
    assert oracle.rel_l2(fp8.dequantise(z.q, z.q_descale), q) < 0.05  # 3 mantissa bits


def test_hadamard_cuts_the_quantisation_error_of_outlier_channels():
    """Keys with 4 channels 20 × the rest (queries 5 ×), as LLM keys have: the rotation spreads
    them over all 128 channels (notes/fp8.md, "Session 36": 0.190 → 0.061); on plain N(0, 1)
    inputs it changes nothing that matters (0.0405 / 0.0410)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 512, 8, 128), torch.randn(1, 512, 2, 128), torch.randn(1, 512, 2, 128)
    plain = [x.to(torch.bfloat16) for x in (q, k, v)]
    k[..., :4] *= 20
    q[..., :4] *= 5
    outliers = [x.to(torch.bfloat16) for x in (q, k, v)]
    assert quantisation_error(*outliers, hadamard=True) < quantisation_error(
        *outliers, hadamard=False) / 2
    assert quantisation_error(*plain, hadamard=True) < quantisation_error(
        *plain, hadamard=False) * 1.1


def _evaluate(expr, env):
    """A TIR expression's value in numpy, op by op in float32 / int32 (what the GPU computes,
    but for FFMA's single rounding)."""
    tir = tvm.tirx
    if isinstance(expr, tir.Var):
        return env[expr.name]
    if isinstance(expr, (tir.FloatImm, tir.IntImm)):
        return np.array(expr.value, dtype=np.float32 if expr.dtype == "float32" else np.int32)
    binary = {tir.Add: np.add, tir.Sub: np.subtract, tir.Mul: np.multiply, tir.Max: np.maximum}
    if type(expr) in binary:
        return binary[type(expr)](_evaluate(expr.a, env), _evaluate(expr.b, env))
    if isinstance(expr, tir.Call) and expr.op.name.endswith(".reinterpret"):
        return _evaluate(expr.args[0], env).view(np.int32 if expr.dtype == "int32" else np.float32)
    if isinstance(expr, tir.Call) and expr.op.name.endswith(".shift_left"):
        return np.left_shift(*(_evaluate(a, env) for a in expr.args))
    raise TypeError(f"no evaluator for {type(expr).__name__}: {expr}")


def test_exp2_on_the_fma_pipe_survives_tvms_simplifier():
    """softmax.exp2_fma after TVM's simplifier (which folds (x + M) − M to x when it can: the
    cubic then collapses to its constant) is 2^x within 2e-4 from −126 to 9, and 2^-126 below
    (−inf included: a masked score)."""
    x = tvm.tirx.Var("x", "float32")
    expr = tvm.arith.Analyzer().simplify(softmax.exp2_fma(x))
    xs = np.concatenate([np.linspace(-140.0, 9.0, 100_003), [-np.inf, 0.0, 8.0, -126.0]])
    xs = xs.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        got = _evaluate(expr, {"x": xs})
    want = np.exp2(np.maximum(xs.astype(np.float64), -126.0))
    assert np.abs(got / want - 1).max() < 2e-4


@needs_nvcc
def test_the_fma_exp2_option_moves_a_quarter_of_the_exp2s_off_mufu(tmp_path):
    """``exp2_fma_every=4`` on the RS design: of a block's 112 exp2s a thread (64 × 224 / 128),
    the 28 of every 4th 8-column group run as ``exp2_fma``'s cubic (its c2 an FFMA
    immediate), the rest and the 2 rescale factors on MUFU; no spill."""
    shape = shapes.SHAPES["llama8b-4k"]
    config = fp8.design_config("coop-overlap-rs", shape.causal)
    func = coop.coop_fwd(shape.batch, shape.seq_len, shape.heads, shape.kv_heads,
                         shape.head_dim, shape.head_dim, shape.causal, coop.FP8_DTYPE,
                         shape.head_dim ** -0.5, config,
                         coop_overlap.overlap_mainloop(deferred_sums=False, exp2_fma_every=4))
    emitted = emit.lower_variant("fp8-coop-rs", shape, func, coop.PASS_CONFIGS,
                                 registry.get("fp8-coop-rs").postproc_passes)
    summary = emit.inspect(emitted, tmp_path)
    assert summary.spill_bytes == 0 and summary.gemm_loops, summary.format()
    for loop in summary.gemm_loops:
        assert loop.opcodes["MUFU"] == 2 + 112 * 3 // 4, loop.opcodes
    sass_text = "".join(p.read_text() for p in tmp_path.glob("*.sass"))
    assert re.search(r"FFMA\S* R\d+, R\d+, R\d+(\.reuse)?, 0\.242640", sass_text), "the cubic"
