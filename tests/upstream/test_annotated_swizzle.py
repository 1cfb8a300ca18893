"""A wgmma over a K-slice of a shared buffer replaces the buffer's annotated swizzled layout
(bundle: python -m ws_lab.repro annotated_swizzle_k_slice). Passes — and so fails as strict
xfail — once TileLang keeps the annotation or refuses it."""
import pytest

from ws_lab.upstream import StillBroken, expect_fixed

from ws_lab.upstream import annotated_swizzle_k_slice


@pytest.mark.xfail(strict=True, raises=StillBroken,
                   reason="a one-k-step wgmma re-lays the buffer, 32-byte swizzle")
def test_k_slice_wgmma_keeps_the_annotated_swizzle():
    expect_fixed(annotated_swizzle_k_slice.check())
