"""TileLang 0.1.15 cannot build a ``T.reshape`` / ``T.view`` of 2^31 bits or more (bundle:
python -m ws_lab.repro reshape_past_int32_bits). Passes — and so fails as strict xfail — once
the 2^26-element fp32 view builds."""
import pytest

from ws_lab.upstream import StillBroken, expect_fixed
from ws_lab.upstream import reshape_past_int32_bits as pin


@pytest.mark.xfail(strict=True, raises=StillBroken,
                   reason="T.reshape's size check overflows int32 at 2^31 bits")
def test_a_view_of_two_to_the_31_bits_builds():
    expect_fixed(pin.check())
