"""The hand-written CUDA fused decode (kernels/decode/fused_decode_cuda.cu) without a GPU: nvcc builds it
for sm_90 and the SASS shows the design its header states; the ctypes mirrors of its launch
struct and of the driver's PDL launch structs match the C++ layouts; the dispatch rule sends the
rollout's shape to it and nothing outside its measured scope."""
import shutil

import pytest
import torch

from tests.cpu.cuda_layout import assert_compiles, offset_asserts, size_assert
from ws_lab.kernels.decode import fused_decode
from ws_lab.kernels.decode import fused_decode_cuda as fc

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA toolkit)")


@needs_nvcc
def test_builds_without_spills_and_keeps_its_design():
    reports = {r["kernel"]: r for r in fc.static_report((9, 0))}
    assert set(reports) == {fc.kernel_name(dt) for dt in fc.DTYPE_NAMES}
    for r in reports.values():
        assert r["spill_bytes"] == 0 and r["registers"] <= 255 // 2, r  # 8 warps: 2 CTAs fit
        # a step (one 16-token chunk at D 64): 8 mma for QK^T and 8 for PV; 4 ldmatrix of K,
        # 4 of V, and q's 4 once
        assert r["HMMA"] == 16, r
        assert r["LDSM"] == 12, r
        assert r["LDGSTS"] >= 8, r
        # the prologue's q tile, then the merge's two: none in the main loop
        assert r["BAR"] == 3, r


@needs_nvcc
def test_the_prologue_loads_go_out_before_the_rings():
    """q's pieces, the new k and v and the cos / sin rows are loaded (four 16-byte LDGs a
    thread) before the first cp.async of the context: behind the ring's ~64 KB a CTA they took
    3.8 µs in the rollout's step (notes/rollout.md, Session 26)."""
    kernels = fc.SOURCE.kernel_opcodes((9, 0))
    for name in (fc.kernel_name(dt) for dt in fc.DTYPE_NAMES):
        ops = kernels[name]
        first_ring_load = next(i for i, op in enumerate(ops) if op.startswith("LDGSTS"))
        assert ops[:first_ring_load].count("LDG.E.128") == 4, (name, ops[:first_ring_load])


@needs_nvcc
def test_the_context_loads_ask_the_l2_to_evict_them_first():
    """Every cp.async of the context ring carries an L2 evict_first policy: a decode step reads
    its context once, and the weights the rollout's side stream prefetched for the GEMMs after
    the attention stay in L2 (−3 to −5 µs a step, notes/rollout.md, Session 27). The SASS keeps
    the policy in a uniform register, so this reads the PTX."""
    entries = fc.SOURCE.ptx_entries((9, 0))
    for name in (fc.kernel_name(dt) for dt in fc.DTYPE_NAMES):
        ptx = entries[name]
        assert "createpolicy.fractional.L2::evict_first" in ptx, name
        ring_loads = ptx.count("cp.async.cg.shared.global")
        assert ring_loads >= 2, name
        assert ptx.count("cp.async.cg.shared.global.L2::cache_hint") == ring_loads, name


@needs_nvcc
def test_the_ctypes_params_match_the_kernels_struct(tmp_path):
    checks = [size_assert(f"Params<{t}>", fc.Params) for t in ("__half", "__nv_bfloat16")]
    assert_compiles(tmp_path, f'"{fc.SOURCE.path}"',
                    checks + offset_asserts("Params<__half>", fc.Params))


QWEN = dict(batch=64, heads=14, kv_heads=2, head_dim=64, capacity=456, dtype=torch.bfloat16,
            rope_dtype=torch.bfloat16, sm_count=132)


def _goes_to_cuda(batch, heads, kv_heads, head_dim, capacity, dtype, rope_dtype, sm_count):
    """The auto plan of a static call of this shape, on a device where the kernel builds."""
    cuda = fc.shape_supports(batch, heads, kv_heads, head_dim, capacity, dtype, rope_dtype)
    return fused_decode.plan(batch, kv_heads, head_dim, capacity, sm_count,
                             cuda=cuda).backend == "cuda"


def test_the_rollouts_shape_goes_to_the_cuda_kernel():
    assert _goes_to_cuda(**QWEN)
    assert _goes_to_cuda(**{**QWEN, "dtype": torch.float16, "rope_dtype": torch.float16})
    assert _goes_to_cuda(**{**QWEN, "capacity": fc.MAX_CAPACITY})


@pytest.mark.parametrize("change", [
    dict(head_dim=128), dict(capacity=fc.MAX_CAPACITY + 1), dict(batch=5),
    dict(heads=64, kv_heads=2), dict(dtype=torch.float32, rope_dtype=torch.float32),
    dict(rope_dtype=torch.float32), dict(batch=70000, kv_heads=1)],
    ids=["D128", "long-capacity", "few-pairs", "group-32", "fp32", "fp32-rope", "grid-y"])
def test_everything_else_keeps_the_triton_kernel(change):
    assert not _goes_to_cuda(**{**QWEN, **change})


def test_shared_memory_fits_and_the_rollout_shape_leaves_room_beside_it():
    assert fc.smem_bytes() == 2048 + 512 + 96 * 1024  # the header's budget
    assert 2 * fc.smem_bytes() <= 227 * 1024


@needs_nvcc
def test_the_pdl_launch_structs_match_the_driver_api(tmp_path):
    """kernels/decode/cubin.py's ctypes mirrors of CUlaunchConfig and CUlaunchAttribute against
    cuda.h: a moved or resized field fails to compile, and the attribute id is the one cuda.h
    names for programmatic stream serialization."""
    from ws_lab.kernels.decode import cubin

    fields = ("gridDimX", "gridDimY", "gridDimZ", "blockDimX", "blockDimY", "blockDimZ",
              "sharedMemBytes", "hStream", "attrs", "numAttrs")
    checks = [size_assert("CUlaunchConfig", cubin.CuLaunchConfig),
              size_assert("CUlaunchAttribute", cubin.CuLaunchAttribute),
              f"static_assert(offsetof(CUlaunchAttribute, value) == "
              f'{cubin.CuLaunchAttribute.value.offset}, "value");',
              f"static_assert(CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION == "
              f'{cubin.PROGRAMMATIC_STREAM_SERIALIZATION}, "id");']
    assert_compiles(tmp_path, "<cuda.h>",
                    checks + offset_asserts("CUlaunchConfig", cubin.CuLaunchConfig, fields))
