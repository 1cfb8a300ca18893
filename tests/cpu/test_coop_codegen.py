"""Coop lowers and compiles for every head dim; its SASS and emitted CUDA match the roles,
register budgets and barriers that kernels/fwd/coop.py's docstring states."""
import re
import shutil

import pytest

from ws_lab.kernels.fwd import coop, tile_scheduler
from ws_lab import emit, sass, shapes

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


def shape_for(head_dim, causal=True):
    return shapes.Shape("codegen", 1, 8, 2, 1000, head_dim, head_dim, causal)


@needs_nvcc
@pytest.mark.parametrize("kernel", ["coop", "coop-nopp"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_coop_compiles_warp_specialized(tmp_path, kernel, head_dim):
    emitted = emit.lower(kernel, shape_for(head_dim))
    summary = emit.inspect(emitted, tmp_path)
    assert any(s.endswith(".RS") for s in summary.hgmma), "PV must take P from registers"
    assert any(not s.endswith(".RS") for s in summary.hgmma), "QK must be SS"
    assert sorted(set(summary.setmaxnreg)) == ["DEALLOC 24", "TRY_ALLOC 240"]
    assert summary.dyn_smem <= 227 * 1024
    # Two wgmma groups per consumer warpgroup (QK, PV), each retired by its own wait: one
    # ARRIVE per group means ptxas did not serialize the HGMMAs (remark C7515).
    assert summary.warpgroup_sync.count("ARRIVE") == 4
    assert not [r for r in summary.ptxas_remarks if "C7515" in r or "C7508" in r]
    if head_dim == 128:
        assert summary.spill_bytes == 0 and summary.stack_frame == 0


@needs_nvcc
@pytest.mark.parametrize("kernel,head_dim", [
    (k, d) for k in ("coop-overlap", "coop-overlap-nopp") for d in (64, 128, 256)] + [
    ("coop-overlap-persistent", d) for d in (64, 128)])
def test_overlap_exists_in_the_machine_code(tmp_path, kernel, head_dim):
    """In each mainloop iteration the QK HGMMA group is issued before the WARPGROUP.DEPBAR that
    retires the previous PV group (DEPBAR.LE 1 after an SS + RS window); coop fails the check."""
    overlap = emit.inspect(emit.lower(kernel, shape_for(head_dim)), tmp_path / "overlap")
    serial = emit.inspect(emit.lower(kernel.replace("-overlap", "").replace("-persistent", ""),
                                     shape_for(head_dim)),
                          tmp_path / "serial")
    assert sass.overlaps_gemm_and_softmax(overlap)
    assert not sass.overlaps_gemm_and_softmax(serial)
    # per consumer WG: peeled QK, a QK+PV pair per KV loop (causal: unmasked part + masked
    # tail), the drained PV (persistent: the last PV + the next tile's QK, a pair) — never one
    # ARRIVE per HGMMA
    drained = 2 if "persistent" in kernel else 1
    assert overlap.warpgroup_sync.count("ARRIVE") == 2 * (1 + 2 * 2 + drained)
    assert not [r for r in overlap.ptxas_remarks if "C7515" in r]
    assert overlap.spill_bytes == 0 and sorted(set(overlap.setmaxnreg)) == ["DEALLOC 24", "TRY_ALLOC 240"]


def test_ex2_between_waits_counts_the_softmax_under_the_pv_wait():
    """The SASS parser's measure of how much softmax sits between wait<1> and wait<0>."""
    waits = ["WARPGROUP.DEPBAR.LE gsb0, 0x1", "MUFU.EX2 R1, R2", "@!P0 MUFU.EX2 R3, R4",
             "WARPGROUP.DEPBAR.LE gsb0, 0x0", "MUFU.EX2 R5, R6", "WARPGROUP.DEPBAR.LE gsb0, 0x0"]
    text = "\n".join(f"        /*{16 * i:04x}*/   {ins} ;" for i, ins in enumerate(waits))
    assert sass.summarize_sass(text).ex2_between_waits == [2]


def test_gemm_loops_are_the_innermost_wgmma_loops():
    """The SASS parser's steady loops: a predicated backward branch closes a loop; the outer
    loop and a loop without wgmma are left out, and so is the unpredicated jump back from an
    out-of-line mbarrier retry block."""
    lines = ["MOV R1, R2",                                            # 0x00 outer loop
             "HGMMA.64x128x16.F32 R24, gdesc[UR4], R24",              # 0x10 inner loop
             "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R1+UR4], R2",       # 0x20
             "@!P0 BRA 0xc0",                                         # 0x30 to the retry block
             "FFMA.FTZ R3, R3, R4, R5",                               # 0x40
             "@P1 BRA 0x10",                                          # 0x50 inner back edge
             "FADD.FTZ R6, R6, R7",                                   # 0x60 a loop, no wgmma
             "@P2 BRA 0x60",                                          # 0x70
             "@P3 BRA 0x0",                                           # 0x80 outer back edge
             "EXIT", "NOP", "NOP",                                    # 0x90-0xb0
             "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R1+UR4], R2",       # 0xc0 the retry block
             "BRA 0x20"]                                              # 0xd0
    text = "\n".join(f"        /*{16 * i:04x}*/   {ins} ;" for i, ins in enumerate(lines))
    (loop,) = sass.gemm_loops(text)
    assert (loop.start, loop.end, loop.instructions) == (0x10, 0x50, 5)
    assert loop.opcodes == {"HGMMA": 1, "SYNCS": 1, "BRA": 2, "FFMA": 1}
    assert str(loop).startswith("GEMM loop 0x10-0x50: 5 instructions, 1 wgmma;")


@needs_nvcc
def test_ptxas_sinks_the_softmax_below_the_pv_wait(tmp_path):
    """ptxas (CUDA 13.0) puts each overlap iteration's PV wait (DEPBAR.LE 0) right after the QK
    wait, above all 64 exp2 of the block, though the source computes them first: the softmax
    runs after PV retires — without the wait anchor (``anchor_probs``, on by default: its
    4-value store keeps the row max and those exp2s above the wait, 2–4 % faster on the H100,
    notes/coop_overlap.md, Session 6; storing all 8 row sums was 3–5 % slower, Session 5). When this fails,
    ptxas changed the schedule: re-measure the anchor."""
    from ws_lab.kernels.fwd import coop_overlap

    shape = shapes.get("llama8b-4k")
    summary = emit.inspect(emit.lower_variant(
        "coop-overlap-unanchored", shape, coop_overlap.prim_func_for(shape, anchor_probs=False),
        coop.PASS_CONFIGS), tmp_path)
    # per consumer warpgroup two KV loops (unmasked part, masked tail)
    assert summary.ex2_between_waits == [0, 0, 0, 0]


def test_issue_turns_reads_each_turn_between_its_barriers():
    """The SASS parser's view of a pingpong issue turn (BAR.SYNC 1/2 … BAR.ARV)."""
    poll = "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R1+UR4], R2"
    qk = "HGMMA.64x128x16.F32 R88, gdesc[UR12], R88"
    lines = [poll, "BAR.SYNC.DEFER_BLOCKING 0x2, 0x100", qk, qk, poll, "FMUL.FTZ R4, R4, R5",
             "HGMMA.64x128x16.F32 R24, R176, gdesc[UR16].tnspB, R24", "BAR.ARV 0x1, 0x100",
             "BAR.SYNC.DEFER_BLOCKING 0x3, 0x80",  # an epilogue barrier: not a turn
             "BAR.SYNC.DEFER_BLOCKING 0x1, 0x100", qk, "BAR.ARV 0x2, 0x100"]
    text = "\n".join(f"        /*{16 * i:04x}*/   {ins} ;" for i, ins in enumerate(lines))
    assert sass.issue_turns(text) == [sass.IssueTurn(True, ("SS", "POLL", "MATH", "RS")),
                                      sass.IssueTurn(False, ("SS",))]


@needs_nvcc
@pytest.mark.parametrize("kernel", ["coop-overlap", "coop-overlap-persistent"])
def test_issue_turn_holds_the_v_poll_and_nothing_else(tmp_path, kernel):
    """Each KV step's issue turn is: QK HGMMAs → the V_{n-1} poll → PV HGMMAs, with the K_n poll
    before the turn. The schedule measured best on the H100 (notes/coop_overlap.md, Session
    7): both polls before the turn were 3–7 % slower, the K poll inside it 0–7 %, O's rescale
    inside it 0–5 %. When this fails, the turn changed: re-measure before keeping it."""
    turns = emit.inspect(emit.lower(kernel, shapes.get("llama8b-4k")), tmp_path).issue_turns
    steps = [t for t in turns if t.events[0] == "SS" and "RS" in t.events]
    assert len(steps) == 4  # per consumer warpgroup: the unmasked loop and the masked tail
    assert all(t.events == ("SS", "POLL", "RS") and t.polled_before for t in steps), steps


@pytest.mark.parametrize("pingpong", [True, False])
def test_roles_and_barriers_match_the_docstring(pingpong):
    kernel = "coop" if pingpong else "coop-nopp"
    src = emit.lower(kernel, shape_for(128)).source
    assert "__launch_bounds__(384, 1)" in src
    assert "if (256 <= ((int)threadIdx.x))" in src or "((int)threadIdx.x) >= 256" in src
    assert "((int)threadIdx.x) < 288" in src  # one producer warp issues the TMA loads
    assert "((int)threadIdx.x) < 128" in src  # consumer WG1 vs WG2
    assert src.count("warpgroup_reg_dealloc<24>") == 1 and src.count("warpgroup_reg_alloc<240>") == 2
    stages = coop.CONFIGS[128].num_stages
    inits = re.findall(r"\b(\w+)\[\d+\]\.init\((\d+)\)", src)
    assert sorted(n for _, n in inits) == sorted(["32"] * (1 + 2 * stages) + ["256"] * (2 * stages))
    named = {int(i) for i in re.findall(r"__(?:named_barrier_arrive|sync_thread_partial)\((\d+),", src)}
    expected = {coop.NamedBarrier.EPILOGUE_WG1, coop.NamedBarrier.EPILOGUE_WG2}
    if pingpong:
        expected |= {coop.NamedBarrier.WARP_SCHEDULER_WG1, coop.NamedBarrier.WARP_SCHEDULER_WG2}
    assert named == {int(b) for b in expected}
    assert "__syncthreads();" in src and src.count("__syncthreads();") == 1  # barrier init only


def test_persistent_roles_and_barriers():
    """Persistent coop: one CTA per SM of the H100 (132) walking tiles in zigzag rounds; Q
    double-buffered behind q_full[2] (32) / q_empty[2] (256: both consumers, after their O store
    has read the slot)."""
    from ws_lab.kernels.fwd import coop_overlap

    many_tiles = shapes.Shape("codegen", 2, 32, 8, 4096, 128, 128, True)  # 2048 tiles > 132
    func = coop_overlap.prim_func_for(many_tiles, persistent=True, cluster=1)
    src = emit.lower_prim_func(func, coop.PASS_CONFIGS).kernel_source
    assert "__launch_bounds__(384, 1)" in src
    # 2048 tiles = 15 zigzag rounds + 68: round 15 runs backwards, so CTAs 64..131 take 16
    assert "for (int i = 0; i < (((int)(63 < ((int)blockIdx.x))) + 15); ++i)" in src
    assert "(131 - ((int)blockIdx.x))" in src  # odd rounds walk the CTAs backwards
    inits = re.findall(r"\b(\w+)\[\d+\]\.init\((\d+)\)", src)
    assert sorted(n for name, n in inits if name.startswith("q_")) == ["256", "256", "32", "32"]
    assert len(re.findall(r"q_empty\[\(i & 1\)\]\.wait\(", src)) == 1  # producer, per tile
    assert len(re.findall(r"q_empty\[\(\w+ & 1\)\]\.arrive\(\)", src)) == 2  # each consumer
    assert src.count("tma_store_wait<0, true>") == 2
    assert src.count("warpgroup_reg_dealloc<24>") == 1 and src.count("warpgroup_reg_alloc<240>") == 2


@pytest.mark.parametrize("causal,seq_len", [(True, 4096), (False, 4096), (False, 1000)])
def test_overlap_splits_the_kv_loop_at_the_first_masked_block(causal, seq_len):
    """Causal: an unmasked KV loop, then a masked tail from ``first_masked_block``; ragged: the
    loop stops before the last block, which masks with no test; full and unragged: one loop
    and no mask (block 0, peeled, keeps the checked mask)."""
    src = emit.lower("coop-overlap", shapes.Shape("codegen", 1, 8, 2, seq_len, 128, 128,
                                                  causal)).source
    loops = re.findall(r"for \(int kb_\d+ = (.+?); kb_\d+ < (.+?); ", src)
    n_kblocks = -(-seq_len // 128)
    if causal:
        assert len(loops) == 4 and all(start.startswith("max(1, ") for start, _ in loops[1::2])
    else:  # per consumer warpgroup one loop over the unmasked blocks 1 .. n - 1 (or n - 2)
        assert loops == [("1", str(n_kblocks - (seq_len % 128 > 0)))] * 2
    assert ("condval" in src) == (causal or seq_len % 128 > 0)  # the masked select


@pytest.mark.parametrize("deferred", [True, False])
def test_deferred_row_sums_leave_the_kv_loop_without_shuffles(deferred):
    """deferred_sums: the KV loop adds each block's probabilities into 8 per-thread partial
    sums; the only cross-thread sum (AllReduce over the quad) is the one per tile, after it."""
    from ws_lab.kernels.fwd import coop_overlap

    func = coop_overlap.prim_func_for(shapes.get("train8b-4k"), deferred_sums=deferred)
    src = emit.lower_prim_func(func, coop.PASS_CONFIGS).kernel_source
    loop_start = src.index("for (int kb_")
    loop = src[loop_start:src.index("tl::wait_wgmma<0>();", loop_start)]
    assert ("AllReduce<tl::SumOp" in loop) != deferred
    assert ("float part_sum[8];" in src) == deferred


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("clear", [True, False])
def test_first_pv_overwrites_o(persistent, clear):
    """clear_first_pv: O is never zero-filled; every PV's first k step passes wgmma's scale-d
    as a run-time predicate that is off for the tile's block 0 (the loops' kb == 1, the drain's
    single-block tile). Off: the fill, and every PV accumulates (scale-d the constant 1)."""
    from ws_lab.kernels.fwd import coop_overlap

    func = coop_overlap.prim_func_for(shapes.get("llama8b-4k"), persistent=persistent,
                                      clear_first_pv=clear)
    src = emit.lower_prim_func(func, coop.PASS_CONFIGS).kernel_source
    scale_d = re.findall(r"tl::wgmma_rs<.*?reinterpret_cast<uint32_t\*>\(acc_o(?:_\d+)? \+ 0\), "
                         r"(.+?)\);\n", src)
    fills = re.findall(r"\(acc_o(?:_\d+)? \+ \(\w+ \* 4\)\) = make_float4\(broadcast", src)
    assert len(scale_d) == 6  # per consumer warpgroup: the two KV loops and the drain
    if clear:
        assert not fills
        assert all(re.fullmatch(r"\(\(0 < ki_\d+\) \? 1 : \(\(.+\) \? 0 : 1\)\)", a)
                   for a in scale_d), scale_d
    else:
        assert len(fills) == 2 and scale_d == ["1"] * 6


@pytest.mark.parametrize("n_qtiles,head_batches,rank_group", [(64, 64, 16), (37, 8, 16), (8, 32, 16),
                                                              (32, 32, 1)])
def test_persistent_walk_covers_every_tile_once_and_groups_a_heads_ranks(n_qtiles, head_batches,
                                                                         rank_group):
    """Every (rank, head·batch) exactly once; with rank groups, the first 132 tiles (one round
    of an H100) read the K/V of at most ceil(132 / 16) + 1 heads, not 132 / n_qtiles of all."""
    def select(cond, a, b):
        return a if cond else b

    walk = [tile_scheduler.tile_rank(t, n_qtiles, head_batches, rank_group, select)
            for t in range(n_qtiles * head_batches)]
    assert sorted(walk) == [(r, h) for r in range(n_qtiles) for h in range(head_batches)]
    first_round = {h for _, h in walk[:132]}
    if rank_group > 1 and n_qtiles >= rank_group:
        assert len(first_round) <= -(-132 // rank_group) + 1
    ranks = [r for r, _ in walk]
    full = n_qtiles // rank_group * rank_group * head_batches
    assert ranks[:full] == sorted(ranks[:full], key=lambda r: r // rank_group)  # group by group


def test_persistent_is_refused_at_head_dim_256():
    """Q double-buffered at D 256 would need 256 KB of shared memory."""
    from ws_lab import registry

    assert not registry.get("coop-overlap-persistent").supports(shapes.get("d256-4k"))
    assert registry.get("coop-overlap").supports(shapes.get("d256-4k"))


@needs_nvcc
def test_persistent_epilogue_runs_beside_the_next_tiles_first_qk(tmp_path):
    """Persistent: each O store (UTMASTG) follows a DEPBAR.LE 1 — the last PV has retired, the
    next tile's first QK is still in flight — not a DEPBAR.LE 0 (nothing in flight)."""
    emitted = emit.lower("coop-overlap-persistent", shapes.get("llama8b-4k"))
    summary = emit.inspect(emitted, tmp_path)
    text = next(tmp_path.glob("*.sass")).read_text()
    # the steady KV loops (causal: the unmasked part, then the masked tail selecting -inf), a
    # consumer warpgroup each; 8 QK and 8 PV wgmma a 128-key block
    loops = summary.gemm_loops
    assert [(loop.opcodes["HGMMA"], loop.opcodes["FSEL"] > 0) for loop in loops] == [
        (16, False), (16, True)] * 2, summary.format()
    ops = re.findall(r"(WARPGROUP\.DEPBAR\.LE gsb0, 0x\d|UTMASTG)", text)
    stores = [i for i, op in enumerate(ops) if op == "UTMASTG"]
    assert stores
    for i in stores:
        last_wait = next(op for op in reversed(ops[:i]) if op.startswith("WARPGROUP"))
        assert last_wait.endswith("0x1"), ops[max(0, i - 4):i + 1]


def _one_slot_kernel(shape, block_n, anchors=True):
    """The persistent CTA-pair kernel with one Q slot (``Config.q_slots``) at ``block_n`` keys."""
    import math

    from ws_lab.kernels.fwd import coop_overlap

    cfg = coop.Config(block_n, 2, True, persistent=True, cluster=2, q_slots=1)
    return coop.coop_fwd(shape.batch, shape.seq_len, shape.heads, shape.kv_heads,
                         shape.head_dim, shape.head_dim_v, shape.causal, "bfloat16",
                         1 / math.sqrt(shape.head_dim), cfg,
                         coop_overlap.overlap_mainloop(anchor_probs=anchors))


@needs_nvcc
def test_one_q_slot_fits_fa3s_176_key_blocks(tmp_path):
    """One Q slot (FA3's) leaves room for 176-key blocks on train8b-8k, the row it is for:
    within 227 KB, no spill, both GEMMs on 64 × 176 / K 176 wgmma, the overlap kept; each O
    store waits for everything (DEPBAR.LE 0: the epilogue runs alone, the next tile's Q not
    yet loaded). (At S 1000, B 1, 8 / 2 heads it spills 1 KB: notes/coop_overlap.md
    "Session 44".)"""
    from ws_lab.postproc import drop_anchor_fences

    shape = shapes.get("train8b-8k")
    emitted = emit.lower_variant("coop-overlap-persistent-1slot", shape,
                                 _one_slot_kernel(shape, 176), coop.PASS_CONFIGS,
                                 (drop_anchor_fences,))
    summary = emit.inspect(emitted, tmp_path)
    assert emitted.dyn_smem <= 227 * 1024 < 2 * 2 * 64 * 128 * 2 + emitted.dyn_smem
    assert summary.spill_bytes == 0
    assert set(summary.hgmma) == {"64x176x16.F32.BF16", "64x128x16.F32.BF16.RS"}
    assert sorted(set(summary.setmaxnreg)) == ["DEALLOC 24", "TRY_ALLOC 240"]
    assert sass.overlaps_gemm_and_softmax(summary)
    assert not [r for r in summary.ptxas_remarks if "C7515" in r]
    ops = re.findall(r"(WARPGROUP\.DEPBAR\.LE gsb0, 0x\d|UTMASTG)",
                     next(tmp_path.glob("*.sass")).read_text())
    stores = [i for i, op in enumerate(ops) if op == "UTMASTG"]
    assert stores and all(next(op for op in reversed(ops[:i]) if op.startswith("WARPGROUP"))
                          .endswith("0x0") for i in stores)


def test_one_q_slot_is_the_persistent_kernels_option():
    cfg = coop.Config(128, 2, True, q_slots=1)
    with pytest.raises(ValueError, match="q_slots=1: the persistent kernel holds 1 or 2"):
        coop.coop_fwd(1, 1000, 8, 2, 128, 128, False, "bfloat16", 0.1, cfg,
                      coop.serial_mainloop)


def test_persistent_refuses_the_serial_mainloop():
    with pytest.raises(ValueError, match="persistent kernel needs"):
        coop.prim_func_for(shapes.get("llama8b-4k"), persistent=True)


@pytest.mark.parametrize("name,cluster", [("llama8b-4k", 1), ("llama8b-8k", 2), ("train8b-4k", 2),
                                          ("train8b-8k", 2), ("llama8b-16k", 2)])
def test_cluster_for_pairs_ctas_when_kv_exceed_half_of_l2(name, cluster):
    """16 MB of K/V stay in the H100's 50 MB L2: single CTAs; from 32 MB on, CTA pairs."""
    s = shapes.get(name)
    assert coop.cluster_for(s.batch, s.seq_len, s.heads, s.kv_heads, s.head_dim, s.head_dim_v,
                            50 * 2**20) == cluster


def test_cluster_needs_two_heads_of_one_kv_head():
    big = dict(batch=2, seq_len=8192, head_dim=128, head_dim_v=128, l2_bytes=50 * 2**20)
    assert coop.cluster_for(heads=12, kv_heads=4, **big) == 1  # group 3
    assert coop.cluster_for(heads=8, kv_heads=8, **big) == 1  # MHA
    from ws_lab.kernels.fwd import coop_overlap

    odd = shapes.Shape("codegen", 1, 6, 2, 1000, 128, 128, True)
    with pytest.raises(ValueError, match="must be even"):
        coop_overlap.prim_func_for(odd, persistent=True, cluster=2)
    with pytest.raises(ValueError, match="only single CTAs"):
        coop_overlap.prim_func_for(shapes.get("llama8b-8k"), persistent=False, cluster=2)


def test_cluster_pair_shares_each_kv_load():
    """Cluster 2 (``cluster_for`` picks it at llama8b-8k): rank 0 multicasts each K and V load
    into both CTAs; every K/V stage's empty barrier counts its 256 consumer threads and the
    peer's 8 consumer warps, whose lane 0 arrives remotely at each of the 6 release points of
    a warpgroup (K: block 0 and the two KV loops; V: the two loops and the drain); a
    cluster_sync after the barriers' init and one before exit; the pair walks 1024 units (2048
    tiles) in 66 zigzag lanes, head = 2 · pair + rank. 16 MB of K/V: none."""
    src = emit.lower("coop-overlap-persistent", shapes.get("llama8b-8k")).source
    assert src.count("tl::tma_load_multicast(K_desc") == 1
    assert src.count("tl::tma_load_multicast(V_desc") == 1
    inits = dict(re.findall(r"\b(\w+)\[\d+\]\.init\((\d+)\)", src))
    assert inits["k_empty"] == inits["v_empty"] == "264"
    assert inits["k_full"] == inits["v_full"] == "32" and inits["q_empty"] == "256"
    remote = re.findall(r"(\w_empty)\[.+?\]\.arrive\(\(1 - tl::block_rank_in_cluster\(\)\)\);", src)
    assert sorted(remote) == ["k_empty"] * 6 + ["v_empty"] * 6
    assert src.count("tl::cluster_sync();") == 2 and src.rstrip().endswith("tl::cluster_sync();\n}")
    assert "for (int i = 0; i < (((int)(63 < ((int)blockIdx.x))) + 15); ++i)" in src
    assert "(65 - (((int)blockIdx.x) >> 1))" in src  # odd rounds walk the pairs backwards
    assert "* 2) + (((int)blockIdx.x) & 1))" in src  # the Q head: two per pair
    single = emit.lower("coop-overlap-persistent", shapes.get("llama8b-4k")).source
    assert "multicast" not in single and "cluster" not in single


@needs_nvcc
def test_cluster_pair_keeps_the_overlap_and_the_registers(tmp_path):
    """The CTA pair's machine code: K and V loads multicast (UTMALDG ... MULTICAST) beside the
    single-CTA fallback path TileLang emits, and the same overlap windows, registers and no
    spills as the single-CTA kernel."""
    summary = emit.inspect(emit.lower("coop-overlap-persistent", shapes.get("llama8b-8k")),
                           tmp_path)
    text = next(tmp_path.glob("*.sass")).read_text()
    assert len(re.findall(r"UTMALDG\.\dD\.MULTICAST", text)) >= 2
    assert sass.overlaps_gemm_and_softmax(summary)
    assert summary.warpgroup_sync.count("ARRIVE") == 2 * (1 + 2 * 2 + 2)
    assert summary.spill_bytes == 0 and summary.registers == 168
    assert not [r for r in summary.ptxas_remarks if "C7515" in r]


@needs_nvcc
@pytest.mark.parametrize("kernel,head_dim,causal", [
    ("coop-overlap-desc", 64, True), ("coop-overlap-desc", 128, False),
    ("coop-overlap-desc", 256, True), ("coop-overlap-persistent-desc", 128, True),
    ("coop-overlap-persistent-desc", 64, False)])
def test_the_descending_walk_lowers_at_every_head_dim(tmp_path, kernel, head_dim, causal):
    """``coop-overlap-desc`` and ``coop-overlap-persistent-desc`` (``coop.Config.kv_descending``,
    FA3's order, fp16 / bf16): the producer loads key block n − 1 − kb into iteration kb's
    stage; only a causal kernel's first block checks for a wholly masked row (-inf max); both
    consumers keep their {24, 240} budgets and spill nothing."""
    shape = shapes.Shape("codegen", 1, 8, 2, 1000, head_dim, head_dim, causal, "bfloat16")
    emitted = emit.lower(kernel, shape)
    summary = emit.inspect(emitted, tmp_path)
    assert summary.spill_bytes == 0 and summary.stack_frame == 0, summary.format()
    assert sorted(set(summary.setmaxnreg)) == ["DEALLOC 24", "TRY_ALLOC 240"]
    block_n = coop.CONFIGS[head_dim].block_n
    k_rows = re.findall(r"tl::tma_load(?:_multicast)?\(K_desc, [^;]*", emitted.source)
    assert k_rows and all(f"- (kb * {block_n})" in row for row in k_rows), k_rows
    assert ("float safe_max" in emitted.source) == causal
