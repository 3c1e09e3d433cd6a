"""The one place a sync's effect on process-wide state is decided.

Layer: agent. One job: the
`HeapPolicy` the Proxier calls around a sync, so the sync itself never
touches the garbage collector, malloc or the interpreter's thread switching:

- `building(full)` brackets render, stage and commit. A full sync
  allocates millions of acyclic objects, and the collections they trigger
  would take a large share of the render time: the cyclic GC is paused
  until the full sync has committed, and what it built is frozen before
  the GC resumes (else those millions sit in the youngest generation, and
  its next collection scans them all). And the interpreter's switch
  interval drops from its default 5 ms to `SWITCH_INTERVAL` meanwhile: a
  full sync in steps hands the GIL between its threads (render ahead,
  staging, the commit waiting on libnftables) at every step, and each
  handoff would wait up to an interval while the other threads hold the
  GIL.
- `bulk()` brackets anything else that makes a large batch of long-lived
  objects: the agent wraps every complete list from the API server in it
  (cluster/kube.py `listing`). Without it the oldest generation's full
  collections run again and again during the initial list, each longer
  than the last. Brackets may overlap (the informers list in parallel
  threads): the GC resumes when the last ends.
- `settled(full)` after the sync's hooks, so the time it takes is not part
  of any change's programming latency. The state a sync leaves is
  long-lived: freeze it, so the GC stops re-scanning it. Without this, the
  records every partial sync replaces pile up in the oldest generation,
  whose full collections then land in churn syncs and grow with the
  cluster. After a full sync: unfreeze, collect everything once (frozen
  cyclic garbage lives at most until then: the hourly full sync), freeze,
  and hand freed heap back to the OS (malloc_trim, where the backend's
  libc has it).

What each of these saves is in bench/RESULTS.md, "What moved the numbers".

`NoHeapPolicy` touches nothing (tests, one-shot `sync`, the default).
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

__all__ = ["SWITCH_INTERVAL", "AgentHeapPolicy", "HeapPolicy", "NoHeapPolicy"]

SWITCH_INTERVAL = 0.001
"""Seconds a thread may hold the GIL while others wait, during a full sync."""


class HeapPolicy(Protocol):
    def building(self, full: bool) -> contextlib.AbstractContextManager[None]:
        """Brackets render, listing, stage and commit of one sync."""

    def settled(self, full: bool) -> None:
        """After a successful sync's hooks."""


class NoHeapPolicy:
    """Touches nothing process-wide."""

    @contextlib.contextmanager
    def building(self, full: bool) -> Iterator[None]:
        yield

    def settled(self, full: bool) -> None:
        pass


class AgentHeapPolicy:
    """What the long-running agent does: GC paused while a full sync is
    built and committed; after every sync, its state frozen; after a full
    one, one whole collection first and a `trim` (malloc_trim) after."""

    def __init__(self, trim: Callable[[], object] | None = None) -> None:
        self.trim = trim
        self._lock = threading.Lock()
        self._pauses = 0

    def building(self, full: bool) -> contextlib.AbstractContextManager[None]:
        return self._full_build() if full else contextlib.nullcontext()

    @contextlib.contextmanager
    def _full_build(self) -> Iterator[None]:
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, SWITCH_INTERVAL))
        try:
            with self.bulk():
                yield
        finally:
            sys.setswitchinterval(interval)

    @contextlib.contextmanager
    def bulk(self) -> Iterator[None]:
        """GC paused while the block makes long-lived objects; what it made
        frozen before the GC resumes (when the last open bracket ends)."""
        with self._lock:
            self._pauses += 1
            gc.disable()
        try:
            yield
        finally:
            with self._lock:
                self._pauses -= 1
                if not self._pauses:
                    gc.freeze()
                    gc.enable()

    def settled(self, full: bool) -> None:
        if full:
            gc.unfreeze()
            gc.collect()
        gc.freeze()
        if full and self.trim is not None:
            self.trim()
