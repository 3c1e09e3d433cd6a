"""How an informer retries: the delays, and the log lines of an outage.

Layer: sources (cluster; imports nothing from nftproxy; no I/O but logging).
One job: after each failed list or watch, say how long the informer waits;
after a success, start over and say once that the API server is back.
Caller: cluster/informer.py (one `Retry` per informer, used by its thread
only).

The schedule is client-go's reflector backoff (0.8 s initial, factor 2, cap
30 s), jittered *down* (between half and all of the step, so the cap is a
true bound), with two differences that bring an informer back within about
a second of the API server:
- every success (a list completed, a watch answered) starts the schedule
  over; client-go waits for two minutes without a failure;
- failures are of two kinds, each with its own streak:
  * *no answer* (connection refused or reset, connect or read timeout, the
    stream cut): the delay is capped at `unreachable_max` (1 s by default),
    so once the server listens again the informer is back within a second,
    however long the outage lasted. A cap, not a probe: a refused
    connection costs the server nothing (it is not there); a probe would be
    a second request path that must then wake the informers anyway, while
    the cap keeps one path. The price: one connection attempt per informer
    per second during an outage (four per node);
  * *an answer* (HTTP 5xx/429/403..., an ERROR event, a bad body): the full
    schedule, so a struggling server is not hammered -- but `Retry-After`
    is obeyed (the API server sends `Retry-After: 1` with 429 while its
    watch cache initialises after a restart), and a server that answers
    errors after an outage starts at the schedule's first step, not where
    the outage's streak had got to.
A round without progress -- a 410, or a watch that ended at once with no
event -- goes on at once the first time (so 410 means exactly one re-list,
right away); a loop of them (a 410 right after the re-list, a server that
closes every watch at once) backs off on the same schedule.

Log lines: one WARNING at the first failure of an outage, with the cause
(an ERROR for a TLS or auth failure, and again if such a cause changes;
only DEBUG lines when the caller explained the outage in its own ERROR);
DEBUG for each retry, and a WARNING again only every `_WARN_EVERY` while it
lasts; one INFO when the server answers again, saying after how long.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Backoff", "Retry"]

_WARN_EVERY = 300.0  # while requests keep failing, a WARNING again after this long


@dataclass
class Backoff:
    """Delays for one retrying loop (mutable: the loop's own state)."""

    initial: float
    cap: float
    random: Callable[[], float]  # in [0, 1): the jitter
    factor: float = 2.0
    streak: int = field(default=0, init=False)  # consecutive failures of `kind`
    kind: str = field(default="", init=False)

    def next(self, kind: str = "", *, cap: float | None = None,
             retry_after: float | None = None) -> float:
        """The delay after one more failure of `kind` (another kind starts a
        new streak): the step min(cap, initial * factor**streak) times a
        jitter in (0.5, 1], or `retry_after` when the server gave one; both
        bounded by `cap` and the overall cap."""
        if kind != self.kind:
            self.kind, self.streak = kind, 0
        limit = self.cap if cap is None else min(cap, self.cap)
        step = min(limit, self.initial * self.factor ** min(self.streak, 64))
        self.streak += 1
        if retry_after is not None:
            return min(limit, max(0.0, retry_after))
        return step * (1.0 - 0.5 * self.random())

    def reset(self) -> None:
        """A success: the next failure waits the initial step again."""
        self.kind, self.streak = "", 0


class Retry:
    """The retry state of one informer: failures, stalls, the outage's log."""

    def __init__(
        self,
        name: str,
        *,
        initial: float,
        cap: float,
        unreachable_max: float,
        clock: Callable[[], float],
        random: Callable[[], float],
        log: logging.Logger,
    ) -> None:
        self.name = name
        self.unreachable_max = unreachable_max
        self.clock = clock
        self.log = log
        self._failures = Backoff(initial, cap, random)
        self._stalls = Backoff(initial, cap, random)
        self._stalled = False  # the last round made no progress
        self._down_since: float | None = None  # first failure of the current outage
        self._down_failures = 0
        self._warned_at = 0.0
        self._logged_cause = ""  # the cause of the outage's last WARNING or ERROR
        self.outages = 0  # runs of failures, each logged once
        self.last_outage = 0.0  # seconds from the first failure of the last run to success

    def failed(self, cause: str, *, unreachable: bool, retry_after: float | None = None,
               severe: bool = False, explained: bool = False) -> float:
        """A request failed (`unreachable`: no HTTP answer): the delay before
        the next one. Logs the outage's first failure as a WARNING, or as an
        ERROR when `severe` (TLS, 401, 403: waiting does not heal them); a
        severe cause that differs from the one last logged is logged too.
        `explained`: the caller has said why in an ERROR already (the API
        server only through a ClusterIP no rule serves yet), so each retry is
        a DEBUG line."""
        if unreachable:
            delay = self._failures.next("unreachable", cap=self.unreachable_max)
        else:
            delay = self._failures.next("answered", retry_after=retry_after)
        self._log_failure(cause, delay, unreachable, severe, explained)
        return delay

    def _log_failure(self, cause: str, delay: float, unreachable: bool, severe: bool,
                     explained: bool) -> None:
        now = self.clock()
        if self._down_since is None:
            self._down_since, self._warned_at, self._down_failures = now, now, 0
            self.outages += 1
            self._logged_cause = ""
        self._down_failures += 1
        if explained:
            self._warned_at = now
            self.log.debug("%s: %s; retrying in %.1fs", self.name, cause, delay)
        elif self._down_failures == 1 or (severe and cause != self._logged_cause):
            self._announce(cause, delay, unreachable, severe)
        elif now - self._warned_at >= _WARN_EVERY:
            self._warned_at = now
            self.log.warning("%s: still failing after %.0fs and %d attempts: %s",
                             self.name, now - self._down_since, self._down_failures, cause)
        else:
            self.log.debug("%s: %s; retrying in %.1fs", self.name, cause, delay)

    def _announce(self, cause: str, delay: float, unreachable: bool, severe: bool) -> None:
        """The one line of a new outage (or of a new TLS or auth cause)."""
        self._logged_cause = cause
        how = (f"at most every {self.unreachable_max:.1f}s while there is no answer"
               if unreachable else f"backing off up to {self._failures.cap:g}s")
        if severe:
            self.log.error("%s: cannot list or watch from the API server: %s; retrying in "
                           "%.1fs (%s)", self.name, cause, delay, how)
        else:
            self.log.warning("%s: %s; retrying in %.1fs (%s)", self.name, cause, delay, how)

    def succeeded(self) -> None:
        """A list completed or a watch was answered: the schedule starts over."""
        self._failures.reset()
        if self._down_since is None:
            return
        took = self.clock() - self._down_since
        self.last_outage = took
        self.log.info("%s: the API server answers again; recovered after %.1fs and %d failed "
                      "attempts", self.name, took, self._down_failures)
        self._down_since = None

    def stall(self) -> float:
        """A round made no progress (a 410, a watch that ended at once with
        nothing): the first goes on at once, a loop of them backs off."""
        if not self._stalled:
            self._stalled = True
            return 0.0
        return self._stalls.next()

    def progress(self) -> None:
        """An event arrived, or a watch stayed open: not a loop."""
        self._stalled = False
        self._stalls.reset()
