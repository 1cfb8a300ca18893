"""The pins' three outcomes: a strict xfail accepts only StillBroken (the bug's signature is in
the code), a fix passes (and the strict xfail reports it), and a check that finds neither the
signature nor the fixed form is a hard error — codegen changed, the pin must be rechecked."""
import pytest

from ws_lab.upstream import (Outcome, SignatureMissing, StillBroken, expect_fixed, verdict)


@pytest.mark.parametrize("bug,fixed,outcome", [(True, False, Outcome.BUG),
                                               (False, True, Outcome.FIXED),
                                               (False, False, Outcome.MISSING),
                                               (True, True, Outcome.MISSING)])
def test_verdict(bug, fixed, outcome):
    assert verdict(bug, fixed, "detail").outcome is outcome


def test_only_the_bug_signature_is_what_a_strict_xfail_expects():
    with pytest.raises(StillBroken, match="detail"):
        expect_fixed(verdict(True, False, "detail"))
    with pytest.raises(SignatureMissing, match="codegen changed: recheck this pin"):
        expect_fixed(verdict(False, False, "detail"))
    assert not issubclass(SignatureMissing, StillBroken)
    expect_fixed(verdict(False, True, "detail"))  # fixed: no exception
