"""The anchor pass (postproc/anchors.py): golden snippets, refusals, idempotence, and the real
coop_overlap kernels — the pass removes exactly the proxy fences the wait anchor added, and the
result compiles with the anchored schedule (exp2s between the two waits) and no more fences
than the kernel without the anchor."""
import shutil

import pytest

from ws_lab.kernels.fwd import coop, coop_overlap
from ws_lab.postproc import PostprocError, drop_anchor_fences
from ws_lab import emit, sass, shapes

DECLS = """extern "C" __global__ void __launch_bounds__(384, 1) main_kernel(int x) {
  extern __shared__ __align__(1024) uchar buf_dyn_shmem[];
  void* wait_anchor = ((void*)((char*)buf_dyn_shmem + 0));
  void* q_s = ((void*)((char*)buf_dyn_shmem + 2048));"""
ANCHOR_STORE = "  *(float2*)(((float*)wait_anchor) + (i * 64)) = *(float2*)(acc_s + (i * 2));"
GROUP = """  tl::warpgroup_arrive();
  tl::fence_proxy_async();
  tl::wgmma_ss<A, B>(da, db, ((uint32_t*)(acc_s + 0)), 1);
  tl::warpgroup_commit_batch();"""
O_STORE = "  *(uint1*)(((half_t*)q_s) + (i * 64)) = *(uint1*)(o + 0);"


def kernel(*body):
    return "\n".join([DECLS, *body, "}"])


def unanchored(name, shape, persistent=False):
    """The same kernel without the wait anchor, through no pass."""
    return emit.lower_variant(
        name, shape, coop_overlap.prim_func_for(shape, persistent=persistent, anchor_probs=False),
        coop.PASS_CONFIGS)


def test_removes_the_fence_after_each_arrive():
    code = kernel(GROUP, ANCHOR_STORE, GROUP, O_STORE, "  tl::fence_proxy_async();",
                  "  tl::tma_store(d, (&(((half_t*)q_s)[0])), 0);")
    out, report = drop_anchor_fences(code)
    assert out.count("tl::fence_proxy_async();") == 1  # the O store's own fence stays
    assert [r.after for r in report] == ["tl::warpgroup_arrive();"] * 2
    assert drop_anchor_fences(out) == (out, [])  # idempotent


def test_leaves_kernels_without_anchors_alone():
    code = kernel(GROUP).replace("wait_anchor", "scratch")
    assert drop_anchor_fences(code) == (code, [])


@pytest.mark.parametrize("body,message", [
    ((GROUP, ANCHOR_STORE, "  float x = ((float*)wait_anchor)[0];"), "is read"),
    ((ANCHOR_STORE, O_STORE, GROUP), "without its own proxy fence"),
])
def test_refuses_when_the_fences_may_order_something(body, message):
    with pytest.raises(PostprocError, match=message):
        drop_anchor_fences(kernel(*body))


@pytest.mark.parametrize("kernel_name", ["coop-overlap", "coop-overlap-persistent"])
def test_removes_exactly_what_the_anchor_added(kernel_name):
    shape = shapes.get("llama8b-4k")
    anchored = emit.lower(kernel_name, shape)
    persistent = kernel_name.endswith("persistent")
    plain = unanchored(kernel_name, shape, persistent).source
    assert "wait_anchor" in anchored.source and "wait_anchor" not in plain
    fences = anchored.source.count("fence_proxy_async")
    assert fences > plain.count("fence_proxy_async")  # TileLang fenced the wgmmas
    assert anchored.postprocessed.count("fence_proxy_async") == plain.count("fence_proxy_async")
    assert len(anchored.rewrites) == fences - plain.count("fence_proxy_async")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_anchored_kernel_keeps_exp2s_above_the_pv_wait(tmp_path):
    """ptxas puts each PV wait above all 64 exp2 of the block (``test_ptxas_sinks_the_softmax_
    below_the_pv_wait``); with the anchor the row max and ≥ 4 exp2s stay between the waits,
    and the cubin has as many proxy fences as the kernel without the anchor."""
    shape = shapes.get("llama8b-4k")
    summary = emit.inspect(emit.lower("coop-overlap", shape), tmp_path / "anchored")
    assert len(summary.ex2_between_waits) == 4 and min(summary.ex2_between_waits) >= 4
    assert summary.spill_bytes == 0
    emit.inspect(unanchored("coop-overlap-plain", shape), tmp_path / "plain")
    fences = [sass.dump_sass(next((tmp_path / d).glob("*.cubin"))).count("FENCE.VIEW.ASYNC.S")
              for d in ("anchored", "plain")]
    assert fences[0] == fences[1]


def test_parallel_blocks_each_run_their_own_passes():
    """Two threads lower the anchored kernel at once, one inside ``postproc.active`` with the
    anchor pass, one outside any block: only the first is rewritten, and the hook is gone after."""
    from concurrent.futures import ThreadPoolExecutor

    import tvm_ffi

    from ws_lab import postproc
    from ws_lab.upstream import lower_sm90a

    func = coop_overlap.prim_func_for(shapes.get("llama8b-4k"))
    seen = []

    def lower(hooked):
        if not hooked:
            return lower_sm90a(func, coop.PASS_CONFIGS)
        with postproc.active(on_report=seen.append, passes=(drop_anchor_fences,)):
            return lower_sm90a(func, coop.PASS_CONFIGS)

    with ThreadPoolExecutor(2) as pool:
        hooked, plain = pool.map(lower, [True, False])
    assert "wait_anchor" in hooked and len(seen) == 1 and seen[0]
    assert hooked.count("fence_proxy_async") + len(seen[0]) == plain.count("fence_proxy_async")
    assert tvm_ffi.get_global_func(postproc.HOOK, allow_missing=True) is None
