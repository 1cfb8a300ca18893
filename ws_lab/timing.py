"""The one timing loop of every runner: interleaved rounds, each in a fresh seeded shuffle
(``round_orders``), each implementation timed once a round by a timer (``do_bench_ms`` for
kernels that run long enough to time from the host, ``graph_replay_us`` for µs-scale decode
kernels, the rollout's own per-step figure for whole loops), and input sets rotated so that no
timing measures the L2 (``rotation_count``). ``time_calls`` interleaves finer, call by call,
for kernels that run power-bound (the clock moves between one implementation's do_bench
window and the next's)."""
from __future__ import annotations

import itertools
import math
import random
import statistics
import time
import warnings
from typing import Callable

ROTATE_L2_MULTIPLE = 4  # rotating input sets hold this many times the L2 together
ROUND_WARMUP_MS, ROUND_REP_MS = 50, 250  # do_bench_ms: per implementation and round
ROUND_ORDER_SEED = 0
CYCLES_PER_ROUND = 10  # time_calls: calls of each implementation a round
L2_FLUSH_BYTES = 256 << 20  # what do_bench zeroes before each call, more than any L2
# time_calls: before each call's start event the device spins HOLD_MARGIN × the slowest call's
# host issue time (within [MIN_HOLD_MS, MAX_HOLD_MS]), so the whole call is queued when its
# timing starts
HOLD_MARGIN, MIN_HOLD_MS, MAX_HOLD_MS = 2.0, 0.05, 20.0
SPIN_CYCLES_PER_MS = 2_000_000  # ≥ any Hopper SM clock (1980 MHz): the spin lasts ≥ its ms


def rotation_count(set_bytes: int, device, cap: int) -> int:
    """How many input sets of ``set_bytes`` to cycle through so that no timing measures the L2
    (at most ``cap``)."""
    import torch

    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return min(cap, max(1, math.ceil(ROTATE_L2_MULTIPLE * l2 / set_bytes)))


def round_orders(names: list[str], rounds: int, seed: int = ROUND_ORDER_SEED) -> list[list[str]]:
    """The timing order of each round: a seeded shuffle of ``names`` per round, none timed
    twice in a row across a round boundary. A fixed order reversed every other round gave each
    implementation the same neighbours and timed the two ends twice back to back; in run 37
    (notes/coop_overlap.md) the ends' round medians moved 1-4 % between forward and reversed
    rounds, with a sign that changed from shape to shape. Shuffled neighbours turn that bias
    into round-to-round spread, which the median absorbs."""
    rng = random.Random(seed)
    orders, last = [], None
    for _ in range(rounds):
        order = list(names)
        rng.shuffle(order)
        if len(order) > 1 and order[0] == last:
            order.append(order.pop(0))  # the previous round's last goes to this round's end
        orders.append(order)
        last = order[-1]
    return orders


def do_bench_ms(fn: Callable) -> float:
    """Median ms of ``fn`` by ``triton.testing.do_bench`` (device events, after a warm-up)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=ROUND_WARMUP_MS, rep=ROUND_REP_MS,
                                   return_mode="median")


def cycling(calls: list[Callable]) -> Callable:
    """One zero-argument callable that runs ``calls`` in turn (one per input set)."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def graph_replay_us(calls: list[Callable]) -> float:
    """Median µs of CUDA-graph replays, the call cycling through ``calls`` (one per input set):
    decode kernels run for tens of µs, less than one Python call of their wrapper, so plain
    do_bench would time the host. Falls back to do_bench for a call that cannot be captured."""
    import torch
    import triton.testing

    fn = cycling(calls)
    try:
        return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    except RuntimeError:
        torch.cuda.synchronize()
        return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def time_rounds(calls: dict[str, Callable], rounds: int, timer: Callable = None):
    """``timer(call)`` (default ``do_bench_ms``) of each callable in each of ``rounds`` rounds,
    in the orders of ``round_orders``. Returns ({name: time per round}, {name: exception}); a
    call that raises is timed no more and left out of the first dict."""
    timer = timer or do_bench_ms
    times, failed = {name: [] for name in calls}, {}
    for order in round_orders(list(calls), rounds):
        for name in order:
            if name in failed:
                continue
            try:
                times[name].append(timer(calls[name]))
            except Exception as exc:  # e.g. out of memory beside the others' inputs
                failed[name] = exc
    return {n: t for n, t in times.items() if n not in failed}, failed


def time_calls(calls: dict[str, Callable], rounds: int, cycles: int = CYCLES_PER_ROUND,
               seed: int = ROUND_ORDER_SEED):
    """Call-by-call interleaving: each round is ``cycles`` cycles, each cycle calls every
    implementation once in a fresh seeded shuffle, the L2 flushed before each call and device
    events around it; a round's figure (ms) is the median of its ``cycles`` calls. Every
    implementation meets the same clock: one implementation's back-to-back do_bench windows
    read 703, 752 and 730 µs on a power-bound backward (notes/bwd.md, "Session 60"). Before
    each start event the device spins ``issue_hold_ms`` so that a call the host issues slower
    than the device runs it is timed whole, not the host (notes/bwd.md, "Session 62"). Returns
    what ``time_rounds`` does, and warns of an implementation whose calls took the host longer
    to issue than the hold (``warn_host_bound``)."""
    import torch

    flush = l2_flush_buffer()
    hold_ms = issue_hold_ms(calls, flush)
    rng = random.Random(seed)
    times, failed = {name: [] for name in calls}, {}
    host_ms = {name: [] for name in calls}
    for _ in range(rounds):
        events = {name: [] for name in calls if name not in failed}
        for _ in range(cycles):
            order = list(events)
            rng.shuffle(order)
            for name in order:
                if name in failed:
                    continue
                try:
                    *pair, host = _timed_call(calls[name], flush, hold_ms)
                except Exception as exc:  # e.g. out of memory beside the others' inputs
                    failed[name] = exc
                    continue
                events[name].append(pair)
                host_ms[name].append(host)
        torch.cuda.synchronize()
        for name, pairs in events.items():
            if name not in failed:
                times[name].append(statistics.median(a.elapsed_time(b) for a, b in pairs))
    times = {n: t for n, t in times.items() if n not in failed}
    warn_host_bound(times, host_ms, hold_ms)
    return times, failed


def issue_hold_ms(calls: dict[str, Callable], flush) -> float:
    """``time_calls``' spin before each start event: HOLD_MARGIN × the longest host issue time
    of any call (the second of two untimed calls each; the first may compile), within
    [MIN_HOLD_MS, MAX_HOLD_MS]. One hold for all: every implementation meets the same idle
    pattern."""
    import torch

    longest = 0.0
    for call in calls.values():
        for _ in range(2):
            try:
                *_, host = _timed_call(call, flush, 0.0)
            except Exception:  # time_calls' own loop records the failure
                break
        else:
            longest = max(longest, host)
    torch.cuda.synchronize()
    return min(MAX_HOLD_MS, max(MIN_HOLD_MS, HOLD_MARGIN * longest))


def warn_host_bound(times: dict[str, list[float]], host_ms: dict[str, list[float]],
                    hold_ms: float):
    """A call whose host side (Python, launches) outlasts the hold before its start event may
    leave the device idle between its events: its figure may be the host's (the 85 µs Qwen
    backward took 0.25–0.33 ms to issue; notes/bwd.md, "Session 61"). do_bench's windows have
    no hold."""
    for name in times:
        host = statistics.median(host_ms[name])
        if host >= hold_ms:
            warnings.warn(f"time_calls: {name} takes the host {host:.3f} ms a call to issue, "
                          f"more than the {hold_ms:.3f} ms hold before its timing: its figure "
                          "may be the host's", RuntimeWarning, stacklevel=3)


def l2_flush_buffer():
    """``time_calls``' flush: zeroed before each call, as do_bench does."""
    import torch

    return torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")


def _timed_call(call: Callable, flush, hold_ms: float):
    """One call of ``time_calls`` after the L2 flush and a device spin of ``hold_ms``: its
    (start, end) device events and the host's ms to issue it."""
    import torch

    flush.zero_()
    if hold_ms:
        torch.cuda._sleep(int(hold_ms * SPIN_CYCLES_PER_MS))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    issued = time.perf_counter()
    call()
    host = (time.perf_counter() - issued) * 1e3
    end.record()
    return start, end, host


def failure_note(exc: Exception) -> str:
    """The one line a table shows for an implementation that could not run or be timed."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
