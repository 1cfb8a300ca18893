"""TileLang 0.1.15's default (tvm_ffi) launcher drops programmatic dependent launch for a kernel
holding T.pdl_sync (bundle: python -m ws_lab.repro pdl_launch_dropped). Passes — and so fails as
strict xfail — once it launches such a kernel as the cython launcher does."""
import re

import pytest

from ws_lab.upstream import SignatureMissing, StillBroken, expect_fixed

from ws_lab.upstream import pdl_launch_dropped as pin


@pytest.mark.xfail(strict=True, raises=StillBroken,
                   reason="tvm_ffi launches a T.pdl_sync kernel without the PDL attribute")
def test_the_default_launcher_launches_a_pdl_kernel_as_a_dependent():
    expect_fixed(pin.check())


@pytest.mark.hopper
@pytest.mark.xfail(strict=True, raises=StillBroken,
                   reason="under tvm_ffi the dependent starts after its primary has ended")
def test_a_dependent_starts_while_its_primary_runs_under_the_default_launcher():
    result = pin.run()
    reads = dict(re.findall(r"(tvm_ffi|cython): (\[-?\d+, -?\d+\])", result))
    if reads.get("cython") != "[0, 1]":  # the control: PDL live through cython
        raise SignatureMissing(f"run() reported {result!r}: recheck this pin")
    if reads.get("tvm_ffi") != "[0, 1]":
        raise StillBroken(result)
