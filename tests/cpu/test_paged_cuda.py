"""The hand-written CUDA paged decode (kernels/decode/paged_cuda.cu) without a GPU: nvcc builds it for
sm_80 and sm_90, and the SASS shows the design its docstring states; the ctypes mirror of its
launch struct matches the C++ layout; the planner's segments cover every block."""
import itertools
import shutil

import pytest

from tests.cpu.cuda_layout import assert_compiles, offset_asserts, size_assert
from ws_lab.kernels.decode import paged_cuda as pc

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA toolkit)")
DTYPES = ("f16", "bf16")


@needs_nvcc
@pytest.mark.parametrize("capability", [(8, 0), (9, 0)], ids=["sm80", "sm90"])
def test_every_planned_kernel_builds_without_spills_and_keeps_its_design(capability):
    reports = {r["kernel"]: r for r in pc.static_report(capability)}
    decode = {f"paged_decode_{dt}_{c.num_warps}_{c.stages}_{c.blocks_per_step}": c
              for c, dt in itertools.product(pc.CONFIGS, DTYPES)}
    assert set(reports) == set(decode) | {f"paged_merge_{dt}" for dt in DTYPES}
    for name, cfg in decode.items():
        r = reports[name]
        assert r["spill_bytes"] == 0 and r["registers"] <= 255, r
        # A step: 16 mma for QK^T and 16 for PV per cache block; 8 ldmatrix of K, 8 of V.
        assert r["HMMA"] == 32 * cfg.blocks_per_step, r
        assert r["LDSM"] == 16 * cfg.blocks_per_step, r
        assert r["LDGSTS"] >= 16 * cfg.blocks_per_step, r
    for dt in DTYPES:
        assert reports[f"paged_merge_{dt}"]["BAR"] == 0


@needs_nvcc
def test_no_cta_barrier_in_the_main_loop():
    """The walk's sort and the warps' merge synchronize the CTA; between the first mma and the
    last (the main loop) nothing does."""
    for name, ops in pc.SOURCE.kernel_opcodes((9, 0)).items():
        if not name.startswith("paged_decode"):
            continue
        mma = [i for i, op in enumerate(ops) if op.startswith("HMMA")]
        bars = [i for i, op in enumerate(ops) if op.startswith("BAR")]
        assert bars and mma, name
        assert not [i for i in bars if mma[0] < i < mma[-1]], name
        assert any(i < mma[0] for i in bars) and any(i > mma[-1] for i in bars), name


@needs_nvcc
def test_the_ctypes_params_match_the_kernels_struct(tmp_path):
    """A translation unit that includes paged_cuda.cu and static_asserts every field offset the
    ctypes mirror uses: a reordered or retyped field fails to compile."""
    checks = [size_assert(f"Params<{t}>", pc.Params) for t in ("__half", "__nv_bfloat16")]
    checks.append(f'static_assert(MAX_WARP_SLOTS == {pc.MAX_WARP_SLOTS}, "plan\'s cap");')
    checks += [f"static_assert(WalkSort<{nt}>::scratch_ints({n}) == "
               f"{pc.sort_scratch_ints(n, nt)}, \"the sort's scratch\");"
               for nt, n in itertools.product((64, 128), (0, 1, 63, 64, 65, 129, 512, 4096))]
    assert_compiles(tmp_path, f'"{pc.SOURCE.path}"',
                    checks + offset_asserts("Params<__half>", pc.Params))


def test_one_cta_per_pair_when_the_pairs_fill_the_gpu():
    assert pc.plan(8, 32, 128, 132) == (pc.WHOLE, 1, 128)  # llama7b-2k: 256 pairs


def test_split_rows_get_about_one_cta_an_sm():
    assert pc.plan(4, 8, 2048, 132) == (pc.SPLIT, 4, 512)  # long B4: 32 pairs, 32k tokens
    assert pc.plan(8, 8, 128, 132) == (pc.SPLIT, 2, 64)  # llama3-8b B8: 64 pairs


@pytest.mark.parametrize("batch,kv_heads,max_blocks", itertools.product(
    (1, 3, 16, 200), (1, 2, 8, 40), (1, 2, 7, 9, 64, 129, 3600)))
def test_segments_cover_every_block_once(batch, kv_heads, max_blocks):
    """And no warp walks (sorts) more than MAX_WARP_SLOTS blocks; beyond what that needs, the
    segments add up to about one CTA an SM."""
    cfg, n_seg, per_seg = pc.plan(batch, kv_heads, max_blocks, 132)
    assert per_seg % cfg.blocks_per_step == 0 or n_seg == 1
    assert n_seg * per_seg >= max_blocks > (n_seg - 1) * per_seg
    assert cfg.warp_slots(per_seg) <= pc.MAX_WARP_SLOTS
    needed = -(-max_blocks // (pc.MAX_WARP_SLOTS * cfg.num_warps))
    assert n_seg <= needed or batch * kv_heads * n_seg <= 132


def test_a_context_past_the_warps_sort_is_split():
    assert pc.plan(8, 32, 2048, 132) == (pc.WHOLE, 1, 2048)  # 32k tokens: 1024 slots a warp
    assert pc.plan(8, 32, 2049, 132) == (pc.WHOLE, 2, 1026)
    assert pc.plan(1, 8, 8192, 132) == (pc.SPLIT, 16, 512)  # 128k tokens: one CTA an SM
    assert pc.plan(1, 8, 80000, 132) == (pc.SPLIT, 20, 4000)  # 1.3M tokens: the sort's cap


def test_shared_memory_fits_the_sm():
    """At the longest segment plan gives: rings and the warps' sorted walks."""
    most = {cfg: pc.MAX_WARP_SLOTS * cfg.num_warps for cfg in pc.CONFIGS}
    for cfg in pc.CONFIGS:
        assert cfg.smem_bytes(most[cfg]) <= 227 * 1024
    assert 3 * pc.WHOLE.smem_bytes(most[pc.WHOLE]) <= 228 * 1024  # the docstring's three an SM


H100_SM_SMEM = 228 * 1024


def test_the_sort_gets_its_own_room_only_where_that_costs_no_cta_an_sm():
    """Sorting ahead of every ring stage needs the scratch past the walk: three WHOLE CTAs an
    SM keep it up to 12k-token contexts (768 blocks), not at 16k; SPLIT runs one CTA an SM and
    keeps it at its longest segment; without the SM's size the launch stays tight."""
    for per_seg in (8, 128, 512, 768):
        roomy = pc.WHOLE.smem_bytes(per_seg, sort_ahead=True)
        assert pc.WHOLE.launch_smem(per_seg, H100_SM_SMEM) == roomy
        assert 3 * (roomy + pc.RESERVED_SMEM) <= H100_SM_SMEM
    assert pc.WHOLE.launch_smem(1024, H100_SM_SMEM) == pc.WHOLE.smem_bytes(1024)
    most = pc.MAX_WARP_SLOTS * pc.SPLIT.num_warps
    assert pc.SPLIT.launch_smem(most, H100_SM_SMEM) == pc.SPLIT.smem_bytes(most, sort_ahead=True)
    assert pc.WHOLE.launch_smem(512, 0) == pc.WHOLE.smem_bytes(512)


def test_auto_takes_cuda_in_place_of_gqa_and_of_split_k_on_big_or_wide_rows():
    """The auto plan takes the CUDA kernel, where paged_cuda.supports holds, in place of gqa, or
    of split_k on at least CUDA_SPLIT_FROM_BYTES of K/V or about a KV head an SM; the small
    split rows stay on split_k, and a Triton launch config keeps to the Triton kernels."""
    from ws_lab.check import SUPPORTED, Support
    from ws_lab.kernels.decode import heuristics, paged

    def auto(batch, heads, kv_heads, blocks, cuda=Support("CPU tensors"), **kw):
        return paged.plan(batch, heads, kv_heads, 128, 16, blocks, 2, 132, cuda=cuda, **kw).kernel

    gqa_shape = (8, 32, 32, 128)
    long_split, short_split = (4, 32, 8, 2048), (8, 32, 8, 128)  # 537 / 67 MB
    wide_split = (16, 32, 8, 32)  # B·Hkv 128 of 132 SMs, 34 MB
    assert auto(*gqa_shape) == "gqa"  # CPU tensors: the kernel does not apply
    assert auto(*long_split) == "split_k"
    assert auto(*gqa_shape, cuda=SUPPORTED) == "cuda"
    assert auto(*long_split, cuda=SUPPORTED) == "cuda"
    assert auto(*short_split, cuda=SUPPORTED) == "split_k"
    assert auto(*wide_split, cuda=SUPPORTED) == "cuda"
    assert auto(*long_split, cuda=SUPPORTED, config=heuristics.DEFAULTS["split_k"]) == "split_k"
    assert auto(*long_split, cuda=SUPPORTED, backend="triton") == "split_k"
