"""The pipelined kernel lowers for sm_90a and compiles with nvcc for every head dim and mask;
the llama8b-4k config's SASS is on the wgmma path, warp-specialized and spill-free."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ws_lab.kernels.fwd import pipelined
from ws_lab import emit, sass, shapes

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


def shape_for(head_dim, head_dim_v, causal):
    return shapes.Shape("codegen", 1, 8, 2, 1000, head_dim, head_dim_v, causal)


@needs_nvcc
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim,head_dim_v", pipelined.HEAD_DIMS)
def test_pipelined_lowers_and_compiles(tmp_path, head_dim, head_dim_v, causal):
    emitted = emit.lower("pipelined", shape_for(head_dim, head_dim_v, causal))
    assert "__global__" in emitted.source
    summary = emit.inspect(emitted, tmp_path)
    assert sum(summary.hgmma.values()) > 0, "expected wgmma (HGMMA) in the SASS"
    assert summary.dyn_smem <= 227 * 1024, "over the H100's 227 KB of shared memory per block"


@needs_nvcc
def test_llama8b_4k_sass(tmp_path):
    emitted = emit.lower("pipelined", shapes.get("llama8b-4k"))
    summary = emit.inspect(emitted, tmp_path)
    assert summary.hgmma["64x128x16.F32"] > 0  # S = Q Kᵀ, both operands from shared memory
    assert any(s.endswith(".RS") for s in summary.hgmma)  # O += P V with P in registers
    assert summary.spill_bytes == 0 and summary.stack_frame == 0
    # O normalized by one reciprocal per row: without --use_fast_math (pipelined compiles
    # without it) each element's division is an IEEE div.rn.f32 with an FCHK slow-path check
    assert summary.counts["FCHK"] == 0
    assert summary.setmaxnreg == ["TRY_ALLOC 240", "DEALLOC 24"]  # consumer up, producer down
    assert summary.counts["UTMALDG"] > 0
    assert emitted.threads == 384  # two consumer warpgroups + the producer TileLang adds


@needs_nvcc
def test_emit_cli_prints_the_sass_summary(tmp_path):
    done = subprocess.run([sys.executable, "-m", "ws_lab.emit", "pipelined", "--shape", "llama8b-4k",
                           "--out", str(tmp_path)], capture_output=True, text=True, check=True)
    assert "SASS summary" in done.stdout and "HGMMA: 64x128x16.F32" in done.stdout
    stem = "pipelined_llama8b-4k_causal"
    for suffix in (".cu", ".post.cu", ".diff", ".cubin", ".sass"):
        assert (tmp_path / (stem + suffix)).stat().st_size > 0 or suffix == ".diff"


@needs_nvcc
def test_bench_without_gpu_falls_back_to_static_report():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the bench measures instead")
    done = subprocess.run([sys.executable, "bench/pipelined.py", "--shape", "gpt2-d64"],
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
                          check=True)
    assert "no CUDA device" in done.stdout and "SASS summary" in done.stdout


SASS_SNIPPET = """
        /*0590*/                   USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0 ;  /* 0x0 */
        /*1650*/                   WARPGROUP.ARRIVE ;                                           /* 0x0 */
        /*1660*/                   HGMMA.64x128x16.F32 R24, gdesc[UR12], R24 ;                  /* 0x0 */
        /*1670*/                   HGMMA.64x128x16.F32 R24, gdesc[UR12], R24, gsb0 ;            /* 0x0 */
        /*1680*/                   HGMMA.64x64x16.F32 R88, R120, gdesc[UR8], R88 ;              /* 0x0 */
        /*1900*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;                              /* 0x0 */
        /*1910*/              @!P0 SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4+0x10], R3 ;         /* 0x0 */
        /*1920*/                   BAR.SYNC.DEFER_BLOCKING 0x1, 0x100 ;                          /* 0x0 */
        /*1930*/                   UTMALDG.4D [UR8], [UR4], desc[UR6] ;                         /* 0x0 */
        /*8140*/                   USETMAXREG.DEALLOC.CTAPOOL 0x18 ;                            /* 0x0 */
"""


def test_sass_summary_on_a_golden_snippet():
    s = sass.summarize_sass(SASS_SNIPPET)
    assert dict(s.hgmma) == {"64x128x16.F32": 2, "64x64x16.F32.RS": 1}
    assert s.warpgroup_sync == ["ARRIVE", "DEPBAR.LE 1"]
    assert s.depbar_windows == [(1, ("SS", "RS"))] and sass.overlaps_gemm_and_softmax(s)
    assert s.setmaxnreg == ["TRY_ALLOC 240", "DEALLOC 24"]
    assert (s.counts["SYNCS"], s.counts["BAR"], s.counts["UTMALDG"]) == (1, 1, 1)
    report = ("ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are "
              "serialized due to non wgmma instructions\nptxas info    : Used 168 registers\n"
              "    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads")
    sass.parse_ptxas(report, s)
    assert (s.registers, s.spill_bytes, s.stack_frame) == (168, 8, 8)
    assert len(s.ptxas_remarks) == 1 and s.ptxas_remarks[0].startswith("(C7515)")


def test_repro_bundle_for_every_pin():
    from ws_lab import repro

    assert repro.names() == ["annotated_fragment_second_warpgroup", "annotated_swizzle_k_slice",
                             "e4m3_register_operand",
                             "fence_operand_num_regs", "fence_proxy_for_unrelated_smem",
                             "gemm_fence_two_warpgroups", "reshape_past_int32_bits",
                             "shared_annotation_aliases_params", "smem_reuse_past_async_wgmma",
                             "smem_reuse_without_syncs",
                             "stripe_fragment_layout", "wgmma_fence_before_wait"]
    lab_words = ("ws_lab", "ws-lab", "NOTES", "kernels/", "session", "the lab", "coop", "tests/")
    for name in repro.names():
        text = repro.bundle(name)
        for section in ("**Triage: ", "Related upstream:", "## Environment", "## Reproduce",
                        "Output here:", "## The control (what works)",
                        "## Emitted CUDA (excerpt): kernel", "## Emitted CUDA (excerpt): control",
                        "## Expected", "## Workaround"):
            assert section in text, (name, section)
        assert not [w for w in lab_words if w in text], name  # a bundle is for TileLang's maintainers


def test_emit_compiles_with_the_flags_tilelang_runs_with():
    """The inspected cubin is the one that runs: kernels whose pass configs enable fast math
    (coop, coop_overlap, largehdv) get --use_fast_math from TileLang's CUDA backend, so emit
    passes it too; pipelined compiles without it."""
    assert emit.lower("coop-overlap", shapes.get("llama8b-4k")).nvcc_options == ("--use_fast_math",)
    assert emit.lower("pipelined", shapes.get("llama8b-4k")).nvcc_options == ()
