"""A kernel holding ``T.pdl_sync()`` is launched without programmatic stream serialization by
the default (tvm_ffi) launcher, so it never overlaps the kernel before it.

Programmatic dependent launch needs both halves: the primary's ``griddepcontrol.launch_dependents``
(``T.pdl_trigger()``) and, on the dependent's launch, the attribute
``cudaLaunchAttributeProgrammaticStreamSerialization``. TileLang 0.1.15 marks the dependent's
device function ``has_cuda_pdl_sync`` and the cython launcher reads that mark and launches with
the attribute (``cudaLaunchKernelEx``). The default tvm_ffi launcher does not: the function's
``tirx.kernel_launch_params`` carry no programmatic tag (TVM's CUDA runtime has one,
``tirx.use_programtic_dependent_launch``) and the host code launches it as any kernel. The
dependent then starts only after its primary has drained, and ``T.pdl_sync()`` waits for
nothing. No error or warning is given. The control is the same kernel through
``execution_backend="cython"``.
"""
import tilelang.language as T

from ws_lab.target import SM90A
from ws_lab.upstream import lower_sm90a, verdict

TITLE = "the default (tvm_ffi) launcher drops programmatic dependent launch for T.pdl_sync kernels"
TRIAGE = "enhancement"
IMPACT = ("PDL is silently off under the default backend: on an H100 a dependent reads its "
          "primary's flag already set before its wait (it started after the primary ended), "
          "and a three-kernel attention backward marked for PDL ran no faster (0.988-0.990 x "
          "the unmarked one, 10 shuffled rounds)")
LINKS = ("https://github.com/tile-ai/tilelang/pull/1494 — PDL support; its review notes the "
         "tvm_ffi backend was missing it",)
PASS_CONFIGS = {}
EXPECTED = ("the tvm_ffi launcher honours `has_cuda_pdl_sync` as the cython one does (e.g. the "
            "`tirx.use_programtic_dependent_launch` launch-param tag), or refuses the kernel")
WORKAROUND = 'compile kernels holding T.pdl_sync with execution_backend="cython"'
EXCERPT = r"griddepcontrol|cudaGridDependencySynchronize|atomicAdd"
PDL_ATTRIBUTE = "cudaLaunchAttributeProgrammaticStreamSerialization"


def primary(spin_cycles):
    """Lets its dependent launch, spins ``spin_cycles`` clocks, then sets Flag."""

    @T.prim_func
    def spin_then_set(Flag: T.Tensor([1], "int32")):
        with T.Kernel(1, threads=32) as _:
            T.pdl_trigger()
            start = T.alloc_var("int64", init=T.call_extern("int64", "clock64"))
            while T.call_extern("int64", "clock64") - start < spin_cycles:
                T.evaluate(0)
            Flag[0] = 1

    return spin_then_set


def kernel():
    """The dependent: reads Flag before and after its wait into Out."""

    @T.prim_func
    def dependent(Flag: T.Tensor([1], "int32"), Out: T.Tensor([2], "int32")):
        with T.Kernel(1, threads=32) as _:
            Out[0] = T.call_extern("int32", "atomicAdd", T.address_of(Flag[0]), 0)
            T.pdl_sync()
            Out[1] = T.call_extern("int32", "atomicAdd", T.address_of(Flag[0]), 0)

    return dependent


def control():
    """The same dependent; ``check()`` compiles it with ``execution_backend="cython"``."""
    return kernel()


def lower():
    return lower_sm90a(kernel(), PASS_CONFIGS)


def _compiled(backend):
    import tilelang

    return tilelang.compile(kernel(), target=SM90A, execution_backend=backend)


def _lowered():
    import tilelang
    import tvm

    target = tvm.target.Target(SM90A)
    with target:
        return target, tilelang.lower(kernel(), target=target)


def _device_attrs(artifact) -> dict:
    """The dependent's device-function attributes as lowered for sm_90a."""
    (func,) = artifact.device_mod.functions.values()
    return {key: func.attrs[key] for key in func.attrs.keys()}


def _cython_host_code(target, artifact) -> str:
    """The launcher the cython backend builds (TileLang's TLWrapper, as its adapter calls it),
    without linking it: no libcuda needed."""
    import tvm
    from tilelang.jit.adapter.wrapper import TLWrapper

    func = kernel()
    wrapper = TLWrapper(target)
    wrapper.assign_optimized_module(tvm.IRModule({func.attrs["global_symbol"]: func}))
    wrapper.assign_pass_configs(PASS_CONFIGS)
    wrapper.assign_host_module(artifact.host_mod)
    wrapper.assign_device_module(artifact.device_mod)
    return wrapper.wrap(artifact.kernel_source)


def check():
    """Fixed when the tvm_ffi build of a kernel marked ``has_cuda_pdl_sync`` launches it as a
    programmatic dependent (a launch-param tag or the attribute in its host code); the bug is the
    mark without either, while the cython build sets the attribute."""
    default = _compiled("tvm_ffi")
    target, artifact = _lowered()
    attrs = _device_attrs(artifact)
    marked = int(attrs.get("has_cuda_pdl_sync", 0)) == 1
    params = [str(p) for p in attrs.get("tirx.kernel_launch_params", [])]
    launches_pdl = (any("programtic" in p or "programmatic" in p for p in params)
                    or PDL_ATTRIBUTE in default.get_host_source())
    control_ok = PDL_ATTRIBUTE in _cython_host_code(target, artifact)
    return verdict(control_ok and marked and not launches_pdl, control_ok and launches_pdl,
                   f"tvm_ffi: has_cuda_pdl_sync={int(marked)}, launch params {params}; cython "
                   f"host code sets {PDL_ATTRIBUTE}: {control_ok}")


def run() -> str:
    """On a GPU: the primary spins ≈ 10 ms; the flag its dependent read before its wait, for
    each launcher (0 means the dependent started while the primary ran)."""
    import tilelang
    import torch

    spin = tilelang.compile(primary(20_000_000), target=SM90A)
    reads = []
    for backend in ("tvm_ffi", "cython"):
        dependent = _compiled(backend)
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        out = torch.full((2,), -1, dtype=torch.int32, device="cuda")
        spin(flag)
        dependent(flag, out)
        reads.append(f"{backend}: {out.tolist()}")
    return "flag read before and after the dependent's wait, " + "; ".join(reads)
