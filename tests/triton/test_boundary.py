"""The decode kernels' boundary on the GPU (issue #45), every backend: a block id outside the pool
or a position outside the cache gives exactly that sequence's NaN rows and writes nothing
outside a buffer (a fill value around the caches and the output, and the cache slots the step
must not write, are bit for bit as before); non-finite q / k / v give NaN or inf in exactly the
rows the float64 oracle does; an empty context stays zeros (ws_lab.boundary_cases). Then a q
whose batch offsets pass 2^31 elements, and compute-sanitizer memcheck over the cases that
would read or write outside a buffer."""
import functools

import pytest

from ws_lab import boundary_cases as bc
from ws_lab.paged_cases import variants

pytestmark = pytest.mark.gpu

DTYPES = ("float16", "bfloat16")
TOLERANCE = {"float16": 2e-3, "bfloat16": 1.6e-2}


def paged_entries():
    from ws_lab.kernels.decode import paged

    entries = {name: fn for name, fn in variants().items() if name != "auto"}
    entries["cuda"] = functools.partial(paged.paged_attention, backend="cuda")
    return entries


def fused_entries():
    """name -> (entry, block size or None for static caches)."""
    from ws_lab.kernels.decode import fused_decode as fd

    return {"static-triton": (functools.partial(fd.fused_decode_attention, backend="triton"),
                              None),
            "static-cuda": (functools.partial(fd.fused_decode_attention, backend="cuda"), None),
            "paged-triton": (fd.fused_paged_decode_attention, 16)}


PAGED_ENTRIES = ["v1", "gqa", "split_k", "split_k-reduce", "split_k-merge", "cuda"]
FUSED_ENTRIES = {"static-triton": bc.FUSED_CASES, "static-cuda": bc.FUSED_CASES,
                 "paged-triton": bc.FUSED_PAGED_CASES}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", bc.PAGED_CASES)
@pytest.mark.parametrize("entry", PAGED_ENTRIES)
def test_paged_boundary(entry, case, dtype):
    import torch

    v = bc.paged_case(case, paged_entries()[entry], getattr(torch, dtype), "cuda")
    assert v.ok(TOLERANCE[dtype]), v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("entry,case", [(e, c) for e, cases in FUSED_ENTRIES.items()
                                        for c in cases])
def test_fused_boundary(entry, case, dtype):
    import torch

    fn, block_size = fused_entries()[entry]
    v = bc.fused_case(case, fn, getattr(torch, dtype), "cuda", block_size=block_size)
    assert v.ok(TOLERANCE[dtype]), v


@pytest.mark.parametrize("entry", PAGED_ENTRIES)
def test_q_batch_offsets_past_2_to_the_31(entry):
    """q (3, 8, 128) as rows of a 4.3 GB buffer, 2^30 + 64 elements apart: sequence 2's offset
    is past 2^31 (it was an illegal address in gqa with 32-bit offsets)."""
    import torch

    from ws_lab import oracle
    from ws_lab.paged_cases import make_paged

    (q, k, v, table, lens), _ = make_paged(3, 8, 2, 128, 16, [40, 70, 33], torch.float16, "cuda")
    stride = 2**30 + 64
    big = torch.empty(2 * stride + 8 * 128, dtype=torch.float16, device="cuda")
    far_q = big.as_strided(q.shape, (stride, 128, 1))
    far_q.copy_(q)
    out = torch.full_like(q, float("nan"))
    paged_entries()[entry](far_q, k, v, table, lens, out=out)
    assert oracle.rel_l2(out, oracle.paged_attention_ref(q, k, v, table, lens)) < 2e-3


MEMCHECK_SCRIPT = """
import torch
from ws_lab import boundary_cases as bc
from tests.triton.test_boundary import (FUSED_ENTRIES, fused_entries, misaligned_fused_case,
                                        paged_entries)
for name, fn in paged_entries().items():
    for case in ("id = num_blocks", "id = -1", "id = 2^31 - 1"):
        assert bc.paged_case(case, fn, torch.float16, "cuda").ok(2e-3), (name, case)
for name, (fn, bs) in fused_entries().items():
    for case in FUSED_ENTRIES[name]:
        if "position" in case or "outside" in case:
            assert bc.fused_case(case, fn, torch.float16, "cuda", block_size=bs).ok(2e-3), (name, case)
from ws_lab.kernels.step import decode_layer as dl
x, w, r = (torch.randn(4, 64, device="cuda").half(), torch.randn(64, device="cuda").half(),
           torch.randn(4, 64, device="cuda").half())
for args in ((x, w, 1e-6, r[:2]), (x, w[:32], 1e-6, r)):  # short residual, short weight
    try:
        dl.add_rmsnorm(*args)
        raise AssertionError("add_rmsnorm took a short operand")
    except ValueError:
        pass
try:
    dl.linear(x, torch.randn(32, 64, device="cuda").half(), torch.randn(16, device="cuda").half())
    raise AssertionError("linear took a short bias")
except ValueError:
    pass
assert misaligned_fused_case().ok(2e-3)
print("cases ok")
"""


def misaligned_fused_case():
    """Static fused decode on caches that start 2 bytes past a 16-byte boundary: the L2 hint
    is skipped, the step is as correct as on aligned caches."""
    import torch

    from ws_lab.kernels.decode import fused_decode as fd

    def entry(q, k_new, v_new, k_cache, v_cache, *rest, out):
        shifted = []
        for cache in (k_cache, v_cache):
            buf = torch.empty(cache.numel() + 1, dtype=cache.dtype, device=cache.device)
            view = buf[1:].view(cache.shape)
            view.copy_(cache)
            shifted.append(view)
        fd.fused_decode_attention(q, k_new, v_new, *shifted, *rest, backend="triton", out=out)
        k_cache.copy_(shifted[0])
        v_cache.copy_(shifted[1])

    return bc.fused_case("NaN in q", entry, torch.float16, "cuda")


def test_misaligned_fused_caches_are_correct():
    assert misaligned_fused_case().ok(2e-3)


def test_memcheck_finds_nothing_on_the_out_of_bounds_cases():
    from ws_lab.testing import memcheck_failure

    try:
        failure = memcheck_failure(MEMCHECK_SCRIPT)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    assert failure is None, failure
