"""The benchmark runner's timing rounds and table, without a GPU (do_bench replaced by a clock
that drifts, as a warming GPU does)."""
import pytest
import triton.testing

from ws_lab import bench


@pytest.fixture
def drifting_do_bench(monkeypatch):
    """do_bench stand-in: the n-th call takes base[name] · (1 + 0.01 n) ms; records the order."""
    calls = []

    def fake(fn, warmup, rep, return_mode):
        assert return_mode == "median"
        name = fn()
        calls.append(name)
        return {"a": 1.0, "b": 2.0, "c": 4.0}[name] * (1 + 0.01 * (len(calls) - 1))

    monkeypatch.setattr(triton.testing, "do_bench", fake)
    return calls


def test_rounds_alternate_the_order(drifting_do_bench):
    times, failed = bench.time_rounds({n: (lambda n=n: n) for n in "abc"}, rounds=3)
    assert not failed
    assert drifting_do_bench == list("abc" + "cba" + "abc")
    assert {n: len(t) for n, t in times.items()} == {"a": 3, "b": 3, "c": 3}
    # a drift of 1 % a call: 'a' sees calls 0, 5, 6 and 'c' calls 2, 3, 8
    assert times["a"] == pytest.approx([1.0, 1.05, 1.06])
    assert times["c"] == pytest.approx([4.08, 4.12, 4.32])


@pytest.mark.parametrize("rounds", [1, 2, 4])
def test_every_implementation_is_timed_once_a_round(drifting_do_bench, rounds):
    bench.time_rounds({n: (lambda n=n: n) for n in "abc"}, rounds=rounds)
    assert sorted(drifting_do_bench) == sorted(list("abc") * rounds)


def test_a_call_that_raises_is_timed_no_more(drifting_do_bench):
    def flaky():
        if drifting_do_bench.count("a") >= 1:  # fails from its second round on
            raise RuntimeError("CUDA out of memory")
        return "a"

    times, failed = bench.time_rounds({"a": flaky, "b": lambda: "b"}, rounds=3)
    assert drifting_do_bench == ["a", "b", "b", "b"]
    assert list(times) == ["b"] and len(times["b"]) == 3
    assert str(failed["a"]) == "CUDA out of memory"


def test_table_shows_spread_and_gaps():
    rows = [bench.Row("coop", "s", 4096, "causal", "float16", ms=1.0, tflops=500.0,
                      rel_err=2.6e-4, spread=0.021),
            bench.Row("tileops", "s", 4096, "causal", "float16", ms=1.1, tflops=455.0,
                      rel_err=2.6e-4, spread=0.004),
            bench.Row("sdpa-flash", "s", 4096, "causal", "float16", note="RuntimeError: no")]
    lines = bench.table(rows).splitlines()
    assert lines[0].split(" | ")[4:6] == ["ms", "spread"]
    coop = lines[2].split(" | ")
    assert coop[4] == "1.0000" and coop[5] == "2.1%"
    assert coop[-1].rstrip(" |") == "1.100"  # ×TileOPs = 1.1 / 1.0
    assert lines[4].split(" | ")[5] == "n/a"
    assert "- sdpa-flash s causal: RuntimeError: no" in lines


def test_rounds_must_be_positive():
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", "0"], ["llama8b-4k"])
    assert bench.parse_args(["--rounds", "5"], ["llama8b-4k"]).rounds == 5
