"""A bounded-frequency runner: kube-proxy's BoundedFrequencyRunner in Python.

Layer: edge utility (imports only the standard library). One job: call one
function -- the proxier's sync -- often enough and not too often. Callers:
agent.py (the sync loop); tests drive `step()` with a fake clock.

Semantics (kube-proxy `pkg/util/async/bounded_frequency_runner.go`):

- `kick()` requests a run; any number of kicks before the run starts
  collapse into one run.
- Runs are rate-limited by a token bucket: `burst` tokens (default 2), one
  regained every `min_interval`; so at most `burst` runs back to back, then
  at most one per `min_interval`.
- If nothing asked for a run, one happens `max_interval` after the end of
  the previous run (the level-triggered safety net).
- One run at a time: the function is only ever called from the loop.

Failure (fn raised) -- where this runner differs from kube-proxy, on purpose:
kube-proxy retries after syncPeriod (30 s). Here the retry is scheduled at
once, `retry_interval` after the failure, doubling with each consecutive
failure up to `max_interval` (so a persistent failure settles at kube-proxy's
cadence, while a transient one -- EBUSY, a racing external `nft` -- is
repaired within about a second). The failed run's token is given back, so a
failure does not eat the burst the next event will want. While a retry is
pending, kicks do not run early: the retry will include their changes, and
each failed run is a full resync, expensive on a big cluster.

Known limits: the waits use the real monotonic time of
threading.Condition.wait even when a fake clock is injected; tests with a
fake clock therefore call `step()` directly instead of `run()`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

__all__ = ["Runner"]


class Runner:
    """Calls `fn` when kicked, rate-limited, at least every `max_interval`.

    `run()` loops in the caller's thread until `stop()`; `start()` runs that
    loop in a daemon thread. `step()` is one iteration without waiting:
    run `fn` if a run is due and allowed, and say how long to wait.
    """

    def __init__(
        self,
        fn: Callable[[], object],
        *,
        min_interval: float,
        max_interval: float,
        retry_interval: float,
        burst: int = 2,
        clock: Callable[[], float] = time.monotonic,
        name: str = "runner",
        log: logging.Logger | None = None,
    ) -> None:
        if burst < 1:
            raise ValueError(f"burst must be >= 1, got {burst}")
        if max_interval <= 0 or retry_interval <= 0 or min_interval < 0:
            raise ValueError("intervals must be positive (min_interval may be 0)")
        self.fn = fn
        self.min_interval = min_interval
        self.max_interval = max_interval
        self.retry_interval = retry_interval
        self.burst = burst
        self.clock = clock
        self.name = name
        self.log = log or logging.getLogger(__name__)
        self._cond = threading.Condition()  # RLock inside: safe from a signal handler
        self._wakeup = False
        self._pending = False
        self._stopped = False
        self._tokens = float(burst)
        self._stamp: float | None = None  # last token refill; None until the first step
        self._deadline = math.inf  # the max_interval run
        self._retry_at: float | None = None
        self._failures = 0
        self._running = threading.Lock()
        self._thread: threading.Thread | None = None
        self.runs = 0
        """Completed calls of fn, failed ones included (for tests and logs)."""

    # ---- requests -----------------------------------------------------------

    def kick(self) -> None:
        """Ask for a run as soon as the rate limit allows. Thread-safe, cheap."""
        with self._cond:
            self._pending = True
            self._wakeup = True
            self._cond.notify_all()

    @property
    def failures(self) -> int:
        """Consecutive failed runs (0 after a success)."""
        return self._failures

    # ---- one iteration ----------------------------------------------------------

    def step(self) -> float:
        """Run fn now if a run is due and the rate limit allows it; return
        the seconds until the next step should be taken (0: at once)."""
        with self._running:
            with self._cond:
                self._wakeup = False
                now = self.clock()
                delay = self._delay_locked(now)
                if delay > 0 or self._stopped:
                    return delay
                self._tokens -= 1
                self._pending = False
            error = self._call()
            with self._cond:
                end = self.clock()
                self._finish_locked(end, error)
                return self._delay_locked(end)

    def _call(self) -> Exception | None:
        try:
            self.fn()
        except Exception as exc:  # fn logs what it knows; the runner only retries
            self.log.debug("%s: run failed", self.name, exc_info=True)
            return exc
        finally:
            self.runs += 1
        return None

    def _finish_locked(self, end: float, error: Exception | None) -> None:
        self._deadline = end + self.max_interval
        if error is None:
            self._failures = 0
            self._retry_at = None
            return
        self._failures += 1
        self._tokens = min(float(self.burst), self._tokens + 1)  # a failure keeps its token
        backoff = min(self.retry_interval * 2 ** (self._failures - 1), self.max_interval)
        self._retry_at = end + max(backoff, self.retry_interval)
        self.log.warning(
            "%s: run failed; retrying", self.name,
            extra={
                "retry_in": round(self._retry_at - end, 3),
                "failures": self._failures,
                "error": f"{type(error).__name__}: {error}",
            },
        )

    def _delay_locked(self, now: float) -> float:
        """0 if a run may start now, else the seconds until one might."""
        if self._stamp is None:
            self._stamp = now
            self._deadline = now + self.max_interval
        self._refill(now)
        if self._retry_at is not None:
            if now < self._retry_at:
                return self._retry_at - now
            due = True
        else:
            due = self._pending or now >= self._deadline
        if not due:
            return self._deadline - now
        if self._tokens >= 1 or self.min_interval <= 0:
            return 0.0
        return (1 - self._tokens) * self.min_interval

    def _refill(self, now: float) -> None:
        assert self._stamp is not None
        if self.min_interval <= 0:
            self._tokens = float(self.burst)
        elif now > self._stamp:
            gained = (now - self._stamp) / self.min_interval
            self._tokens = min(float(self.burst), self._tokens + gained)
        self._stamp = max(self._stamp, now)

    # ---- the loop -----------------------------------------------------------------

    def run(self) -> None:
        """Loop in the calling thread until stop()."""
        while True:
            delay = self.step()
            with self._cond:
                if self._stopped:
                    return
                if delay > 0:
                    self._cond.wait_for(lambda: self._stopped or self._wakeup, timeout=delay)
                if self._stopped:
                    return

    def start(self) -> None:
        """Run the loop in a daemon thread."""
        if self._thread is not None:
            raise RuntimeError(f"{self.name} already started")
        self._thread = threading.Thread(target=self.run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """End the loop (after a run in progress finishes) and wait for the
        thread started by start(). Idempotent; later kicks do nothing."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    @property
    def stopped(self) -> bool:
        return self._stopped
