"""The one place a sync's effect on process-wide memory state is decided.

Layer: agent (imports the kernel's malloc helpers). One job: the
`HeapPolicy` the Proxier calls around a sync, so the sync itself never
touches the garbage collector or malloc:

- `building(full)` brackets render + listing + stage. A full sync allocates
  millions of acyclic objects, and the collections they trigger cost ~40% of
  the render time at 10,000 services (measured 5.2 s -> 3.4 s): the cyclic
  GC is paused for a full build.
- `committed(full)` after a successful commit. The committed state a full
  sync built lives until the next full sync: collect once and freeze it, so
  the GC stops re-scanning it on every collection (0.3-0.4 s per full pass
  at 10,000 services; bench/RESULTS.md); then hand freed heap back to the
  OS (malloc_trim, where the backend's libc has it).

`NoHeapPolicy` touches nothing (tests, one-shot `sync`, the default).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Protocol

__all__ = ["FullSyncHeapPolicy", "HeapPolicy", "NoHeapPolicy"]


class HeapPolicy(Protocol):
    def building(self, full: bool) -> contextlib.AbstractContextManager[None]:
        """Brackets render + listing + stage of one sync."""

    def committed(self, full: bool) -> None:
        """After a successful commit."""


class NoHeapPolicy:
    """Touches nothing process-wide."""

    @contextlib.contextmanager
    def building(self, full: bool) -> Iterator[None]:
        yield

    def committed(self, full: bool) -> None:
        pass


class FullSyncHeapPolicy:
    """What the long-running agent does: GC paused while a full sync is
    built; after its commit, collect, freeze, and `trim` (malloc_trim)."""

    def __init__(self, trim: Callable[[], object] | None = None) -> None:
        self.trim = trim

    @contextlib.contextmanager
    def building(self, full: bool) -> Iterator[None]:
        if not full or not gc.isenabled():
            yield
            return
        gc.disable()
        try:
            yield
        finally:
            gc.enable()

    def committed(self, full: bool) -> None:
        if not full:
            return
        gc.collect()
        gc.freeze()
        if self.trim is not None:
            self.trim()
