"""FakeConntrack: a conntrack table of flow tuples with the kernel's behaviour.

Layer: kernel (the test double beside kernel/conntrack.py's `Conntrack`;
imports the core's conntrack values and apply loop only). One job: answer
dumps and deletes the way the kernel does -- a dump returns the flows whose
original destination the query names (what CTA_FILTER does), a delete
removes a flow by its tuple and id, ENOENT when it is gone -- so tests run
the same apply loop (core/conntrack.py `apply_filters`) without root.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from nftproxy.core.conntrack import (
    CleanupResult,
    Flow,
    FlowFilter,
    Query,
    apply_filters,
    canonical_ip,
)

__all__ = ["FakeConntrack"]


class FakeConntrack:
    """A conntrack table of `Flow`s with the kernel's behaviour, for tests.

    `dump` returns the flows whose original destination matches the filter
    (what CTA_FILTER does); `delete` removes a flow by its tuple and id.
    `vanishing` flows disappear between dump and delete (the kernel answers
    ENOENT); deleting a flow in `failing` raises OSError with that errno;
    a query in `broken` raises OSError(ENOBUFS). `dumps` records the queries.
    """

    def __init__(
        self,
        flows: Iterable[Flow] = (),
        *,
        vanishing: Iterable[Flow] = (),
        failing: Mapping[Flow, int] | None = None,
        broken: Iterable[Query] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.flows: list[Flow] = list(flows)
        self.vanishing = set(vanishing)
        self.failing = dict(failing or {})
        self.broken = set(broken)
        self.clock = clock
        self.dumps: list[Query] = []
        self._started = False

    def start(self) -> None:
        self._started = True

    def close(self) -> None:
        self._started = False

    def apply(self, filters: Sequence[FlowFilter]) -> CleanupResult:
        if not self._started:
            raise RuntimeError("FakeConntrack not started (or closed)")
        return apply_filters(filters, self._dump, self._delete, self.clock)

    def _dump(self, query: Query) -> list[Flow]:
        self.dumps.append(query)
        if query in self.broken:
            raise OSError(errno.ENOBUFS, "No buffer space available")
        return [
            f
            for f in self.flows
            if (f.family, f.protocol, f.dport) == (query.family, query.protocol, query.port)
            and (query.ip is None or canonical_ip(f.dst) == query.ip)
        ]

    def _delete(self, flow: Flow) -> None:
        if flow in self.vanishing:
            self.vanishing.discard(flow)
            self.flows = [f for f in self.flows if f != flow]
            raise OSError(errno.ENOENT, "No such file or directory")
        if flow in self.failing:
            code = self.failing[flow]
            raise OSError(code, errno.errorcode.get(code, str(code)))
        if flow not in self.flows:
            raise OSError(errno.ENOENT, "No such file or directory")
        self.flows.remove(flow)
