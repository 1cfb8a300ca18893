"""The one floor model of every runner: the time no implementation can beat, max(FLOPs over the
tensor-core rate, bytes over a memory ceiling), and the ceilings it uses. The tensor-core rate
is the H100's measured 8192³ bf16 GEMM; the memory ceilings are measured in the same process as
the run they bound: the device-to-device copy (read + written) and the read-only probe."""
import torch
import triton
import triton.language as tl

# Tensor-core and HBM ceilings of the H100 SXM for the forward rows (measured: NOTES.md).
TENSOR_TFLOPS = 792.0
HBM_TBPS = 3.0


def floor_ms(flops: float = 0.0, nbytes: float = 0.0, *, tflops: float = TENSOR_TFLOPS,
             gbps: float = HBM_TBPS * 1e3) -> float:
    """max(flops at ``tflops``, nbytes at ``gbps``) in ms."""
    return max(flops / (tflops * 1e12), nbytes / (gbps * 1e9)) * 1e3


def copy_bandwidth_gbps() -> float:
    """Device-to-device copy of 1 GiB, bytes read + written over the median time."""
    import triton.testing

    src = torch.empty(1 << 29, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * 2 / (ms * 1e-3) / 1e9


@triton.jit
def _read_probe_kernel(X, Sums, elems_per_program, BLOCK: tl.constexpr):
    """Sums one contiguous slab of X per program: a read stream with one store per program."""
    base = X + tl.program_id(0).to(tl.int64) * elems_per_program
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, elems_per_program, BLOCK):
        acc += tl.load(base + start + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(Sums + tl.program_id(0), tl.sum(acc, 0))


# the probe's launch: the best of 72 (notes/triton.md, Session 16)
READ_PROBE = dict(programs=16384, BLOCK=16384, num_warps=16)


def read_bandwidth_gbps() -> float:
    """The read ceiling of a decode kernel (it reads K/V and writes almost nothing): bytes over
    the median time of ``_read_probe_kernel`` summing 2 GiB. On the H100 it reads at ~3130 GB/s,
    4 % above the 1 GiB copy's read + write rate: a copy does not bound a read-only kernel
    (SDPA's llama7b-8k decode read at 103 % of copy, notes/triton.md, Session 15). The sum is
    checked, so the probe cannot time a kernel that skipped its loads."""
    import triton.testing

    src = torch.empty(1 << 30, dtype=torch.float16, device="cuda").normal_()
    programs, block = READ_PROBE["programs"], READ_PROBE["BLOCK"]
    sums = torch.empty(programs, dtype=torch.float32, device="cuda")

    def read():
        _read_probe_kernel[(programs,)](src, sums, src.numel() // programs, BLOCK=block,
                                        num_warps=READ_PROBE["num_warps"])

    read()
    expected = src.sum(dtype=torch.float32)
    if not torch.allclose(sums.sum(), expected, rtol=1e-3, atol=1e-3 * src.numel() ** 0.5):
        raise RuntimeError(f"read probe summed {float(sums.sum())}, expected {float(expected)}")
    ms = triton.testing.do_bench(read, warmup=50, rep=300, return_mode="median")
    del src
    return 2 * (1 << 30) / (ms * 1e-3) / 1e9
