"""The warpgroup-index pass (postproc/uniform_wg.py): golden snippets (the declaration at the
kernel's top, each wgmma call rewritten, other uses of threadIdx left), idempotence, a refusal,
and the backward's main kernel lowered through it: the same wgmma and registers, no spill, and
the steady loop without its per-wgmma R2UR moves (``bwd.Config(uniform_wg=True)``)."""
import shutil

import pytest

from ws_lab import emit, shapes
from ws_lab.postproc import PostprocError, uniform_warpgroup
from ws_lab.postproc.uniform_wg import DECLARATION

HEAD = 'extern "C" __global__ void __launch_bounds__(384, 1) main_kernel(int x) {'
WGMMA = ("        tl::wgmma_ss<tl::DataType::kBFloat16, tl::DataType::kBFloat16, "
         "tl::DataType::kFloat32, 64, 64, 16, false, false, 1, 1>(uint64_t(desc_a + "
         "((((((int)threadIdx.x) >> 7) + 1) & 1) * 8192) >> 4)), uint64_t(desc_b), "
         "((uint32_t*)(st + 0)), 1);")
STORE = "  dst[((((int)threadIdx.x) >> 7) * 4)] = 1.0f;"  # not a wgmma: left as it is


def kernel(*body):
    return "\n".join([HEAD, *body, "}"])


def test_declares_the_index_once_and_rewrites_each_wgmma():
    out, report = uniform_warpgroup(kernel(STORE, WGMMA, WGMMA))
    wgmma = WGMMA.replace("(((int)threadIdx.x) >> 7)", "tl_wg_idx")
    assert out == kernel(DECLARATION, STORE, wgmma, wgmma)
    assert len(report) == 2
    assert uniform_warpgroup(out) == (out, [])  # idempotent


def test_leaves_code_without_such_a_wgmma_alone():
    code = kernel(STORE, WGMMA.replace("(((int)threadIdx.x) >> 7)", "1"))
    assert uniform_warpgroup(code) == (code, [])


def test_refuses_two_kernel_definitions():
    with pytest.raises(PostprocError, match="expected one kernel definition, found 2"):
        uniform_warpgroup(kernel(WGMMA) + "\n" + kernel(WGMMA))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_the_backwards_main_loop_keeps_its_wgmma_without_r2ur(tmp_path):
    from ws_lab.kernels.bwd import pipelined

    shape = shapes.Shape("bwd-uniform", 1, 8, 2, 1024, 128, 128, False, "bfloat16")
    func = pipelined.prim_func_for(shape)
    summaries = {}
    for name, passes in (("plain", ()), ("uniform", (uniform_warpgroup,))):
        emitted = emit.lower_variant("bwd-pipelined", shape, func, pipelined.PASS_CONFIGS,
                                     passes)
        summaries[name] = emit.inspect(emitted, tmp_path / name)
    plain, uniform = summaries["plain"], summaries["uniform"]
    assert uniform.hgmma == plain.hgmma and uniform.registers == plain.registers
    assert uniform.spill_bytes == 0 and not uniform.ptxas_remarks, uniform.format()
    (before,), (after,) = plain.gemm_loops, uniform.gemm_loops
    assert before.opcodes["R2UR"] >= 32 and after.opcodes["R2UR"] <= 8, (before, after)
    assert after.instructions < before.instructions
