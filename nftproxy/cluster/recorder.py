"""Recorder: a ClusterEvents handler that keeps the latest raw objects.

Layer: sources (imports cluster.events only). One job: remember what a
source delivered -- Services and EndpointSlices by namespace/name, this
Node, the ServiceCIDRs, the kinds whose initial list is complete -- so a
tool can read it back (`snapshot()`), hand it to another handler as a fresh
source would (`replay()`), or sit as a tee in front of one (`forward`).
Callers: cli (`sync` and `run --source` read the files into one first) and
the demo (a tee in front of the agent, whose `marker()` tells "a sync after
the last change").

Objects stay raw dicts, as the ClusterEvents protocol delivers them.
Thread-safe: a source thread records while another thread reads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from nftproxy.cluster.events import ClusterEvents, Obj

__all__ = ["Recorded", "Recorder"]

Key = tuple[str, str]
"""(namespace, name)."""


@dataclass(frozen=True, slots=True)
class Recorded:
    """What a Recorder holds at one moment."""

    services: Mapping[Key, Obj]
    slices: Mapping[Key, Obj]
    node: Obj | None
    cidrs: tuple[Obj, ...]
    synced: frozenset[str]


class Recorder:
    """Keeps the latest objects; with `forward`, passes every event on after
    recording it. Each change (not on_synced) counts in `marker()`, together
    with `stamp()` taken at that change -- e.g. how many syncs had committed,
    so "a sync after the last change" can be told."""

    def __init__(
        self, forward: ClusterEvents | None = None, *, stamp: Callable[[], int] = lambda: 0
    ) -> None:
        self.forward = forward
        self._stamp = stamp
        self._lock = threading.Lock()
        self._services: dict[Key, Obj] = {}
        self._slices: dict[Key, Obj] = {}
        self._node: Obj | None = None
        self._cidrs: tuple[Obj, ...] = ()
        self._synced: set[str] = set()
        self._changes = 0
        self._stamp_at_change = 0

    def on_service(self, previous: Obj | None, current: Obj | None) -> None:
        with self._lock:
            _record(self._services, previous, current)
            self._changed()
        if self.forward is not None:
            self.forward.on_service(previous, current)

    def on_endpoint_slice(self, previous: Obj | None, current: Obj | None) -> None:
        with self._lock:
            _record(self._slices, previous, current)
            self._changed()
        if self.forward is not None:
            self.forward.on_endpoint_slice(previous, current)

    def on_node(self, node: Obj | None) -> None:
        with self._lock:
            self._node = node
            self._changed()
        if self.forward is not None:
            self.forward.on_node(node)

    def on_service_cidrs(self, cidrs: Sequence[Obj]) -> None:
        with self._lock:
            self._cidrs = tuple(cidrs)
            self._changed()
        if self.forward is not None:
            self.forward.on_service_cidrs(cidrs)

    def on_synced(self, kind: str) -> None:
        with self._lock:
            self._synced.add(kind)
        if self.forward is not None:
            self.forward.on_synced(kind)

    def _changed(self) -> None:
        self._changes += 1
        self._stamp_at_change = self._stamp()

    def marker(self) -> tuple[int, int]:
        """(changes recorded, `stamp()` at the last change)."""
        with self._lock:
            return self._changes, self._stamp_at_change

    def snapshot(self) -> Recorded:
        with self._lock:
            return Recorded(
                dict(self._services),
                dict(self._slices),
                self._node,
                self._cidrs,
                frozenset(self._synced),
            )

    def replay(self, target: ClusterEvents) -> None:
        """Deliver what was recorded to another handler, as a fresh source would."""
        recorded = self.snapshot()
        if recorded.node is not None:
            target.on_node(recorded.node)
        target.on_service_cidrs(recorded.cidrs)
        for svc in recorded.services.values():
            target.on_service(None, svc)
        for eps in recorded.slices.values():
            target.on_endpoint_slice(None, eps)
        for kind in sorted(recorded.synced):
            target.on_synced(kind)


def _record(store: dict[Key, Obj], previous: Obj | None, current: Obj | None) -> None:
    obj = current if current is not None else previous
    if obj is None:
        return
    meta = obj.get("metadata") or {}
    key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
    if current is None:
        store.pop(key, None)
    else:
        store[key] = current
