"""The rescale pass (postproc/rescale.py) and FA4's conditional rescale (``lazy_rescale``):
golden snippets (which loops it guards and which it leaves), a refusal, idempotence, and the
real kernels — the persistent one guards each warpgroup's O and partial-sum rescales and its
SASS branches over the 64 O FMULs of a 128-key block at D 128; LargeHeadDimV (Dv 512) branches
over each of its 128-FMUL O rescales, in both warpgroups; no spill, no serialised wgmma."""
import re
import shutil

import pytest

from ws_lab import emit, shapes
from ws_lab.postproc import PostprocError, skip_unit_rescale

DECLS = """extern "C" __global__ void __launch_bounds__(384, 1) main_kernel(int x) {
  float acc_o[64];
  float part_sum[8];
  float row_rescale[2];
  float inv_sum[2];"""
O_RESCALE = """  #pragma unroll
  for (int i_19 = 0; i_19 < 32; ++i_19) {
    float2 __21;
      float2 v__24 = *(float2*)(acc_o + (i_19 * 2));
      float2 v__25 = make_float2(row_rescale[(i_19 & 1)], row_rescale[(i_19 & 1)]);
      __21.x = (v__24.x*v__25.x);
      __21.y = (v__24.y*v__25.y);
    *(float2*)(acc_o + (i_19 * 2)) = __21;
  }"""
SUM_RESCALE = """  #pragma unroll
  for (int i_15 = 0; i_15 < 2; ++i_15) {
    float4 __18;
      float4 v__19 = *(float4*)(part_sum + (i_15 * 4));
      float4 v__20 = make_float4(row_rescale[i_15], row_rescale[i_15], row_rescale[i_15], row_rescale[i_15]);
      __18.x = (v__19.x*v__20.x);
      __18.y = (v__19.y*v__20.y);
      __18.z = (v__19.z*v__20.z);
      __18.w = (v__19.w*v__20.w);
    *(float4*)(part_sum + (i_15 * 4)) = __18;
  }"""
NORMALIZE = O_RESCALE.replace("row_rescale", "inv_sum")
GUARD = "if (row_rescale[0] != 1.0f || row_rescale[1] != 1.0f) {  // skip_unit_rescale"


def kernel(*body):
    return "\n".join([DECLS, *body, "}"])


def test_guards_the_o_and_partial_sum_rescales():
    out, report = skip_unit_rescale(kernel(O_RESCALE, SUM_RESCALE))
    assert out == kernel(*(f"  {GUARD}\n{loop}\n  }}" for loop in (O_RESCALE, SUM_RESCALE)))
    assert len(report) == 2
    assert skip_unit_rescale(out) == (out, [])  # idempotent


@pytest.mark.parametrize("loop", [
    NORMALIZE,  # another factor: the reciprocal row sums
    O_RESCALE.replace("(v__24.x*v__25.x)", "(v__24.x*v__25.x) + 1.0f"),  # not a pure product
    O_RESCALE.replace("*(float2*)(acc_o + (i_19 * 2)) = __21;",
                      "*(float2*)(p + (i_19 * 2)) = __21;"),  # stores elsewhere
])
def test_leaves_other_loops_alone(loop):
    code = kernel(loop)
    assert skip_unit_rescale(code) == (code, [])


def test_leaves_kernels_without_rescale_factors_alone():
    code = kernel(O_RESCALE).replace("row_rescale", "scale")
    assert skip_unit_rescale(code) == (code, [])


def test_refuses_a_rescale_loop_that_reads_two_factor_arrays():
    code = kernel(O_RESCALE.replace("row_rescale[(i_19 & 1)], row_rescale",
                                    "row_rescale[(i_19 & 1)], row_rescale_1"))
    code = code.replace("  float inv_sum[2];", "  float row_rescale_1[2];")
    with pytest.raises(PostprocError, match="one factor array"):
        skip_unit_rescale(code)


def _forward_branches_over_fmul(sass_text: str) -> list[int]:
    """FMUL counts of the blocks that a predicated forward branch jumps over."""
    ins = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass_text)]
    at = {a: i for i, (a, _) in enumerate(ins)}
    counts = []
    for i, (a, op) in enumerate(ins):
        m = re.match(r"@!?P\d BRA (?:!?P\d, )?(?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", op)
        if m and int(m.group(1), 16) > a and int(m.group(1), 16) in at:
            skipped = ins[i + 1:at[int(m.group(1), 16)]]
            counts.append(sum(o.startswith("FMUL") for _, o in skipped))
    return counts


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_the_persistent_kernel_skips_its_o_rescale(tmp_path):
    import dataclasses
    import math

    from ws_lab.kernels.fwd import coop, coop_overlap

    shape = dataclasses.replace(shapes.get("train8b-8k"), dtype="bfloat16")
    loop = coop_overlap.overlap_mainloop(lazy_rescale=True)
    func = coop.coop_fwd(shape.batch, shape.seq_len, shape.heads, shape.kv_heads,
                         shape.head_dim, shape.head_dim_v, False, "bfloat16",
                         1 / math.sqrt(shape.head_dim),
                         coop.Config(128, 2, True, persistent=True, cluster=2), loop)
    emitted = emit.lower_variant("coop-overlap-persistent-lazy", shape, func, coop.PASS_CONFIGS,
                                 loop.postproc_passes)
    summary = emit.inspect(emitted, tmp_path)
    # per warpgroup: the partial sums' and O's rescale, in the unmasked and the masked loop
    assert emitted.postprocessed.count("// skip_unit_rescale") == 8
    assert "0x1p+3f/*8.000000e+00*/ < ((row_max[" in emitted.postprocessed  # the threshold
    assert summary.spill_bytes == 0
    assert not [r for r in summary.ptxas_remarks if "C7515" in r]
    skipped = _forward_branches_over_fmul(next(tmp_path.glob("*.sass")).read_text())
    assert skipped.count(64) >= 4, skipped  # O, 2 loops × 2 warpgroups: 64 × 128 / 128 threads


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_largehdv_skips_both_warpgroups_o_rescales(tmp_path):
    import dataclasses

    from ws_lab.kernels.fwd import coop, largehdv

    shape = dataclasses.replace(shapes.get("largehdv-2k"), dtype="bfloat16")
    emitted = emit.lower_variant("largehdv-lazy", shape,
                                 largehdv.prim_func_for(shape, lazy_rescale=True),
                                 coop.PASS_CONFIGS, (skip_unit_rescale,))
    summary = emit.inspect(emitted, tmp_path)
    # WG1: the loop's rescale, the last one, the normalisation (by its reciprocal row sums,
    # held in the same registers); WG2: the loop's rescale, by the factors WG1 published
    assert emitted.postprocessed.count("// skip_unit_rescale") == 4
    assert summary.spill_bytes == 0
    assert not [r for r in summary.ptxas_remarks if "C7515" in r or "C7513" in r]
    skipped = _forward_branches_over_fmul(next(tmp_path.glob("*.sass")).read_text())
    assert skipped.count(128) >= 4, skipped  # 64 rows × 256 O columns / 128 threads
