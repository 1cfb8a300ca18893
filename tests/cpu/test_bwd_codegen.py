"""The pipelined backward (kernels/bwd/pipelined.py) lowers for sm_90a and compiles on a CPU
as its docstring says: all five GEMMs on wgmma (Sᵀ, dPᵀ, dK and dQᵀ from shared memory, dV
with Pᵀ from registers), the producer / consumer register split, no spill."""
import dataclasses
import itertools
import re
import shutil

import pytest
import torch

from ws_lab import emit, shapes
from ws_lab.kernels import DYNAMIC_BATCH
from ws_lab.kernels.bwd import pipelined, prepost, tile_scheduler
from ws_lab.kernels.fwd.barriers import NamedBarrier

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


@needs_nvcc
@pytest.mark.parametrize("head_dim,causal,ragged", [(128, False, False), (64, True, True)])
def test_backward_compiles_to_five_wgmma_gemms_without_spills(tmp_path, head_dim, causal,
                                                              ragged):
    shape = shapes.Shape("bwd-codegen", 2, 8, 2, 1000 if ragged else 1024, head_dim, head_dim,
                         causal, "bfloat16")
    func = pipelined.prim_func_for(shape, pipelined.DEFAULT)  # the whole group (no split)
    emitted = emit.lower_variant("bwd-pipelined", shape, func, pipelined.PASS_CONFIGS)
    summary = emit.inspect(emitted, tmp_path)
    cfg = pipelined.DEFAULT
    k_steps_s = head_dim // 16  # Sᵀ and dPᵀ: K = D
    k_steps_dq = cfg.block_kv // 16  # dQᵀ: K = the K/V rows
    k_steps_dkv = cfg.block_q // 16  # dV and dK: K = the Q rows of a step
    ss = sum(n for kind, n in summary.hgmma.items() if not kind.endswith(".RS"))
    rs = sum(n for kind, n in summary.hgmma.items() if kind.endswith(".RS"))
    assert ss == 2 * k_steps_s + k_steps_dq + k_steps_dkv, summary.hgmma
    assert rs == k_steps_dkv, summary.hgmma
    assert sorted(set(summary.setmaxnreg)) == ["DEALLOC 24", "TRY_ALLOC 240"]
    assert summary.spill_bytes == 0 and summary.stack_frame == 0, summary.format()
    assert emitted.threads == cfg.threads + 128  # the consumers and TileLang's producer
    # Pᵀ's exponent and dSᵀ's difference from the preprocess's lse·log2 e and Δ·scale: an FFMA
    # an element each, Pᵀ ∘ that an FMUL, and one mask, on fp32 Pᵀ (notes/bwd.md, "Session 52")
    (loop,) = summary.gemm_loops
    per_thread = cfg.block_kv * cfg.block_q // cfg.threads
    floats = tuple(loop.opcodes[op] for op in ("FFMA", "FMUL", "FADD", "FSEL"))
    assert floats == (2 * per_thread, per_thread, 0, per_thread if causal or ragged else 0), loop


@needs_nvcc
@pytest.mark.parametrize("head_dim,causal", [(128, False), (64, True)])
def test_deterministic_mode_compiles_to_wgmma_without_spills(tmp_path, head_dim, causal):
    """The deterministic mode's two kernels: the main kernel without dQ (four GEMMs: Sᵀ, dPᵀ,
    dK from shared memory, dV with Pᵀ from registers) and the dQ kernel (S and dP from shared
    memory, dQ with dS from registers), each with the producer / consumer split and no
    spill."""
    shape = shapes.Shape("bwd-det", 2, 8, 2, 1000, head_dim, head_dim, causal, "bfloat16")
    args = (2, 1000, 8, 2, head_dim, causal, "bfloat16", head_dim ** -0.5)
    main, dq_cfg = pipelined.DEFAULT, pipelined.DQ_DEFAULT
    expected = {
        "dkdv": (pipelined.flash_bwd(*args, with_dq=False),
                 2 * (head_dim // 16) + main.block_q // 16, main.block_q // 16),
        "dq": (pipelined.flash_bwd_dq(*args), 2 * (head_dim // 16), dq_cfg.block_kv // 16)}
    for name, (func, want_ss, want_rs) in expected.items():
        summary = emit.inspect(emit.lower_variant("bwd-pipelined", shape, func,
                                                  pipelined.PASS_CONFIGS), tmp_path / name)
        ss = sum(n for kind, n in summary.hgmma.items() if not kind.endswith(".RS"))
        rs = sum(n for kind, n in summary.hgmma.items() if kind.endswith(".RS"))
        assert (ss, rs) == (want_ss, want_rs), (name, summary.hgmma)
        assert sorted(set(summary.setmaxnreg)) == ["DEALLOC 24", "TRY_ALLOC 240"], name
        assert summary.spill_bytes == 0 and summary.stack_frame == 0, summary.format()


@needs_nvcc
@pytest.mark.parametrize("planes", [1, 2])
def test_pre_and_postprocess_compile_and_bound_a_ragged_sequence(tmp_path, planes):
    """Δ·scale, lse·log2 e and the cleared accumulator, and dQ's cast, lower and compile
    without spills at a ragged S (1000 = 15 tiles of 64 and 40 rows): each access of O, dO,
    lse, Δ·scale and lse·log2 e is guarded by the row bound (125 groups of 8 rows), the
    accumulator (rows up to 1024, the next multiple of 128; one plane or a warpgroup's each)
    needs none, and the cast leaves by TMA store (bounded by the tensor map)."""
    shape = shapes.Shape("bwd-prepost", 2, 8, 2, 1000, 128, 128, False, "bfloat16")
    pre, pre_delta, post = (emit.lower_variant("bwd-pipelined", shape, f, None) for f in (
        prepost.preprocess(2, 1000, 8, 128, "bfloat16", 0.088, planes=planes),
        prepost.preprocess(2, 1000, 8, 128, "bfloat16", 0.088, clear_dq=False),
        prepost.postprocess(2, 1000, 8, 128, "bfloat16", planes)))
    assert "dQ" in pre.source and "dQ" not in pre_delta.source
    bounds = [e.source.count("< 125") for e in (pre, pre_delta, post)]
    assert bounds == [5, 5, 0], bounds
    assert prepost.dq_accum_shape(2, 1000, 8, 128, planes) == (2, 8, planes, 1024,
                                                               128 // planes + prepost.DQ_PAD)
    with pytest.raises(ValueError, match="planes must split head_dim 64"):
        prepost.dq_accum_shape(2, 1000, 8, 64, 32)
    for name, emitted in (("pre", pre), ("post", post)):
        summary = emit.inspect(emitted, tmp_path / name)
        assert summary.spill_bytes == 0 and summary.stack_frame == 0, summary.format()
    assert "UTMASTG" in emit.inspect(post, tmp_path / "post2").format()


@needs_nvcc
def test_split_heads_clear_and_cast_dk_dv_beside_dq(tmp_path):
    """Split heads (the Qwen row: 14 / 2 heads, D 64, S 456, a dynamic batch): the preprocess
    also zeroes dK's and dV's fp32 accumulators in the CTAs of the first 2 heads, and the
    postprocess casts them in the same launch, 14 + 2 · 2 heads of grid, each by TMA store:
    two launches for what were five (notes/bwd.md "Session 61"). Both compile without spills."""
    shape = shapes.Shape("bwd-prepost", 1, 14, 2, 456, 64, 64, True, "bfloat16")
    pre, post = (emit.lower_variant("bwd-pipelined", shape, f, None) for f in (
        prepost.preprocess(DYNAMIC_BATCH, 456, 14, 64, "bfloat16", 0.125, clear_kv_heads=2),
        prepost.postprocess(DYNAMIC_BATCH, 456, 14, 64, "bfloat16", kv_heads=2)))
    clear = pre.source[pre.source.index("if (((int)blockIdx.y) < 2)"):]
    assert clear.count("*(float4*)(KVaccum + ") == 1 and "for (int grad = 0; grad < 2;" in clear
    assert [post.source.count(f"tl::tma_store({t}_desc") for t in ("dQ", "dK", "dV")] == [1, 1, 1]
    assert "if (((int)blockIdx.y) < 14)" in post.source
    assert prepost.kv_accum_shape(8, 456, 2, 64) == (2, 8, 2, 1, 512, 64 + prepost.DQ_PAD)
    for name, emitted in (("pre", pre), ("post", post)):
        summary = emit.inspect(emitted, tmp_path / name)
        assert summary.spill_bytes == 0 and summary.stack_frame == 0, summary.format()
    with pytest.raises(ValueError, match="clear_kv_heads clears beside clear_dq"):
        prepost.preprocess(8, 456, 14, 64, "bfloat16", 0.125, clear_dq=False, clear_kv_heads=2)
    with pytest.raises(ValueError, match="kv_heads casts beside a single padded"):
        prepost.postprocess(8, 456, 14, 64, "bfloat16", 1, paired=True, kv_heads=2)


def test_backward_refuses_bad_side_inputs():
    q = torch.zeros(1, 8, 2, 64, dtype=torch.float16)
    k = v = torch.zeros(1, 8, 1, 64, dtype=torch.float16)
    lse = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="dout must be a torch.float16 tensor of q's shape"):
        pipelined.attention_bwd(q, k, v, q, q[:, :4], lse)
    with pytest.raises(ValueError, match="lse must be a float32 tensor of shape"):
        pipelined.attention_bwd(q, k, v, q, q, lse.double())
    with pytest.raises(ValueError, match="dk must be contiguous"):
        pipelined.attention_bwd(q, k, v, q, q, lse, dk=torch.zeros(1, 8, 1, 128).half()[..., ::2])
    with pytest.raises(ValueError, match="inputs must be CUDA tensors"):
        pipelined.attention_bwd(q, k, v, q, q, lse)


def test_forward_with_lse_stores_each_row_once_and_the_default_is_unchanged():
    """The pipelined forward's lse output (what the backward reads): one store per row, only
    rows inside S on a ragged shape; without it the kernel has no lse parameter at all."""
    from ws_lab.kernels.fwd import pipelined as fwd

    cfg = fwd.config_for(128, 128, True)
    args = (2, 1000, 8, 2, 128, 128, True, "bfloat16", 128 ** -0.5, cfg)
    with_lse = emit.lower_prim_func(fwd.flash_fwd(*args, with_lse=True)).kernel_source
    plain = emit.lower_prim_func(fwd.flash_fwd(*args)).kernel_source
    assert "LSE" not in plain and with_lse.count("LSE[") == 1
    store = with_lse[with_lse.index("LSE[") - 400:with_lse.index("LSE[")]
    assert "% 4) == 0" in store and "< " in store  # a row's quad writes once; a bound on S


def test_the_registry_names_the_backward_and_keeps_kinds_apart():
    from ws_lab import registry

    kernel = registry.get("bwd-pipelined")
    assert kernel.kind == "bwd" and kernel.backward.func is pipelined.attention_bwd
    assert kernel.supports(shapes.SHAPES["train8b-4k"])
    assert not kernel.supports(shapes.SHAPES["largehdv-2k"])
    with pytest.raises(TypeError, match="bwd-pipelined is a bwd kernel"):
        kernel.attention
    with pytest.raises(TypeError, match="pipelined is a fwd kernel"):
        registry.get("pipelined").backward


def test_every_backward_kernel_has_a_buffer_per_parameter():
    """The backward's kernels give each parameter its own buffer, and a kernel whose parameters
    share one T.Tensor annotation (TileLang binds them to one buffer: the all-NaN dQ of
    notes/bwd.md, "Session 35") is refused before lowering."""
    from ws_lab.target import require_distinct_buffers
    from ws_lab.upstream import shared_annotation_aliases_params as pin

    args = (2, 1000, 8, 2, 128, True, "bfloat16", 0.088)
    for func in (pipelined.flash_bwd(*args), pipelined.flash_bwd(*args, with_dq=False),
                 pipelined.flash_bwd_dq(*args),
                 prepost.preprocess(2, 1000, 8, 128, "bfloat16", 0.088),
                 prepost.preprocess(2, 1000, 8, 128, "bfloat16", 0.088, clear_dq=False),
                 prepost.postprocess(2, 1000, 8, 128, "bfloat16")):
        require_distinct_buffers(func)
        assert len({b.name for b in func.buffer_map.values()}) == len(func.params)
    with pytest.raises(ValueError, match="parameters A and B of add are one buffer"):
        require_distinct_buffers(pin.kernel())


@needs_nvcc
@pytest.mark.parametrize("dq_planes", [1, 2])
def test_dq_leaves_by_one_bulk_reduce_add_a_step(tmp_path, dq_planes):
    """dQ goes out of a step as one bulk reduce-add (UBLKRED) of the staged tile (a plane) from
    one thread (of each warpgroup), not as atomics, staged while dK's GEMM runs: no REDG/ATOMG
    in the kernel, Pᵀ's exp2 without the subnormal fix-up (fast math), and the staging tile's
    wait (``cp.async.bulk.wait_group.read``) comes a step later, before the tile is rewritten,
    and once after the loop. The kernel's named barriers are the ones its docstring lists."""
    import dataclasses

    shape = shapes.Shape("bwd-dq", 2, 8, 2, 1000, 128, 128, True, "bfloat16")
    cfg = dataclasses.replace(pipelined.DEFAULT, dq_planes=dq_planes)
    func = pipelined.flash_bwd(2, 1000, 8, 2, 128, True, "bfloat16", 128 ** -0.5, cfg)
    emitted = emit.lower_variant("bwd-pipelined", shape, func, pipelined.PASS_CONFIGS)
    summary = emit.inspect(emitted, tmp_path)
    assert summary.spill_bytes == 0, summary.format()
    sass_text = next(tmp_path.glob("*.sass")).read_text()
    assert re.findall(r"\b(UBLKRED\S*)", sass_text) == ["UBLKRED.G.S.ADD.F32.RN"]
    # dQ first, then dK: the staging stores and the reduce-add sit between the wait for dQ
    # (DEPBAR.LE 1) and the wait for dK (DEPBAR.LE 0), so they run under dK's GEMM
    under_dk = re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1 ;(.*?)WARPGROUP\.DEPBAR\.LE gsb0, 0x0 ;",
                         sass_text, re.S)
    assert under_dk and "UBLKRED" in under_dk.group(1), "dQ is not staged under dK"
    assert len(re.findall(r"\bSTS\.", under_dk.group(1))) >= 8
    # fast math: Pᵀ's exp2 is a bare MUFU.EX2, without the subnormal fix-up's compare to -126
    assert "MUFU.EX2" in sass_text and not re.search(r"FSETP\.\S+ \S+, \S+, \S+, -126", sass_text)
    assert not re.search(r"\b(REDG|ATOMG|RED)\.", sass_text)
    source = emitted.source
    reduce_at = source.index("tl::tma_store_add(")
    waits = [m.start() for m in re.finditer(r"tma_store_wait<0, true>", source)]
    assert len([w for w in waits if w < reduce_at]) >= 1  # the step's wait, before staging
    # the named barriers: TileLang's consumer syncs (id 3, the 256 consumer threads) and the
    # dQ staging's, twice in the step and once after the loop: at 1 plane BWD_DQ_WG1 over the
    # 256; at 2 a warpgroup's 128 threads on BWD_DQ_WG1 / WG2 (consumer threads 128-383:
    # threadIdx.x >> 7 is 1 or 2)
    named = re.findall(r"BAR\.SYNC\.DEFER_BLOCKING (0x[0-9a-f]+), (0x[0-9a-f]+)", sass_text)
    stage_syncs = [i for i, _ in named if int(i, 16) == NamedBarrier.BWD_DQ_WG1]
    if dq_planes == 1:
        ids = {int(i, 16): int(n, 16) for i, n in named}
        assert ids == {3: 256, int(NamedBarrier.BWD_DQ_WG1): 256} and len(stage_syncs) == 3, named
        return
    assert {int(i, 16): int(n, 16) for i, n in named} == {3: 256}, named
    assert len(re.findall(r"BAR\.SYNC\.DEFER_BLOCKING R\d+, 0x80 ;", sass_text)) == 3
    base = int(NamedBarrier.BWD_DQ_WG1) - 1
    assert NamedBarrier.BWD_DQ_WG2 == NamedBarrier.BWD_DQ_WG1 + 1
    wg_sync = f"__sync_thread_partial(((((int)threadIdx.x) >> 7) + {base}), 128)"
    assert source.count(wg_sync) == 3, wg_sync


@needs_nvcc
@pytest.mark.parametrize("head_dim", [64, 128])
def test_each_warpgroup_stages_only_its_own_dq_plane(head_dim):
    """dQ's staging stores, evaluated for every consumer thread and register pair: a thread of
    warpgroup w writes only plane w of the staging tile, the plane its own bulk reduce-add
    reads, and the two warpgroups together write every column of every row once."""
    import dataclasses

    cfg = dataclasses.replace(pipelined.DEFAULT, dq_planes=2)
    func = pipelined.flash_bwd(2, 1000, 8, 2, head_dim, True, "bfloat16", head_dim ** -0.5, cfg)
    source = emit.lower_prim_func(func, pipelined.PASS_CONFIGS).kernel_source
    store = re.search(r"for \(int (i_\d+) = 0; \1 < (\d+); \+\+\1\) \{\s*\*\(float2\*\)"
                      r"\(\(\(float\*\)dq_s\) \+ (.*?)\) = \*\(float2\*\)\(dq_frag", source, re.S)
    assert store, "no float2 staging store of dq_frag"
    var, pairs, index = store.group(1), int(store.group(2)), store.group(3).replace("(int)", "")
    width = head_dim // cfg.dq_planes + prepost.DQ_PAD
    plane_size = cfg.block_q * width
    written = []
    for thread in range(128, 128 + cfg.threads):  # the consumers follow the producer's 128
        for pair in range(pairs):
            offset = eval(index, {"threadIdx": type("T", (), {"x": thread}), var: pair})
            assert offset // plane_size == (thread - 128) // 128, (thread, pair, offset)
            written += [offset, offset + 1]
    rows = [(o // plane_size, o % plane_size // width, o % width) for o in written]
    assert sorted(rows) == sorted((p, j, c) for p in range(cfg.dq_planes)
                                  for j in range(cfg.block_q) for c in range(width - prepost.DQ_PAD))


@pytest.mark.parametrize("causal", [True, False])
def test_every_kv_tile_runs_once_and_causal_launches_the_longest_first(causal):
    """The main kernel's grid covers each (K/V tile, KV head, batch) once; under the causal
    mask, blocks launching x-fastest put every head's K/V tile 0 (the longest walk) ahead of
    any tile 1."""
    n_kvtiles, kv_heads, batch = 5, 3, 2
    gx_n, gy_n = tile_scheduler.kv_grid(n_kvtiles, kv_heads, batch, causal)
    launched = [tile_scheduler.kv_tile(gx, gy, n_kvtiles, kv_heads, causal)
                for gy in range(gy_n) for gx in range(gx_n)]
    assert sorted(launched) == sorted(itertools.product(range(n_kvtiles), range(kv_heads),
                                                        range(batch)))
    tiles = [tile for tile, _, _ in launched]
    assert (tiles == sorted(tiles)) == causal


@pytest.mark.parametrize("heads_inner", [False, True])
def test_every_walk_visits_each_head_and_q_tile_once(heads_inner):
    """A CTA's walk covers its group's heads × its Q tiles once each; heads inner, the Q tiles
    run from the last down, the group's heads together on each."""
    group, n_qtiles, first, first_head = 4, 9, 3, 8
    steps = n_qtiles - first
    walk = [tile_scheduler.q_walk(it, steps, first, first_head, group, n_qtiles, heads_inner)
            for it in range(group * steps)]
    assert sorted(walk) == sorted(itertools.product(range(8, 12), range(first, n_qtiles)))
    tiles = [qt for _, qt in walk]
    assert (tiles == sorted(tiles, reverse=True)) == heads_inner


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_split_groups_walk_every_head_of_every_kv_head_once(splits):
    """With ``Config.head_splits`` the grid's (KV head, split) slots and each slot's walk
    (``slot_heads``, then its group / splits heads) cover every (query head, K/V tile, batch)
    once, each query head under its own KV head."""
    n_kvtiles, kv_heads, batch, group = 3, 2, 2, 4
    slots, walk_heads = kv_heads * splits, group // splits
    gx_n, gy_n = tile_scheduler.kv_grid(n_kvtiles, slots, batch, True)
    seen = []
    for gy, gx in itertools.product(range(gy_n), range(gx_n)):
        tile, slot, b = tile_scheduler.kv_tile(gx, gy, n_kvtiles, slots, True)
        kvh, first_head = tile_scheduler.slot_heads(slot, splits, group)
        for it in range(walk_heads):
            h, _ = tile_scheduler.q_walk(it, 1, 0, first_head, walk_heads, 1, False)
            assert h // group == kvh
            seen.append((h, tile, b))
    assert sorted(seen) == sorted(itertools.product(range(kv_heads * group), range(n_kvtiles),
                                                    range(batch)))


def test_head_splits_fill_the_sms_only_where_the_group_whole_cannot():
    """The rule splits Qwen2.5-0.5B's training shape (64 CTAs of 56 steps on 132 SMs) by its
    whole group of 7, and leaves the LLaMA-8B rows whole; a split always divides the group."""
    from ws_lab.kernels.bwd import heuristics

    def splits(batch, seq_len, kv_heads, group, causal):
        return heuristics.head_splits(batch, seq_len, kv_heads, group, causal, 128, 64, 132)

    assert splits(8, 456, 2, 7, True) == 7
    assert splits(1, 4096, 8, 4, True) == splits(2, 8192, 8, 4, False) == 1
    # 64 CTAs of 64 steps, 4096 in all: 31 a SM; split in 2 the longest is still 32
    assert splits(1, 1024, 8, 4, False) == 4
    for batch, group in itertools.product((1, 3, 64), (1, 4, 6, 7, 8)):
        assert group % splits(batch, 300, 2, group, True) == 0
    longest, total = heuristics.main_kernel_steps(456, 7, True, 128, 64, 1)
    assert (longest, total) == (7 * 8, 7 * (8 + 6 + 4 + 2))


@needs_nvcc
def test_split_heads_add_dk_and_dv_by_one_reduce_add_each(tmp_path):
    """With head splits the main kernel adds dK then dV into their fp32 accumulators by one
    bulk reduce-add each (the whole (block_kv, D + pad) tile: a contiguous run of the
    accumulator), and keeps every GEMM on wgmma with no spill (the grid and walk: the test
    above). The Qwen-like shape's plan: 128 Q rows a step at D 64, the group split 7 ways."""
    shape = shapes.Shape("bwd-split", 3, 14, 2, 456, 64, 64, True, "bfloat16")
    cfg = pipelined.planned_config(3, 456, 14, 2, 64, True, 132)
    assert (cfg.block_q, cfg.head_splits) == (128, 7)
    func = pipelined.flash_bwd(3, 456, 14, 2, 64, True, "bfloat16", 0.125, cfg)
    emitted = emit.lower_variant("bwd-pipelined", shape, func, pipelined.PASS_CONFIGS)
    src = emitted.postprocessed
    run = cfg.block_kv * (64 + prepost.DQ_PAD) * 4
    for name in ("dK", "dV"):
        adds = re.findall(r"tma_store_add\(\(&\(\(\(float\*\)dkv_s\)\[0\]\)\), "
                          rf"\(&\({name}\[.*?\]\)\), (\d+)\)", src)
        assert adds == [str(run)], (name, adds)
        assert len(re.findall(rf"\b{name}\[", src)) == 1, name  # nothing else writes it
    summary = emit.inspect(emitted, tmp_path)
    assert summary.spill_bytes == 0 and summary.stack_frame == 0, summary.format()
    assert sum(summary.hgmma.values()) == 32, summary.hgmma  # the 5 GEMMs at D 64, bn 128


def test_split_heads_are_refused_in_the_deterministic_mode():
    """Split heads add dK and dV in no fixed order: the deterministic mode refuses them before
    any launch."""
    q = torch.zeros(1, 8, 4, 64, dtype=torch.bfloat16)
    k = v = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 4, 8)
    with pytest.raises(ValueError, match="deterministic"):
        pipelined.attention_bwd(q, k, v, q, q, lse, True, deterministic=True,
                                config=dataclasses.replace(pipelined.DEFAULT, head_splits=2))


def _op_kernels(batch):
    """The training op's kernels (kernels/bwd/attention_op.py) at ``batch``, S 1000, causal."""
    from ws_lab.kernels.fwd import pipelined as fwd

    args = (batch, 1000, 8, 2, 64, True, "bfloat16", 0.125)
    rows = (batch, 1000, 8, 64, "bfloat16")
    return {
        "fwd": (fwd.flash_fwd(*args[:5], 64, *args[5:], fwd.config_for(64, 64, True),
                              with_lse=True), None),
        "pre": (prepost.preprocess(*rows, 0.125, planes=pipelined.DEFAULT.dq_planes), None),
        "pre_delta": (prepost.preprocess(*rows, 0.125, clear_dq=False), None),
        "main": (pipelined.flash_bwd(*args), pipelined.PASS_CONFIGS),
        "main_split": (pipelined.flash_bwd(*args, pipelined.planned_config(1, 1000, 8, 2, 64,
                                                                           True, 132)),
                       pipelined.PASS_CONFIGS),
        "post_kv": (prepost.postprocess(batch, 1000, 2, 64, "bfloat16", 1), None),
        "main_no_dq": (pipelined.flash_bwd(*args, with_dq=False), pipelined.PASS_CONFIGS),
        "dq": (pipelined.flash_bwd_dq(*args), pipelined.PASS_CONFIGS),
        "post": (prepost.postprocess(*rows, pipelined.DEFAULT.dq_planes), None)}


@needs_nvcc
def test_the_training_ops_kernels_take_the_batch_at_launch(tmp_path):
    """With ``DYNAMIC_BATCH`` each of the op's kernels has an ``int batch`` parameter and
    otherwise the static kernel's lines, but for 64-bit indices where B multiplies a stride (no
    new bound, loop or barrier); the main backward compiles to the static one's GEMMs and
    registers, without spills."""
    from ws_lab.kernels import DYNAMIC_BATCH

    static, dynamic = _op_kernels(3), _op_kernels(DYNAMIC_BATCH)
    lowered = {}
    for name, (func, configs) in dynamic.items():
        got = emit.lower_prim_func(func, configs).kernel_source
        want = emit.lower_prim_func(static[name][0], configs).kernel_source
        assert "int batch)" in got and "int batch" not in want, name
        got_lines, want_lines = got.splitlines(), want.splitlines()
        assert len(got_lines) == len(want_lines), name
        changed = [g for g, w in zip(got_lines, want_lines) if g != w]
        assert all("int batch)" in g or "int64_t" in g for g in changed), (name, changed[:3])
        lowered[name] = changed
    assert lowered["main"] and lowered["fwd"]  # dQ's reduce-add and lse's store index by B
    shape = shapes.Shape("bwd-dyn", 3, 8, 2, 1000, 64, 64, True, "bfloat16")
    summaries = [emit.inspect(emit.lower_variant("bwd-pipelined", shape, kernels["main"][0],
                                                 pipelined.PASS_CONFIGS), tmp_path / tag)
                 for tag, kernels in (("static", static), ("dynamic", dynamic))]
    assert summaries[0].hgmma == summaries[1].hgmma
    assert summaries[0].registers == summaries[1].registers
    assert summaries[1].spill_bytes == 0 and summaries[1].stack_frame == 0


@pytest.mark.parametrize("seq_len", [1000, 127])
def test_the_rows_past_s_reach_shared_memory_as_zeros(seq_len):
    """The main kernel masks Pᵀ only: dSᵀ = Pᵀ ∘ (dPᵀ·scale − Δ·scale) is 0 where Pᵀ is only
    if, past S, V and dO arrive as zeros (TMA tile loads: the tensor map fills past its bound
    with zeros) and lse·log2 e and Δ·scale do too: TMA tile loads where S rows are 16-byte
    aligned (1000), else guarded loads whose other branch stores 0 (127)."""
    func = pipelined.flash_bwd(2, seq_len, 8, 2, 64, True, "bfloat16", 0.125)
    source = emit.lower_prim_func(func, pipelined.PASS_CONFIGS).kernel_source
    assert "tma_load(V_desc" in source and "tma_load(dO_desc" in source
    for rows in ("LSElog2", "DeltaScaled"):
        guarded = re.findall(rf"(condval\w*) = {rows}\[.*\n\s*\}} else \{{\n\s*\1 = 0x0p\+0f",
                             source)
        assert (f"tma_load({rows}_desc" in source, len(guarded)) == (
            (True, 0) if seq_len % 4 == 0 else (False, 1)), rows


@needs_nvcc
def test_the_pipelined_pdl_option_waits_before_any_load(tmp_path):
    """The Qwen-like plan (``pdl`` on): every thread lets the postprocess launch, then waits
    for the preprocess, before the first TMA load; the kernel is marked for a programmatic
    launch and spills nothing. With ``pdl=False`` the kernel holds no PDL call."""
    on_cfg = pipelined.planned_config(8, 456, 14, 2, 64, True, 132)
    assert on_cfg.pdl
    plan = dataclasses.replace(on_cfg, pdl=False)
    shape = shapes.Shape("bwd-pdl", 8, 14, 2, 456, 64, 64, True, "bfloat16")
    args = (8, 456, 14, 2, 64, True, "bfloat16", 0.125)
    on_art = emit.lower_prim_func(pipelined.flash_bwd(*args, on_cfg), pipelined.PASS_CONFIGS)
    src = on_art.kernel_source
    trigger = src.index("cudaTriggerProgrammaticLaunchCompletion()")
    wait = src.index("cudaGridDependencySynchronize()")
    assert trigger < wait < src.index("tl::tma_load(")
    assert src.count("cudaGridDependencySynchronize()") == 1
    assert "has_cuda_pdl_sync" in str(on_art.device_mod)
    emitted = emit.lower_variant("bwd-pipelined", shape, pipelined.flash_bwd(*args, on_cfg),
                                 pipelined.PASS_CONFIGS)
    assert emit.inspect(emitted, tmp_path).spill_bytes == 0
    off = emit.lower_prim_func(pipelined.flash_bwd(*args, plan), pipelined.PASS_CONFIGS)
    assert "Programmatic" not in off.kernel_source and "GridDependency" not in off.kernel_source


@pytest.mark.parametrize("head_dim,block_q", [(64, 128), (64, 64), (128, 64)])
def test_a_one_step_walk_keeps_ds_apart_from_dq_staging(head_dim, block_q):
    """Where a CTA's walk is one step (S 127, the group split 4 ways) TileLang drops the loop
    and its shared-memory reuse goes by program order: dQ's staging tile, written while the dK
    GEMM still reads dSᵀ, must not take dSᵀ's bytes (it did at block_q 128: dK wrong, H100,
    notes/bwd.md "Session 64")."""
    cfg = dataclasses.replace(pipelined.DEFAULT, block_q=block_q, head_splits=4)
    func = pipelined.flash_bwd(1, 127, 4, 1, head_dim, False, "bfloat16", head_dim ** -0.5, cfg)
    source = emit.lower_prim_func(func, pipelined.PASS_CONFIGS).kernel_source
    at = {name: int(offset) for name, offset in
          re.findall(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\)", source)}
    ds = (at["ds_s"], at["ds_s"] + cfg.block_kv * block_q * 2)
    dq = (at["dq_s"], at["dq_s"] + block_q * (head_dim + prepost.DQ_PAD) * 4)
    assert ds[1] <= dq[0] or dq[1] <= ds[0], (ds, dq)
