"""LargeHeadDimV lowers and compiles for Dv 256 and 512; its SASS and emitted CUDA match the
roles, register budgets and barriers that kernels/fwd/largehdv.py's docstring states."""
import re
import shutil

import pytest

from ws_lab.kernels.fwd import largehdv
from ws_lab.kernels.fwd.coop import NamedBarrier
from ws_lab import emit, sass, shapes

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


def shape_for(head_dim_v, causal=False):
    return shapes.Shape("codegen", 1, 8, 2, 1000, 64, head_dim_v, causal)


@needs_nvcc
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim_v", [256, 512])
def test_largehdv_compiles_warp_specialized(tmp_path, head_dim_v, causal):
    summary = emit.inspect(emit.lower("largehdv", shape_for(head_dim_v, causal)), tmp_path)
    n = head_dim_v // 2
    # WG1: QK (SS, N 64) and its O half from register P (RS); WG2: its O half from smem P (SS)
    assert {f"64x64x16.F32", f"64x{n}x16.F32.RS", f"64x{n}x16.F32"} == set(summary.hgmma)
    assert sorted(summary.setmaxnreg) == ["DEALLOC 24", "TRY_ALLOC 240", "TRY_ALLOC 240"]
    assert summary.spill_bytes == 0 and summary.stack_frame == 0
    assert summary.dyn_smem <= 227 * 1024
    # WG1's QK of block n is in flight with its PV of block n-1, and ptxas serialized nothing
    assert sass.overlaps_gemm_and_softmax(summary)
    assert not [r for r in summary.ptxas_remarks if re.search(r"C75(07|08|13|15)", r)]


def test_roles_and_barriers_match_the_docstring():
    src = emit.lower("largehdv", shape_for(512)).source
    assert "__launch_bounds__(384, 1)" in src
    assert "((int)threadIdx.x) < 288" in src  # one producer warp issues the TMA loads
    assert "((int)threadIdx.x) < 128" in src  # WG1 vs WG2
    assert src.count("warpgroup_reg_dealloc<24>") == 1 and src.count("warpgroup_reg_alloc<240>") == 2
    s = largehdv.STAGES
    inits = sorted(int(n) for n in re.findall(r"\b\w+\[\d+\]\.init\((\d+)\)", src))
    # q_full, k_full, v_full: 32; k_empty, p_full, p_empty: 128; v_empty: 256
    assert inits == sorted([32] * (1 + 2 * s) + [128] * (3 * s) + [256] * s)
    named = {int(i) for i in re.findall(r"__(?:named_barrier_arrive|sync_thread_partial)\((\d+),", src)}
    assert named == {NamedBarrier.EPILOGUE_WG1, NamedBarrier.EPILOGUE_WG2, NamedBarrier.ROW_SUM}
    assert src.count("__syncthreads();") == 1  # barrier init only
