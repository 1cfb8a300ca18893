"""tilelang #2416: with automatic syncs off, shared-memory reuse still hands a buffer that another
warpgroup may be reading (k_s) to the epilogue's O tile. Passes (and so fails as strict xfail)
the day TileLang stops merging buffers without the barriers that made it safe."""
import pytest

from ws_lab.upstream import StillBroken, expect_fixed

from ws_lab.upstream import smem_reuse_without_syncs as pin


@pytest.mark.xfail(strict=True, raises=StillBroken,
                   reason="tilelang #2416: smem reuse ignores disabled syncs")
def test_buffers_live_across_warpgroups_are_not_merged():
    expect_fixed(pin.check())
