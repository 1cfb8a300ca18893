"""Shared-memory reuse by program order gives an operand of an in-flight wgmma (issued, not yet
retired by ``T.wait_wgmma``) to a buffer stored before that wait. Passes (and so fails as strict
xfail) the day TileLang keeps such an operand live until the wait."""
import pytest

from ws_lab.upstream import StillBroken, expect_fixed

from ws_lab.upstream import smem_reuse_past_async_wgmma as pin


@pytest.mark.xfail(strict=True, raises=StillBroken,
                   reason="shared-memory reuse ignores wgmma reads still in flight")
def test_an_operand_of_an_in_flight_wgmma_keeps_its_bytes():
    expect_fixed(pin.check())
