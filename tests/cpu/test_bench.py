"""The benchmark runner's timing rounds and table, without a GPU (do_bench replaced by a clock
that drifts, as a warming GPU does)."""
import pytest
import triton.testing

from ws_lab import bench, timing


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


def test_rounds_follow_the_shuffled_orders(drifting_do_bench):
    times, failed = timing.time_rounds({n: (lambda n=n: n) for n in "abc"}, rounds=3)
    orders = timing.round_orders(list("abc"), 3)
    assert not failed
    assert drifting_do_bench == [n for order in orders for n in order]
    # a drift of 1 % a call: each time is its base scaled by the call's position in the run
    for name, base in {"a": 1.0, "b": 2.0, "c": 4.0}.items():
        slots = [i for i, n in enumerate(drifting_do_bench) if n == name]
        assert times[name] == pytest.approx([base * (1 + 0.01 * i) for i in slots])


NAMES = ["persistent", "overlap", "overlap-nopp", "coop", "coop-nopp", "sdpa-cudnn",
         "sdpa-flash", "sdpa-efficient", "pipelined", "tileops"]


@pytest.mark.parametrize("names", [list("ab"), list("abc"), NAMES])
def test_no_implementation_is_timed_twice_in_a_row(names):
    orders = timing.round_orders(names, 16)
    assert all(sorted(order) == sorted(names) for order in orders)
    sequence = [n for order in orders for n in order]
    assert all(x != y for x, y in zip(sequence, sequence[1:]))


def test_neighbours_change_from_round_to_round():
    """The bench's own ten implementations over its default 8 rounds: the ends of the old
    fixed order (persistent, tileops) and every other implementation follow several different
    implementations, and no round repeats the one before it."""
    orders = timing.round_orders(NAMES, bench.parse_args([], ["llama8b-4k"]).rounds)
    sequence = [n for order in orders for n in order]
    before = {n: {p for p, x in zip(sequence, sequence[1:]) if x == n} for n in NAMES}
    assert min(len(p) for p in before.values()) >= 3, before
    assert all(a != b for a, b in zip(orders, orders[1:]))
    assert timing.round_orders(NAMES, 8) == orders  # seeded: a rerun times in the same orders


@pytest.mark.parametrize("rounds", [1, 2, 4])
def test_every_implementation_is_timed_once_a_round(drifting_do_bench, rounds):
    timing.time_rounds({n: (lambda n=n: n) for n in "abc"}, rounds=rounds)
    assert sorted(drifting_do_bench) == sorted(list("abc") * rounds)


def test_a_call_that_raises_is_timed_no_more(drifting_do_bench):
    def flaky():
        if drifting_do_bench.count("a") >= 1:  # fails from its second round on
            raise RuntimeError("CUDA out of memory")
        return "a"

    times, failed = timing.time_rounds({"a": flaky, "b": lambda: "b"}, rounds=3)
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
    head = [c.strip(" |") for c in lines[0].split(" | ")]
    assert head[4:6] == ["ms", "spread"]
    coop = [c.strip(" |") for c in lines[2].split(" | ")]
    assert coop[4] == "1.0000" and coop[5] == "2.1%"
    assert coop[head.index("×TileOPs")] == "1.100"  # 1.1 / 1.0
    assert coop[head.index("×FA-CuTe")] == "n/a"  # not measured in this table
    assert lines[4].split(" | ")[5] == "n/a"
    assert "- sdpa-flash s causal: RuntimeError: no" in lines


def test_rounds_must_be_positive():
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", "0"], ["llama8b-4k"])
    assert bench.parse_args(["--rounds", "5"], ["llama8b-4k"]).rounds == 5


@pytest.mark.parametrize("causal", [False, True])
def test_backward_peers_time_the_backward_through_autograd(causal):
    """The backward suite's autograd peer (here SDPA's math backend, which runs on a CPU): one
    forward, then each call replays the backward alone, GQA group sums included, and gives
    the float64 oracle's gradients (a call twice gives them twice: the graph is kept)."""
    import torch

    from ws_lab import bench_bwd, oracle

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 33, 6, 16, generator=gen)
    k, v = (torch.randn(2, 33, 2, 16, generator=gen) for _ in range(2))
    dout = torch.randn(q.shape, generator=gen)
    call = bench_bwd.autograd_impl(bench.sdpa_impl("MATH"))(q, k, v, None, dout, None, causal)
    want = oracle.attention_bwd_ref(q, k, v, dout, causal=causal)
    for grads in (call(), call()):
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
        for got, ref in zip(grads, want):
            assert oracle.rel_l2(got, ref) < 1e-5


def test_the_backward_table_has_the_backward_peers_columns():
    from ws_lab import bench_bwd

    rows = [bench.Row(name, "train8b-4k", 4096, "full", "bfloat16", ms=ms)
            for name, ms in (("bwd-pipelined", 2.0), ("tileops", 1.0), ("sdpa-flash", 4.0))]
    head, _, lab = bench.table(rows, bench_bwd.PEERS).splitlines()[:3]
    assert "×TileOPs" in head and "×FA3" not in head and "×pipelined" not in head
    assert "| 0.500 | 2.000 | n/a | n/a | n/a |" in lab


def test_grpo_floors_follow_the_matmul_flops_and_the_decode_floor():
    """--grpo's floors (ws_lab.bench_rollout.grpo_floors_s): log-probs 1 forward (the
    reference's; one inner step scores no old log-probs), update 3 (a forward and a backward
    of twice its FLOPs), over the layers' matmul parameters on
    every token and the lm_head's on the completion tokens; generate = new × the step floor."""
    from torch import nn

    from ws_lab import bench_rollout, floors

    hf = nn.Module()
    hf.model = nn.Module()
    hf.model.layers = nn.ModuleList([nn.Linear(8, 16), nn.LayerNorm(16)])  # 1-D norms: no FLOPs
    hf.lm_head = nn.Linear(16, 100, bias=False)
    got = bench_rollout.grpo_floors_s(hf, batch=4, prompt=10, new=6, decode_floor_ms=0.5)
    forward = 2 * (8 * 16 * 4 * 16 + 16 * 100 * 4 * 6)
    want = {"generate": 6 * 0.5e-3, "log-probs": forward / (floors.TENSOR_TFLOPS * 1e12),
            "update": 3 * forward / (floors.TENSOR_TFLOPS * 1e12)}
    assert got == pytest.approx(want)


def test_a_grpo_phase_row_reports_cold_apart_from_warm():
    from ws_lab import bench_rollout

    row = bench_rollout.phase_row("update", [2.0, 0.5, 0.7, 0.6], [2**30, 3 * 2**30], 0.1)
    assert row == "| update | 2.000 | 0.600 | 0.500–0.700 | 3.0 | 0.100 | 6.0 |"


def test_fp8_is_a_dtype_with_a_suite_of_its_own():
    """``--dtype fp8`` exists only where a script gives it a suite (bench/coop.py: the FP8
    forward's); its cases are the shapes on the bf16 input sets the e4m3 ones come from."""
    with pytest.raises(SystemExit):
        bench.parse_args(["--dtype", "fp8"], ["llama8b-4k"])
    args = bench.parse_args(["--dtype", "fp8"], ["llama8b-4k"],
                            suite_dtypes={"fp8": "bfloat16"})
    assert [c.dtype for c in args.cases] == ["bfloat16"]


def test_the_fp8_table_has_the_fp8_peers_and_the_bf16_columns():
    from ws_lab import bench_fp8

    rows = [bench.Row(name, "llama8b-4k", 4096, "causal", "fp8", ms=ms)
            for name, ms in (("fp8", 1.0), ("fa3-fp8", 0.8), ("fa3", 1.4))]
    head, _, lab = bench.table(rows, bench_fp8.PEERS).splitlines()[:3]
    assert "×FA3-FP8 | ×TileOPs-FP8 | ×FA3 | ×persistent" in head
    assert "| 0.800 | n/a | 1.400 | n/a |" in lab


@pytest.fixture
def event_clock(monkeypatch):
    """torch.cuda's events, spin and the L2 flush replaced by a clock: a call of name n advances
    it by base[n] · (1 + 0.01 k) ms, k the call's index in the run (a drifting clock); records
    the calls, the flushes and the spins ("hold", cycles) in order."""
    import torch

    log, clock = [], [0.0]

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            self.at = clock[0]

        def elapsed_time(self, end):
            return end.at - self.at

    class Flush:
        def zero_(self):
            log.append("flush")

    def call(name):
        def run():
            k = sum(1 for x in log if x in ("a", "b", "c"))
            log.append(name)
            clock[0] += {"a": 1.0, "b": 2.0, "c": 4.0}[name] * (1 + 0.01 * k)
        return run

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append(("hold", cycles)))
    monkeypatch.setattr(timing, "l2_flush_buffer", Flush)
    return log, call


def test_time_calls_interleaves_call_by_call_and_takes_each_rounds_median(event_clock):
    log, call = event_clock
    times, failed = timing.time_calls({n: call(n) for n in "abc"}, rounds=2, cycles=5)
    assert not failed
    probe, timed = log[:12], log[12:]  # issue_hold_ms' two untimed calls each, unheld
    assert probe == [x for name in "aabbcc" for x in ("flush", name)]
    calls = [x for x in timed if x in ("a", "b", "c")]
    hold = timed[1]
    assert hold[0] == "hold" and hold[1] > 0
    # a flush and the one spin before every timed call
    assert timed == [x for name in calls for x in ("flush", hold, name)]
    cycles = [calls[i:i + 3] for i in range(0, len(calls), 3)]
    assert len(cycles) == 10 and all(sorted(c) == list("abc") for c in cycles)
    assert len({tuple(c) for c in cycles}) > 1  # a fresh order each cycle
    for name, base in {"a": 1.0, "b": 2.0, "c": 4.0}.items():
        slots = [6 + k for k, n in enumerate(calls) if n == name]
        per_call = [base * (1 + 0.01 * k) for k in slots]
        assert times[name] == pytest.approx([per_call[2], per_call[7]])  # each round's median


def test_time_calls_times_a_call_that_raises_no_more(event_clock):
    log, call = event_clock
    ok = call("a")

    def flaky():
        if log.count("a") >= 3:
            raise RuntimeError("CUDA out of memory")
        ok()

    times, failed = timing.time_calls({"a": flaky, "b": call("b")}, rounds=2, cycles=4)
    assert log.count("a") == 3 and log.count("b") == 2 + 8  # b's 2 untimed
    assert list(times) == ["b"] and len(times["b"]) == 2
    assert str(failed["a"]) == "CUDA out of memory"


def test_time_calls_holds_the_device_twice_the_slowest_issue_time(event_clock):
    """'a' takes the host 5 ms to issue: the spin before every timed call lasts at least 10 ms
    at 2 GHz (SPIN_CYCLES_PER_MS), for 'b' too, and nothing is warned."""
    import time
    import warnings

    log, call = event_clock
    fast_a = call("a")

    def slow_a():
        time.sleep(0.005)
        fast_a()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        times, failed = timing.time_calls({"a": slow_a, "b": call("b")}, rounds=1, cycles=3)
    assert not failed and len(times["a"]) == 1
    holds = {x for x in log if isinstance(x, tuple)}
    assert len(holds) == 1 and log.count(next(iter(holds))) == 6
    assert 10 * timing.SPIN_CYCLES_PER_MS <= next(iter(holds))[1] <= 20 * timing.SPIN_CYCLES_PER_MS


def test_time_calls_warns_of_calls_the_host_takes_longer_to_issue_than_the_hold(
        event_clock, monkeypatch):
    """With the hold capped at 1 ms, 'a' (1 ms on the fake device, 5 ms to issue) is warned
    of; 'b' (issued at once) is not."""
    import time

    log, call = event_clock
    fast_a = call("a")

    def slow_a():
        time.sleep(0.005)
        fast_a()

    monkeypatch.setattr(timing, "MAX_HOLD_MS", 1.0)
    with pytest.warns(RuntimeWarning, match=r"time_calls: a takes the host [\d.]+ ms a call") as seen:
        times, failed = timing.time_calls({"a": slow_a, "b": call("b")}, rounds=1, cycles=3)
    assert not failed and len(times["a"]) == 1
    assert [str(w.message).split()[1] for w in seen] == ["a"]


def test_the_bench_takes_the_call_by_call_timer():
    args = bench.parse_args(["--timer", "calls"], ["llama8b-4k"])
    assert bench.TIMERS[args.timer] is timing.time_calls
    assert bench.parse_args([], ["llama8b-4k"]).timer == "rounds"


def test_each_timed_shape_is_printed_and_saved_before_the_next_starts(monkeypatch, tmp_path,
                                                                      capsys):
    """A bench stopped during its second shape (a time limit, here an exception) has already
    printed the first shape's table and written its rows to --json."""
    import json

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "a test device")

    def measure(shape, impls, is_lab, rounds, timer):
        if shape.name == "train8b-4k":
            raise TimeoutError("the second shape never finishes")
        return [bench.Row("pipelined", shape.name, shape.seq_len, "causal", shape.dtype,
                          ms=1.5, round_ms=[1.5])]

    suite = bench.Suite([], lambda kernels: {"pipelined": None}, measure)
    out = tmp_path / "rows.json"
    args = bench.parse_args(["--shape", "llama8b-4k", "--shape", "train8b-4k", "--json",
                             str(out)], ["llama8b-4k"])
    with pytest.raises(TimeoutError):
        bench.run(["pipelined"], args, suite)
    saved = json.loads(out.read_text())
    assert saved["device"] == "a test device"
    assert [(r["impl"], r["shape"], r["ms"]) for r in saved["rows"]] == [
        ("pipelined", "llama8b-4k", 1.5)]
    printed = capsys.readouterr().out
    assert "| pipelined | llama8b-4k |" in printed and "train8b-4k |" not in printed
