"""TileLang 0.1.15 refuses e4m3 P, copied from a wgmma accumulator, as an RS operand (bundle:
python -m ws_lab.repro e4m3_register_operand). Passes — and so fails as strict xfail — once
TileLang lowers the plain copy to an e4m3 wgmma_rs."""
import pytest

from ws_lab.upstream import StillBroken, e4m3_register_operand, expect_fixed


@pytest.mark.xfail(strict=True, raises=StillBroken,
                   reason="e4m3 P from an accumulator: layout infer conflict for an RS operand")
def test_e4m3_probs_copy_is_a_register_operand():
    expect_fixed(e4m3_register_operand.check())
