"""Parameters annotated with one shared ``T.Tensor`` object become one buffer: the kernel
silently reads and writes the last of them for all.

A kernel with several tensors of one shape reads naturally with the annotation built once
(``q_t = T.Tensor([B, S, H, D], dtype)``, then ``Q: q_t, dO: q_t``), as FA-style code names
its types. TileLang 0.1.15 binds every parameter annotated with that object to a single
buffer, named after the last of them: ``A_handle``, ``B_handle`` and ``C_handle`` each
``match_buffer`` into ``C`` (``data=C.data``), so ``C[i] = A[i] + B[i]`` lowers to
``C[i] = C[i] + C[i]`` and the emitted kernel takes ``C`` alone. No error or warning is
given; the host wrapper still takes three tensors. The control builds a fresh ``T.Tensor`` for
each parameter and is emitted correctly.
"""
import tilelang.language as T

from ws_lab.upstream import lower_sm90a, verdict

TITLE = "parameters sharing one T.Tensor annotation object are silently bound to one buffer"
TRIAGE = "wrong code"
IMPACT = ("wrong values, no error: a backward kernel whose Q and dO (and K, V, dK, dV) shared "
          "annotations read dO for Q and computed an all-NaN dQ on the H100; read from the "
          "emitted code, no GPU run needed")
LINKS = ("none found: no open issue or PR on annotation objects shared between parameters",)
PASS_CONFIGS = {}
EXPECTED = ("three buffers A, B and C, each bound to its own parameter (or an error saying the "
            "annotation object is used twice)")
WORKAROUND = "build a fresh T.Tensor for every parameter (a small function returning it)"
EXCERPT = r"__global__|C\[|A\[|B\["


def kernel(shared: bool = True):
    """C = A + B; ``shared=False`` gives each parameter its own annotation (the control)."""
    one = T.Tensor([64], "float32")

    def fresh():
        return one if shared else T.Tensor([64], "float32")

    @T.prim_func
    def add(A: fresh(), B: fresh(), C: fresh()):
        with T.Kernel(1, threads=64) as _:
            for i in T.Parallel(64):
                C[i] = A[i] + B[i]

    return add


def control():
    return kernel(shared=False)


def lower():
    return lower_sm90a(kernel(), PASS_CONFIGS)


def _kernel_params(prim_func) -> list[str]:
    """The emitted kernel's pointer parameters, by name."""
    import re

    src = lower_sm90a(prim_func, PASS_CONFIGS)
    signature = re.search(r"add_kernel\(([^)]*)\)", src)
    return re.findall(r"\* __restrict__ (\w+)", signature.group(1)) if signature else []


def check():
    """Fixed when the emitted kernel takes A, B and C; the bug is a kernel taking C alone, while
    the control (a fresh annotation per parameter) takes all three."""
    params, control_params = _kernel_params(kernel()), _kernel_params(control())
    control_ok = sorted(control_params) == ["A", "B", "C"]
    return verdict(control_ok and params == ["C"], control_ok and sorted(params) == ["A", "B", "C"],
                   f"kernel parameters with one shared annotation: {params}; control (one "
                   f"annotation each): {control_params}")
