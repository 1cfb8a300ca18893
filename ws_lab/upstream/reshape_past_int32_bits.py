"""``T.reshape`` / ``T.view`` of a buffer of 2^31 bits or more fails to build: the size check
multiplies the shape by the element's bits in int32.

A kernel that addresses a large global tensor through a flat view (here (2, n, 64) fp32 as one
row of 2·n·64 elements, e.g. to bulk-store fixed-size chunks of it) builds while the tensor
holds fewer than 2^26 fp32 elements and fails from 2^26 on (256 MB, 2^31 bits): building the
prim_func raises ``Literal value 2147483648 exceeds maximum of int32`` from the shape check in
``tilelang/language/customize.py`` (``bits_product``, an int32 product of the extents and the
dtype's bits). No index of the kernel needs more than int32 here; the element count itself is
2^26. The control is the same kernel 8 rows smaller, which builds and lowers.
"""
from ws_lab.upstream import lower_sm90a, verdict

TITLE = "T.reshape / T.view of a buffer of 2^31 bits or more fails: its size check overflows int32"
TRIAGE = "rejects valid code"
IMPACT = ("no kernel can take a flat view of an fp32 tensor of 256 MB or more; a backward's "
          "dQ accumulator pair reached it at B 2, S 4096, 32 heads, D 128, where the small "
          "test shapes had built and passed on the H100")
LINKS = ("none found: no open issue or PR on T.reshape / T.view sizes past int32",)
PASS_CONFIGS = {}
EXPECTED = ("the view builds (the size check in int64, or on element counts): 2^26 fp32 "
            "elements is far from any int32 index limit")
WORKAROUND = ("index the N-D tensor directly, or pass a flat tensor as a second parameter; "
              "keep views under 2^31 bits")
EXCERPT = r"exceeds maximum of int32|__global__|flat|A\["
ROWS = 1 << 19  # 2 · ROWS · 64 fp32 elements = 2^26 = 2^31 bits


def kernel(rows: int = ROWS):
    """Zeroes the first 64 elements of A through a flat view of it."""
    import tilelang.language as T

    @T.prim_func
    def zero_head(A: T.Tensor([2, rows, 64], "float32")):
        with T.Kernel(1, threads=64) as _:
            flat = T.reshape(A, [2 * rows * 64])
            for i in T.Parallel(64):
                flat[i] = T.float32(0)

    return zero_head


def control():
    return kernel(ROWS - 8)


def _lowered(build) -> str:
    """The emitted CUDA, or the one line the build raised."""
    try:
        return lower_sm90a(build(), PASS_CONFIGS)
    except Exception as exc:  # the failure is the behaviour pinned
        return f"// build failed: {type(exc).__name__}: {str(exc).strip().splitlines()[-1]}"


def lower():
    return _lowered(kernel)


def check():
    """Fixed when the 2^31-bit view builds and lowers; the bug is the int32 overflow raised
    while the control, 8 rows smaller, lowers."""
    got, control_src = lower(), _lowered(control)
    control_ok = "zero_head_kernel" in control_src
    bug = control_ok and "exceeds maximum of int32" in got
    fixed = control_ok and "zero_head_kernel" in got
    return verdict(bug, fixed, f"2^26-element view: {got.splitlines()[0][:140]}; control "
                               f"({2 * (ROWS - 8) * 64} elements): "
                               f"{'lowers' if control_ok else control_src[:140]}")
