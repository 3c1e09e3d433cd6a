"""Raw cluster objects -> model values, once, when their event arrives.

Layer: agent (imports the core and cluster.events). One job: be the
`ClusterEvents` handler every source feeds, convert each object the moment
its event arrives (the only place nftproxy calls `convert`), hand the values
to a `ProxierEvents` target (the Proxier, or the agent's tee in front of it),
and put every invalid field into ONE stream: the `report` callback, given an
`InvalidField` (the Problem and the object it was found in), which the agent
turns into one log line, a counter and (API source) a Kubernetes Event.

Each invalid field is reported once: while an object keeps the same Problem
across updates and informer resyncs it is not reported again; a Problem that
goes away and comes back is. A Service is converted for both families at
once and a Problem both family views find is reported once.

Nothing is dropped silently: a Service whose every port is invalid reaches
the target as a Service with no ports, after its Problems were reported.

Two Services claiming one destination (a cluster IP, external IP or LB VIP
and port, or a node port; core/destinations.py) are reported here too: the
API server never allows it, a file source can. The planner programs one
(the service port whose name sorts first); each loser is reported once,
through the same stream, as a Problem on the field that names the
destination, naming the winner; again only if it goes away and comes back.

kube-proxy's AllowServiceExternalIPs switch (KEP-5707) is applied here too:
with `allow_external_ips` off, every Service reaches the target without its
externalIPs, and a Service that sets them is reported once, through the same
stream, as a Problem on spec.externalIPs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from nftproxy.cluster.events import Obj
from nftproxy.core import convert
from nftproxy.core.convert import EndpointSliceInfo, Problem
from nftproxy.core.convert.problems import object_label
from nftproxy.core.destinations import Conflict, Destinations
from nftproxy.core.model import IPFamily, NamespacedName, NodeInfo, ServiceInfo, ServicePort

__all__ = [
    "DUPLICATE_DESTINATION",
    "INVALID_FIELD",
    "Intake",
    "InvalidField",
    "InvalidFieldSink",
    "ProxierEvents",
    "service_info",
]


class ProxierEvents(Protocol):
    """What the Proxier takes: model values, never raw objects."""

    def on_service(
        self, name: NamespacedName, previous: ServiceInfo | None, current: ServiceInfo | None
    ) -> None: ...

    def on_endpoint_slice(self, key: NamespacedName, current: EndpointSliceInfo | None) -> None:
        """`key` is the slice's namespace/name; `current` None: deleted or ignored."""

    def on_node(self, node: NodeInfo | None) -> None: ...

    def on_service_cidrs(self, cidrs: tuple[str, ...]) -> None: ...

    def on_synced(self, kind: str) -> None: ...


INVALID_FIELD = "InvalidFieldSkipped"
DUPLICATE_DESTINATION = "DuplicateDestination"


@dataclass(frozen=True, slots=True)
class InvalidField:
    """One skipped field and the object it is in (what an Event is about).
    `reason` tells the kind of report, and is the Event's reason: an invalid
    field, or a destination another Service won (DUPLICATE_DESTINATION)."""

    problem: Problem
    namespace: str
    name: str
    uid: str = ""
    reason: str = INVALID_FIELD

    def __str__(self) -> str:
        return str(self.problem)


InvalidFieldSink = Callable[[InvalidField], None]


class Intake:
    """The ClusterEvents handler: converts, reports, forwards. Sources may
    call it from several threads."""

    def __init__(
        self,
        target: ProxierEvents,
        *,
        node_name: str,
        report: InvalidFieldSink,
        allow_external_ips: bool = True,
    ) -> None:
        self.target = target
        self.node_name = node_name
        self.report = report
        self.allow_external_ips = allow_external_ips
        self._lock = threading.Lock()
        self._reported: dict[tuple[str, NamespacedName], frozenset[Problem]] = {}
        self._destinations = Destinations()
        self._conflicts: set[Conflict] = set()

    def on_service(self, previous: Obj | None, current: Obj | None) -> None:
        obj = current if current is not None else previous
        if obj is None:
            return
        name = convert.service_name(obj)
        info, problems = self._service(name, current)
        self._report("Service", obj, name, problems)
        if name is not None:
            old = self._service(name, previous)[0]
            self.target.on_service(name, old, info)
            self._claim(obj, old, info)

    def _claim(self, obj: Obj, old: ServiceInfo | None, new: ServiceInfo | None) -> None:
        """Record the Service's destinations; report each new loser of one,
        once (about this object, with its uid, when the loser is this Service)."""
        with self._lock:
            touched = self._destinations.update(_ports(old), _ports(new))
            now = self._destinations.conflicts(touched)
            before = {c for c in self._conflicts if c.key in touched} if self._conflicts else set()
            if not now and not before:
                return
            self._conflicts = (self._conflicts - before) | now
            new_conflicts = sorted(now - before)
        name = convert.service_name(obj)
        for conflict in new_conflicts:
            loser = conflict.loser.service
            problem = Problem("Service", str(loser), conflict.field, conflict.message())
            uid = _uid(obj) if loser == name else ""
            self.report(
                InvalidField(problem, loser.namespace, loser.name, uid, DUPLICATE_DESTINATION)
            )

    def _service(
        self, name: NamespacedName | None, obj: Obj | None
    ) -> tuple[ServiceInfo | None, tuple[Problem, ...]]:
        info, problems = service_info(name, obj)
        if self.allow_external_ips or info is None or obj is None:
            return info, problems
        stripped, had_external_ips = _without_external_ips(info)
        if had_external_ips:
            problems = (*problems, _external_ips_off(object_label(obj)))
        return stripped, problems

    def on_endpoint_slice(self, previous: Obj | None, current: Obj | None) -> None:
        obj = current if current is not None else previous
        if obj is None:
            return
        key = convert.service_name(obj)
        info, problems = (
            convert.slice_info(current, self.node_name) if current is not None else (None, [])
        )
        self._report("EndpointSlice", obj, key, problems)
        if key is not None:
            self.target.on_endpoint_slice(key, info)

    def on_node(self, node: Obj | None) -> None:
        info, problems = convert.node_info(node) if node is not None else (None, [])
        if node is not None:
            self._report("Node", node, convert.service_name(node), problems)
        else:  # deleted: a re-created Node's problems are new (as a Service's are)
            with self._lock:
                for key in [k for k in self._reported if k[0] == "Node"]:
                    del self._reported[key]
        self.target.on_node(info)

    def on_service_cidrs(self, cidrs: Sequence[Obj]) -> None:
        found: set[str] = set()
        for obj in cidrs:
            values, problems = convert.service_cidrs(obj)
            found.update(values)
            self._report("ServiceCIDR", obj, convert.service_name(obj), problems)
        self.target.on_service_cidrs(tuple(sorted(found)))

    def on_synced(self, kind: str) -> None:
        self.target.on_synced(kind)

    def _report(
        self, kind: str, obj: Obj, name: NamespacedName | None, problems: Iterable[Problem]
    ) -> None:
        """Report the Problems this object did not have when last reported."""
        current = frozenset(problems)
        if name is None:
            new = sorted(current, key=str)  # nothing to remember it by
        else:
            with self._lock:
                before = self._reported.pop((kind, name), frozenset())
                if current:
                    self._reported[(kind, name)] = current
            new = sorted(current - before, key=str)
        for problem in new:
            self.report(_invalid_field(problem, obj, name))


def service_info(
    name: NamespacedName | None, obj: Obj | None
) -> tuple[ServiceInfo | None, tuple[Problem, ...]]:
    """Both family views of a Service; a Problem both find counts once."""
    if obj is None:
        return None, ()
    v4, p4 = convert.service_ports(obj, IPFamily.IPV4)
    v6, p6 = convert.service_ports(obj, IPFamily.IPV6)
    problems = tuple(dict.fromkeys([*p4, *p6]))
    return (ServiceInfo(name, v4, v6) if name is not None else None), problems


def _external_ips_off(label: str) -> Problem:
    return Problem(
        "Service", label, "spec.externalIPs",
        "not programmed: AllowServiceExternalIPs is off (--allow-service-external-ips=false)",
    )


def _without_external_ips(info: ServiceInfo) -> tuple[ServiceInfo, bool]:
    """`info` with no port's externalIPs, and whether any port had some."""
    found = any(p.external_ips for f in IPFamily for p in info.ports(f).values())
    if not found:
        return info, False
    ipv4, ipv6 = (
        {k: replace(p, external_ips=()) for k, p in info.ports(f).items()} for f in IPFamily
    )
    return ServiceInfo(info.name, ipv4, ipv6), True


def _ports(info: ServiceInfo | None) -> list[ServicePort]:
    return [p for f in IPFamily for p in info.ports(f).values()] if info is not None else []


def _invalid_field(problem: Problem, obj: Obj, name: NamespacedName | None) -> InvalidField:
    return InvalidField(
        problem,
        name.namespace if name is not None else "",
        name.name if name is not None else "",
        _uid(obj),
    )


def _uid(obj: Obj) -> str:
    meta: Any = obj.get("metadata") if isinstance(obj, Mapping) else None
    uid = meta.get("uid") if isinstance(meta, Mapping) else None
    return uid if isinstance(uid, str) else ""
