"""Runner: kube-proxy's bounded-frequency runner.

Aspects: kicks collapse into one run; a burst of 2 back to back, then one
per min interval; a run every max interval without kicks; a failed run is
retried after retry_interval (doubling up to max_interval) and keeps its
token; kicks wait during a retry backoff; start/stop with a thread; one run
at a time. Scheduling is checked with a fake clock through step(); only the
threading tests use the real clock, with millisecond intervals.
"""

from __future__ import annotations

import threading
import time

import pytest

from nftproxy.agent.runner import Runner


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Fn:
    """A run function that records call times and fails on demand."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.calls: list[float] = []
        self.fail = False

    def __call__(self) -> None:
        self.calls.append(self.clock.now)
        if self.fail:
            raise RuntimeError("commit refused")


def make(
    *, min_interval: float = 1.0, max_interval: float = 30.0, retry_interval: float = 1.0,
    burst: int = 2,
) -> tuple[Runner, Fn, FakeClock]:
    clock = FakeClock()
    fn = Fn(clock)
    runner = Runner(
        fn, min_interval=min_interval, max_interval=max_interval,
        retry_interval=retry_interval, burst=burst, clock=clock,
    )
    return runner, fn, clock


def test_nothing_runs_without_a_kick_until_the_max_interval() -> None:
    runner, fn, clock = make()
    assert runner.step() == pytest.approx(30.0)
    clock.advance(29.9)
    assert runner.step() == pytest.approx(0.1)
    assert fn.calls == []
    clock.advance(0.1)
    runner.step()
    assert fn.calls == [1030.0]


def test_a_kick_runs_at_once_and_kicks_before_a_run_collapse_into_one() -> None:
    runner, fn, _ = make()
    runner.kick()
    runner.kick()
    runner.kick()
    delay = runner.step()
    assert fn.calls == [1000.0]
    assert delay == pytest.approx(30.0)  # nothing pending: next is the max-interval run


def test_burst_of_two_then_one_per_min_interval() -> None:
    runner, fn, clock = make()
    runner.kick()
    runner.step()
    runner.kick()
    runner.step()
    assert len(fn.calls) == 2  # the burst
    runner.kick()
    delay = runner.step()
    assert len(fn.calls) == 2
    assert delay == pytest.approx(1.0)  # until one token is back
    clock.advance(0.5)
    assert runner.step() == pytest.approx(0.5)
    clock.advance(0.5)
    runner.step()
    assert fn.calls == [1000.0, 1000.0, 1001.0]
    runner.kick()
    clock.advance(0.25)
    assert runner.step() == pytest.approx(0.75)


def test_the_burst_refills_after_a_quiet_period() -> None:
    runner, fn, clock = make(min_interval=2.0)
    for _ in range(2):
        runner.kick()
        runner.step()
    clock.advance(10.0)
    for _ in range(2):
        runner.kick()
        runner.step()
    assert len(fn.calls) == 4
    runner.kick()
    assert runner.step() == pytest.approx(2.0)


def test_the_max_interval_counts_from_the_end_of_the_last_run() -> None:
    runner, fn, clock = make(max_interval=10.0)
    clock.advance(4.0)
    runner.kick()
    assert runner.step() == pytest.approx(10.0)
    clock.advance(10.0)
    runner.step()
    assert fn.calls == [1004.0, 1014.0]


def test_a_failed_run_is_retried_after_retry_interval_doubling_up_to_max() -> None:
    runner, fn, clock = make(retry_interval=1.0, max_interval=5.0, min_interval=0.1)
    fn.fail = True
    runner.kick()
    delays = []
    for _ in range(5):
        delays.append(runner.step())
        clock.advance(delays[-1])
    assert delays == pytest.approx([1.0, 2.0, 4.0, 5.0, 5.0])
    assert runner.failures == 5
    fn.fail = False
    runner.step()
    assert runner.failures == 0
    assert runner.step() == pytest.approx(5.0)  # back to the max interval


def test_kicks_during_a_retry_backoff_wait_for_the_retry() -> None:
    runner, fn, clock = make(retry_interval=3.0)
    fn.fail = True
    runner.kick()
    runner.step()
    fn.fail = False
    clock.advance(1.0)
    runner.kick()
    assert runner.step() == pytest.approx(2.0)
    assert len(fn.calls) == 1
    clock.advance(2.0)
    runner.step()
    assert fn.calls == [1000.0, 1003.0]


def test_a_failed_run_does_not_burn_the_burst() -> None:
    runner, fn, clock = make(retry_interval=0.5, min_interval=1.0)
    fn.fail = True
    runner.kick()
    runner.step()  # fails at 1000: its token is given back
    fn.fail = False
    clock.advance(0.5)
    runner.step()  # the retry at 1000.5 takes one token (1.5 left)
    runner.kick()
    runner.step()  # the burst's second token: runs at once
    assert fn.calls == [1000.0, 1000.5, 1000.5]


def test_a_failed_run_is_retried_without_a_kick() -> None:
    runner, fn, clock = make(retry_interval=1.0)
    fn.fail = True
    runner.kick()
    runner.step()
    fn.fail = False
    clock.advance(1.0)
    runner.step()
    assert len(fn.calls) == 2


def test_min_interval_zero_never_limits() -> None:
    runner, fn, _ = make(min_interval=0.0)
    for _ in range(5):
        runner.kick()
        assert runner.step() > 0
    assert len(fn.calls) == 5


def test_invalid_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        Runner(lambda: None, min_interval=1, max_interval=0, retry_interval=1)
    with pytest.raises(ValueError):
        Runner(lambda: None, min_interval=1, max_interval=1, retry_interval=1, burst=0)


# ---- threads (real clock, millisecond intervals) ------------------------------------


def test_start_runs_on_kick_and_stop_ends_the_thread() -> None:
    ran = threading.Event()
    runner = Runner(ran.set, min_interval=0.001, max_interval=60, retry_interval=0.01)
    runner.start()
    try:
        runner.kick()
        assert ran.wait(2)
    finally:
        runner.stop(timeout=2)
    assert runner._thread is not None and not runner._thread.is_alive()
    runs = runner.runs
    runner.kick()
    time.sleep(0.01)
    assert runner.runs == runs  # stopped: kicks do nothing
    runner.stop()  # idempotent


def test_run_in_the_callers_thread_returns_after_stop() -> None:
    runner = Runner(lambda: None, min_interval=0.001, max_interval=60, retry_interval=0.01)
    stopper = threading.Timer(0.02, runner.stop)
    stopper.start()
    started = time.monotonic()
    runner.run()
    assert time.monotonic() - started < 2


def test_one_run_at_a_time_and_kicks_during_a_run_cause_one_more() -> None:
    inside = threading.Event()
    release = threading.Event()
    active = 0
    overlap = False
    lock = threading.Lock()

    def fn() -> None:
        nonlocal active, overlap
        with lock:
            active += 1
            overlap |= active > 1
        inside.set()
        release.wait(2)
        with lock:
            active -= 1

    runner = Runner(fn, min_interval=0.0, max_interval=60, retry_interval=0.01)
    runner.start()
    try:
        runner.kick()
        assert inside.wait(2)
        for _ in range(5):
            runner.kick()
        release.set()
        deadline = time.monotonic() + 2
        while runner.runs < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.02)
    finally:
        runner.stop(timeout=2)
    assert not overlap
    assert runner.runs == 2


def test_stop_waits_for_a_run_in_progress() -> None:
    inside = threading.Event()
    finished = threading.Event()

    def fn() -> None:
        inside.set()
        time.sleep(0.05)
        finished.set()

    runner = Runner(fn, min_interval=0.0, max_interval=60, retry_interval=0.01)
    runner.start()
    runner.kick()
    assert inside.wait(2)
    runner.stop(timeout=2)
    assert finished.is_set()


def test_a_raising_fn_does_not_end_the_loop() -> None:
    calls = 0
    done = threading.Event()

    def fn() -> None:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise RuntimeError("refused")
        done.set()

    runner = Runner(fn, min_interval=0.0, max_interval=60, retry_interval=0.005)
    runner.start()
    try:
        runner.kick()
        assert done.wait(2)
    finally:
        runner.stop(timeout=2)
    assert calls == 3
