"""The GPU grids' parallel pre-compilation (tests/ws/grid.py): every selected case once in a
plain run, none under pytest-xdist, whose workers each build their own cases."""
from tests.ws.grid import precompile


def test_precompile_builds_each_case_once_in_a_plain_run(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    built = []
    precompile([1, 2, 3], built.append)
    assert sorted(built) == [1, 2, 3]


def test_precompile_leaves_the_builds_to_the_xdist_workers(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    built = []
    precompile([1, 2, 3], built.append)
    assert built == []
