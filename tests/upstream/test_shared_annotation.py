"""TileLang 0.1.15 binds parameters that share one ``T.Tensor`` annotation object to one buffer
(bundle: python -m ws_lab.repro shared_annotation_aliases_params). Passes — and so fails as
strict xfail — once TileLang gives each parameter its own buffer or refuses the sharing."""
import pytest

from ws_lab.upstream import StillBroken, expect_fixed

from ws_lab.upstream import shared_annotation_aliases_params as pin


@pytest.mark.xfail(strict=True, raises=StillBroken,
                   reason="a shared T.Tensor annotation makes its parameters one buffer")
def test_parameters_sharing_an_annotation_keep_their_own_buffers():
    expect_fixed(pin.check())
