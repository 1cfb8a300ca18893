"""The CUDA post-processor: golden snippets, real CUDA emitted by TileLang 0.1.15 for the lab's
kernels (generated here, not stored), idempotence, refusals, nvcc on the rewritten source, and
the scoped TileLang hook."""
import shutil

import pytest

from ws_lab import postproc
from ws_lab.postproc import PostprocError, postprocess
from ws_lab import emit, shapes

F_S = "tl::warpgroup_fence_operand(reinterpret_cast<float*>(acc_s + 0), 64);"
F_O = "tl::warpgroup_fence_operand(reinterpret_cast<float*>(acc_o + 0), 64);"
F_P = "tl::warpgroup_fence_operand(reinterpret_cast<uint32_t*>(p + 0), 32);"

# FA3's IntraWGOverlap order: QK_n and PV_{n-1} in flight, wait<1> retires QK, wait<0> retires PV.
OVERLAP = f"""extern "C" __global__ void __launch_bounds__(384, 1) main_kernel(int x) {{
  {F_S}
  tl::warpgroup_arrive();
  tl::wgmma_ss<A, B>(da, db, ((uint32_t*)(acc_s + 0)), 1);
  tl::warpgroup_commit_batch();
  {F_S}
  {F_P}
  {F_O}
  tl::warpgroup_arrive();
  tl::wgmma_rs<A, B>(reinterpret_cast<const uint32_t*>(p + 0), db, reinterpret_cast<uint32_t*>(acc_o + 0), 1);
  tl::warpgroup_commit_batch();
  {F_O}
  {F_P}
  tl::wait_wgmma<1>();
  softmax(acc_s);
  tl::wait_wgmma<0>();
  rescale(acc_o);
}}"""


def test_fences_follow_the_wait_that_retires_each_group():
    out, report = postprocess(OVERLAP)
    lines = [line.strip() for line in out.splitlines()]
    w1, w0 = lines.index("tl::wait_wgmma<1>();"), lines.index("tl::wait_wgmma<0>();")
    assert lines[w1 + 1] == F_S and lines[w1 + 2] == "softmax(acc_s);"  # QK retired only
    assert set(lines[w0 + 1:w0 + 3]) == {F_O, F_P} and lines[w0 + 3] == "rescale(acc_o);"
    assert [(r.kernel, r.line) for r in report] == [("main_kernel", w1 + 1), ("main_kernel", w0 + 1)]
    assert "->" in str(report[0])


def test_idempotent_on_golden_code():
    once, _ = postprocess(OVERLAP)
    twice, report = postprocess(once)
    assert twice == once and report == []


@pytest.mark.parametrize("code,message", [
    (OVERLAP.replace("  tl::wait_wgmma<0>();\n", ""), "never waited for"),
    (OVERLAP.replace(F_S, "").replace(f"  {F_P}\n  {F_O}\n  tl::warpgroup_arrive", "  tl::warpgroup_arrive"),
     "no operand fences"),
], ids=["no-wait", "no-fences"])
def test_refuses_code_it_does_not_know(code, message):
    with pytest.raises(PostprocError, match=message):
        postprocess(code)


@pytest.mark.parametrize("kernel,shape", [("coop", "llama8b-4k"), ("coop", "d64-4k"),
                                          ("pipelined", "llama8b-4k"), ("pipelined", "d256-4k")])
def test_real_emitted_code(kernel, shape):
    emitted = emit.lower(kernel, shapes.get(shape), run_postproc=True)
    if kernel == "coop":  # its PV GEMM's P registers were not fenced after the wait
        assert len(emitted.rewrites) == 2
        assert all("reinterpret_cast<uint32_t*>(p" in r.after for r in emitted.rewrites)
    again, report = postprocess(emitted.postprocessed)
    assert again == emitted.postprocessed and report == []


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_rewritten_source_compiles(tmp_path):
    emitted = emit.lower("coop", shapes.get("llama8b-4k"), run_postproc=True)
    summary = emit.inspect(emitted, tmp_path)
    assert summary.warpgroup_sync.count("ARRIVE") == 4 and summary.spill_bytes == 0


def test_scoped_hook_rewrites_and_restores():
    import tilelang
    import tvm_ffi

    from ws_lab.kernels.fwd import coop

    assert tvm_ffi.get_global_func(postproc.HOOK, allow_missing=True) is None
    seen = []
    func = coop.prim_func_for(shapes.get("gpt2-d64"))
    with postproc.active(on_report=seen.append):
        assert not tilelang.is_cache_enabled()
        source = emit_source(func, coop.PASS_CONFIGS)
    assert tvm_ffi.get_global_func(postproc.HOOK, allow_missing=True) is None
    assert tilelang.is_cache_enabled()
    assert sum(len(r) for r in seen) == 2
    assert source.count("wait_wgmma<0>();\n        tl::warpgroup_fence_operand(reinterpret_cast<uint32_t*>(p") == 2


def emit_source(func, pass_configs):
    from ws_lab.upstream import lower_sm90a

    return lower_sm90a(func, pass_configs)
