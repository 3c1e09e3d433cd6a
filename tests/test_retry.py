"""cluster/retry.py: the informers' delays and the log lines of an outage.

Aspects: the steps double from the initial delay to the cap, jittered down
to at most half; a success or a new kind of failure starts over; while there
is no answer the delay never exceeds `unreachable_max`, however long the
outage; Retry-After replaces the step, bounded by the cap; an answered error
after a long outage waits the initial step; one WARNING per outage (again
only every 5 minutes), one INFO when it ends; a round without progress goes
on at once the first time and backs off when repeated.
"""

from __future__ import annotations

import logging

import pytest

from nftproxy.cluster.retry import Backoff, Retry

LOG = "test.retry"


def _steps(backoff: Backoff, count: int, kind: str = "", **kw: float) -> list[float]:
    return [backoff.next(kind, **kw) for _ in range(count)]


def test_steps_double_from_the_initial_delay_to_the_cap() -> None:
    backoff = Backoff(0.8, 30.0, random=lambda: 0.0)  # no jitter
    assert _steps(backoff, 8) == pytest.approx([0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 30.0, 30.0])


def test_jitter_takes_a_step_down_to_half_never_up() -> None:
    assert _steps(Backoff(0.8, 30.0, random=lambda: 0.999999), 7) == pytest.approx(
        [0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 15.0], rel=1e-5)
    assert Backoff(0.8, 30.0, random=lambda: 0.5).next() == pytest.approx(0.6)


def test_a_reset_or_a_new_kind_starts_over() -> None:
    backoff = Backoff(0.8, 30.0, random=lambda: 0.0)
    assert _steps(backoff, 3, "a") == pytest.approx([0.8, 1.6, 3.2])
    backoff.reset()
    assert _steps(backoff, 2, "a") == pytest.approx([0.8, 1.6])
    assert _steps(backoff, 2, "b") == pytest.approx([0.8, 1.6])


def test_a_per_call_cap_bounds_every_step() -> None:
    backoff = Backoff(0.8, 30.0, random=lambda: 0.0)
    assert max(_steps(backoff, 100, cap=1.0)) == 1.0


def test_retry_after_replaces_the_step_within_the_cap() -> None:
    backoff = Backoff(0.8, 30.0, random=lambda: 0.0)
    assert backoff.next(retry_after=1.0) == 1.0
    assert backoff.next(retry_after=600.0) == 30.0
    assert backoff.next(retry_after=-5.0) == 0.0
    assert backoff.next() == pytest.approx(6.4)  # the streak went on meanwhile


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _retry(clock: Clock) -> Retry:
    return Retry("services", initial=0.8, cap=30.0, unreachable_max=1.0, clock=clock,
                 random=lambda: 0.5, log=logging.getLogger(LOG))


def _levels(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.levelname for r in caplog.records if r.name == LOG]


def test_no_answer_waits_at_most_unreachable_max_however_long() -> None:
    clock = Clock()
    retry = _retry(clock)
    delays = []
    for _ in range(200):  # an hour of refused connections
        delays.append(retry.failed("refused", unreachable=True))
        clock.now += delays[-1]
    assert delays[0] == pytest.approx(0.6)
    assert max(delays) == pytest.approx(0.75)  # 1 s, jittered down
    # the server answers, with errors: the initial step, not the outage's streak
    assert retry.failed("HTTP 503", unreachable=False) == pytest.approx(0.6)
    assert retry.failed("HTTP 503", unreachable=False) == pytest.approx(1.2)
    assert retry.failed("HTTP 429", unreachable=False, retry_after=1.0) == 1.0


def test_one_warning_per_outage_and_one_info_when_it_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOG)
    clock = Clock()
    retry = _retry(clock)
    for _ in range(10):
        clock.now += retry.failed("ConnectionRefusedError: refused", unreachable=True)
    assert _levels(caplog) == ["WARNING"] + ["DEBUG"] * 9
    assert "ConnectionRefusedError: refused" in caplog.records[0].getMessage()
    clock.now += 2.0
    retry.succeeded()
    retry.succeeded()  # no outage: nothing to say
    assert _levels(caplog)[10:] == ["INFO"]
    assert "recovered after" in caplog.records[-1].getMessage()
    assert retry.last_outage == pytest.approx(clock.now - 1000.0)
    assert retry.outages == 1

    caplog.clear()
    for _ in range(1000):  # a long outage: a reminder every 5 minutes, no more
        clock.now += retry.failed("refused", unreachable=True)
    warnings = _levels(caplog).count("WARNING")
    assert 1 < warnings <= 1 + (1000 * 0.75) // 300 + 1
    assert retry.outages == 2


def test_a_round_without_progress_goes_on_at_once_then_backs_off() -> None:
    retry = _retry(Clock())
    assert retry.stall() == 0.0  # e.g. one 410: re-list at once
    assert [retry.stall() for _ in range(3)] == pytest.approx([0.6, 1.2, 2.4])  # a loop
    retry.progress()
    assert retry.stall() == 0.0
    retry.succeeded()  # a success is not progress: the loop goes on backing off
    assert retry.stall() == pytest.approx(0.6)
