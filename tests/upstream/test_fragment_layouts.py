"""Two TileLang 0.1.15 fragment-layout behaviours met writing a per-warpgroup row-max stripe
(bundles: python -m ws_lab.repro NAME). Each passes — and so fails as strict xfail — once
TileLang fixes it."""
import re

import pytest

from ws_lab.upstream import SignatureMissing, StillBroken, expect_fixed

from ws_lab.upstream import annotated_fragment_second_warpgroup, stripe_fragment_layout


@pytest.mark.xfail(strict=True, raises=StillBroken,
                   reason="a stripe of a wgmma accumulator gets the whole tile's layout")
def test_stripe_fragment_holds_its_own_registers():
    expect_fixed(stripe_fragment_layout.check())


@pytest.mark.hopper
@pytest.mark.xfail(strict=True, raises=StillBroken,
                   reason="reduce_max over the stripe reads registers nothing wrote")
def test_stripe_row_max_matches_torch():
    result = stripe_fragment_layout.run()
    wrong = re.findall(r"(\d+) of 64", result)  # rows whose maximum is wrong, per warpgroup
    if len(wrong) != 2:
        raise SignatureMissing(f"run() reported {result!r}: recheck this pin")
    if wrong != ["0", "0"]:
        raise StillBroken(result)


@pytest.mark.xfail(strict=True, raises=StillBroken,
                   reason="an annotated layout in `if tx >= 128` drops the branch")
def test_annotated_fragment_in_second_warpgroup_keeps_its_code():
    expect_fixed(annotated_fragment_second_warpgroup.check())
