"""Change tracking with kube-proxy's semantics.

Layer: tracker (imports model, and convert's EndpointSliceInfo value). One
job: accumulate Service and EndpointSlice changes between syncs and, at sync
time, apply them to the per-family service and endpoints maps, returning
what changed as a value.

The trackers take model values: objects are converted (and their invalid
fields reported) once, when their event arrives (agent/intake.py), never
here. The maps are replaced, not mutated, by apply(): a `StateSnapshot`
handed out earlier stays a true value however many syncs follow.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from nftproxy.core.convert import EndpointSliceInfo
from nftproxy.core.model import Endpoint, IPFamily, NamespacedName, ServicePort, ServicePortName
from nftproxy.core.pmap import PersistentMap

__all__ = [
    "KIND_ENDPOINT_SLICES",
    "KIND_SERVICES",
    "EndpointSliceChangeTracker",
    "EndpointsChange",
    "ProxyState",
    "ServiceChange",
    "ServiceChangeTracker",
    "StateSnapshot",
    "SyncGate",
    "UpdateResult",
]

# The same strings as nftproxy.cluster.events.KIND_SERVICES /
# KIND_ENDPOINT_SLICES: the layering forbids the tracker importing sources.
KIND_SERVICES = "services"
KIND_ENDPOINT_SLICES = "endpointslices"

PortMap = Mapping[ServicePortName, ServicePort]
EndpointsMap = Mapping[ServicePortName, tuple[Endpoint, ...]]


@dataclass(frozen=True, slots=True)
class UpdateResult:
    """What one apply() changed (kube-proxy's UpdateServiceMapResult and
    UpdateEndpointsMapResult in one value).

    updated: service ports whose rules must be re-rendered (added, removed,
        or whose ServicePort or endpoint list changed).
    deleted_ports: ServicePorts that no longer exist (conntrack cleanup of
        their UDP/SCTP IPs), sorted by name.
    stale_endpoints: per service port (existing or deleted), the endpoints
        that flows may still point at although rules no longer use them:
        removed from the port, or no longer serving. Sorted.
    newly_active: ports that went from no usable (ready or serving) endpoint
        to at least one (flows cached meanwhile would black-hole).
    trigger_times: per service, EndpointSlice last-change-trigger times
        (epoch seconds, sorted) of the changes applied.
    service_changes / endpoint_changes: how many pending Service /
        (service, EndpointSlice) changes were applied (metrics).
    """

    updated: frozenset[ServicePortName] = frozenset()
    deleted_ports: tuple[ServicePort, ...] = ()
    stale_endpoints: Mapping[ServicePortName, tuple[Endpoint, ...]] = field(default_factory=dict)
    newly_active: frozenset[ServicePortName] = frozenset()
    trigger_times: Mapping[NamespacedName, tuple[float, ...]] = field(default_factory=dict)
    service_changes: int = 0
    endpoint_changes: int = 0


# ---------------------------------------------------------------- services


@dataclass(frozen=True, slots=True)
class ServiceChange:
    """The net pending change of one Service: its ports as of the last apply
    (`previous`) and now (`current`)."""

    service: NamespacedName
    previous: PortMap
    current: PortMap


class ServiceChangeTracker:
    """Pending Service changes of one family, keyed by namespace/name."""

    def __init__(self, family: IPFamily) -> None:
        self.family = family
        self._pending: dict[NamespacedName, ServiceChange] = {}

    @property
    def pending(self) -> int:
        """Services with a pending change (metric kubeproxy_service_changes_pending)."""
        return len(self._pending)

    def update(self, service: NamespacedName, previous: PortMap, current: PortMap) -> bool:
        """Record a change of `service`'s ports in this family (add: previous
        empty, delete: current empty). Keeps the oldest previous and the
        newest current per service; a change whose net effect is nothing is
        dropped. Returns True if a change is pending for it afterwards."""
        known = self._pending.get(service)
        previous_ports = known.previous if known is not None else previous
        if previous_ports == current:
            # Back where the last apply left it (A->B->A, add then delete, or
            # an informer resync): nothing to do.
            self._pending.pop(service, None)
            return False
        self._pending[service] = ServiceChange(service, previous_ports, current)
        return True

    def checkout(self) -> tuple[ServiceChange, ...]:
        """Hand over every pending change (sorted by service) and forget them."""
        changes = tuple(self._pending[key] for key in sorted(self._pending))
        self._pending.clear()
        return changes


# ----------------------------------------------------------- endpoint slices


@dataclass(frozen=True, slots=True)
class EndpointsChange:
    """One service's endpoints before and after its pending slice changes.

    `previous == current` when the slice changes cancel out at the service
    level (e.g. an endpoint moved between two slices of the service).
    """

    service: NamespacedName
    previous: EndpointsMap
    current: EndpointsMap
    trigger_times: tuple[float, ...] = ()
    slice_changes: int = 0


@dataclass(frozen=True, slots=True)
class _PendingSlice:
    """A slice's newest content for one service; None: it left the service."""

    info: EndpointSliceInfo | None
    trigger_times: tuple[float, ...]


class EndpointSliceChangeTracker:
    """Pending EndpointSlice changes of one family, grouped by service
    (kube-proxy's EndpointSliceCache: applied and pending slices per service)."""

    def __init__(self, family: IPFamily) -> None:
        self.family = family
        self._applied: dict[NamespacedName, dict[str, EndpointSliceInfo]] = {}
        self._pending: dict[NamespacedName, dict[str, _PendingSlice]] = {}
        # Slice (namespace/name) -> the service its newest content feeds. The
        # tracker needs this, not `previous`, to take a slice away from its
        # old service when it is relabelled, changes family or is deleted.
        self._owner: dict[NamespacedName, NamespacedName] = {}

    @property
    def pending(self) -> int:
        """Pending (service, slice) changes (metric kubeproxy_endpoint_changes_pending)."""
        return sum(len(slices) for slices in self._pending.values())

    def update(self, key: NamespacedName, current: EndpointSliceInfo | None) -> bool:
        """Record the newest content of slice `key` (namespace/name): None when
        it was deleted or is one the proxy ignores. A slice of the other
        family counts as absent. Returns True if a change is pending for it."""
        info = current if current is not None and current.family is self.family else None
        owner = self._owner.pop(key, None)
        touched: list[NamespacedName] = []
        if owner is not None and (info is None or info.service != owner):
            self._stage(owner, key.name, None)
            touched.append(owner)
        if info is not None:
            self._stage(info.service, key.name, info)
            self._owner[key] = info.service
            touched.append(info.service)
        return any(key.name in self._pending.get(svc, {}) for svc in touched)

    def checkout(self) -> tuple[EndpointsChange, ...]:
        """Apply every pending slice change to the applied slices and hand over
        each touched service's endpoints before and after (sorted by service)."""
        changes = tuple(self._checkout_service(svc) for svc in sorted(self._pending))
        self._pending.clear()
        return changes

    def _checkout_service(self, svc: NamespacedName) -> EndpointsChange:
        entries = self._pending[svc]
        applied = self._applied.setdefault(svc, {})
        previous = _merge_slices(applied.values())
        for name, entry in entries.items():
            if entry.info is None:
                applied.pop(name, None)
            else:
                applied[name] = entry.info
        if not applied:
            del self._applied[svc]
        return EndpointsChange(
            service=svc,
            previous=previous,
            current=_merge_slices(applied.values()),
            trigger_times=tuple(sorted(t for e in entries.values() for t in e.trigger_times)),
            slice_changes=len(entries),
        )

    def _stage(self, svc: NamespacedName, slice_name: str, info: EndpointSliceInfo | None) -> None:
        """Make `info` the newest content of the slice for `svc`, dropping the
        pending entry when it matches what is applied. A trigger time is kept
        only for a real content change: a resync or an annotation-only update
        programs nothing, so it must not feed the latency metric."""
        applied = self._applied.get(svc, {}).get(slice_name)
        pending = self._pending.get(svc, {})
        known = pending.get(slice_name)
        if _same_content(known.info if known is not None else applied, info):
            return
        if _same_content(applied, info):
            pending.pop(slice_name, None)
        else:
            times = known.trigger_times if known is not None else ()
            if info is not None and info.trigger_time is not None:
                times = (*times, info.trigger_time)
            pending[slice_name] = _PendingSlice(info, times)
        if pending:
            self._pending[svc] = pending
        else:
            self._pending.pop(svc, None)


def _same_content(a: EndpointSliceInfo | None, b: EndpointSliceInfo | None) -> bool:
    """Equal slice contents, ignoring the trigger-time annotation."""
    if a is None or b is None:
        return a is b
    return replace(a, trigger_time=None) == replace(b, trigger_time=None)


def _merge_slices(
    slices: Iterable[EndpointSliceInfo],
) -> dict[ServicePortName, tuple[Endpoint, ...]]:
    """One service's endpoints per port from all its slices.

    Slices are taken in name order so the result does not depend on arrival
    order. An endpoint listed by two slices (transiently, while the
    EndpointSlice controller moves it) counts once; a local copy wins, as in
    kube-proxy, so a local endpoint is never mistaken for a remote one.
    Ports without endpoints are left out.
    """
    merged: dict[ServicePortName, dict[tuple[str, int], Endpoint]] = {}
    for info in sorted(slices, key=lambda i: i.slice_name):
        for spn, endpoints in info.ports.items():
            by_address = merged.setdefault(spn, {})
            for ep in endpoints:
                address = (ep.ip, ep.port)
                if address not in by_address or ep.is_local:
                    by_address[address] = ep
    return {spn: tuple(sorted(eps.values())) for spn, eps in merged.items() if eps}


# ------------------------------------------------------------------- state


@dataclass(frozen=True, slots=True)
class _ServicesApplied:
    updated: frozenset[ServicePortName]
    deleted: tuple[ServicePort, ...]


@dataclass(frozen=True, slots=True)
class _EndpointsApplied:
    updated: frozenset[ServicePortName]
    stale: Mapping[ServicePortName, tuple[Endpoint, ...]]
    newly_active: frozenset[ServicePortName]
    trigger_times: Mapping[NamespacedName, tuple[float, ...]]


@dataclass(frozen=True, slots=True)
class StateSnapshot:
    """One family's service map and endpoints map as of one apply(): read-only
    views of dicts that are never mutated again (apply() replaces them)."""

    family: IPFamily
    services: PortMap = field(default_factory=dict)
    endpoints: EndpointsMap = field(default_factory=dict)

    def health_check_ports(self) -> dict[NamespacedName, int]:
        """healthCheckNodePort per service that needs a health server
        (eTP=Local on an externally accessible port)."""
        return {
            spn.service: port.health_check_node_port
            for spn, port in sorted(self.services.items())
            if port.health_check_node_port and port.external_policy_local
        }

    def local_ready_endpoints(self) -> dict[NamespacedName, int]:
        """Per service, the number of distinct local Ready endpoint IPs over
        all its ports (the health server's localEndpoints; a pod serving two
        ports counts once). Services without one are absent (count 0);
        terminating endpoints never count, so load balancers drain the node."""
        ips: dict[NamespacedName, set[str]] = {}
        for spn, endpoints in self.endpoints.items():
            for ep in endpoints:
                if ep.is_local and ep.ready:
                    ips.setdefault(spn.service, set()).add(ep.ip)
        return {svc: len(ips[svc]) for svc in sorted(ips)}


class ProxyState:
    """The service map and endpoints map of one family, and their trackers.

    Event handlers feed `service_tracker` and `endpoint_tracker`; the sync
    calls apply() once and passes the UpdateResult on. `endpoints` holds only
    ports with at least one endpoint (absent and empty mean the same).
    The maps are `PersistentMap`s: apply() derives changed ones that share
    every untouched shard (O(changes), not O(ports)), so `snapshot()` costs
    nothing and stays valid.
    """

    def __init__(self, family: IPFamily) -> None:
        self.family = family
        self.service_tracker = ServiceChangeTracker(family)
        self.endpoint_tracker = EndpointSliceChangeTracker(family)
        self._services: PersistentMap[ServicePortName, ServicePort] = PersistentMap()
        self._endpoints: PersistentMap[ServicePortName, tuple[Endpoint, ...]] = PersistentMap()
        # Port names per Service as last applied (their ports are in
        # `_services`): what a Service change replaces, whatever the event's
        # `previous` said. A tuple, not a dict per service (~180 bytes less).
        self._ports_by_service: dict[NamespacedName, tuple[ServicePortName, ...]] = {}

    @property
    def services(self) -> PortMap:
        """The service map as of the last apply() (immutable)."""
        return self._services

    @property
    def endpoints(self) -> EndpointsMap:
        """The endpoints map as of the last apply() (immutable)."""
        return self._endpoints

    def snapshot(self) -> StateSnapshot:
        """Both maps as they are now, as a value later applies do not change."""
        return StateSnapshot(self.family, self.services, self.endpoints)

    @property
    def pending_service_changes(self) -> int:
        return self.service_tracker.pending

    @property
    def pending_endpoint_changes(self) -> int:
        return self.endpoint_tracker.pending

    def apply(self) -> UpdateResult:
        """Merge every pending change into the two maps; say what changed."""
        service_changes = self.service_tracker.checkout()
        endpoint_changes = self.endpoint_tracker.checkout()
        services = self._apply_services(service_changes)
        endpoints = self._apply_endpoints(endpoint_changes)
        return UpdateResult(
            updated=services.updated | endpoints.updated,
            deleted_ports=services.deleted,
            stale_endpoints=endpoints.stale,
            newly_active=endpoints.newly_active,
            trigger_times=endpoints.trigger_times,
            service_changes=len(service_changes),
            endpoint_changes=sum(c.slice_changes for c in endpoint_changes),
        )

    def health_check_ports(self) -> dict[NamespacedName, int]:
        return self.snapshot().health_check_ports()

    def local_ready_endpoints(self) -> dict[NamespacedName, int]:
        return self.snapshot().local_ready_endpoints()

    def _apply_services(self, changes: Sequence[ServiceChange]) -> _ServicesApplied:
        updated: set[ServicePortName] = set()
        deleted: list[ServicePort] = []
        edit = self._services.edit()
        for change in changes:
            names = self._ports_by_service.pop(change.service, ())
            old = {spn: self._services[spn] for spn in names}
            new = change.current
            if new:
                self._ports_by_service[change.service] = tuple(new)
            for spn, port in old.items():
                if spn not in new:
                    del edit[spn]
                    deleted.append(port)
                    updated.add(spn)
            for spn, port in new.items():
                if old.get(spn) != port:
                    edit[spn] = port
                    updated.add(spn)
        if changes:
            self._services = edit.done()
        return _ServicesApplied(frozenset(updated), tuple(sorted(deleted, key=lambda p: p.name)))

    def _apply_endpoints(self, changes: Sequence[EndpointsChange]) -> _EndpointsApplied:
        updated: set[ServicePortName] = set()
        stale: dict[ServicePortName, tuple[Endpoint, ...]] = {}
        newly_active: set[ServicePortName] = set()
        trigger_times: dict[NamespacedName, tuple[float, ...]] = {}
        edit = self._endpoints.edit()
        for change in changes:
            if change.previous == change.current:
                continue
            if change.trigger_times:
                trigger_times[change.service] = change.trigger_times
            for spn in sorted(change.previous.keys() | change.current.keys()):
                old = change.previous.get(spn, ())
                new = change.current.get(spn, ())
                if old == new:
                    continue
                updated.add(spn)
                if new:
                    edit[spn] = new
                else:
                    edit.pop(spn, None)
                gone = _stale_endpoints(old, new)
                if gone:
                    stale[spn] = gone
                if not _any_usable(old) and _any_usable(new):
                    newly_active.add(spn)
        if changes:
            self._endpoints = edit.done()
        return _EndpointsApplied(frozenset(updated), stale, frozenset(newly_active), trigger_times)


def _stale_endpoints(old: Iterable[Endpoint], new: Iterable[Endpoint]) -> tuple[Endpoint, ...]:
    """Old endpoints that flows may still reach though the rules no longer
    send traffic there: gone from the port (by ip:port), or no longer serving
    (kube-proxy's detectStaleConntrackEntries: a serving->not-serving endpoint
    must lose its UDP flows too)."""
    serving_now = {(ep.ip, ep.port): ep.serving for ep in new}
    return tuple(
        sorted(
            ep
            for ep in old
            if (ep.ip, ep.port) not in serving_now
            or (ep.serving and not serving_now[(ep.ip, ep.port)])
        )
    )


def _any_usable(endpoints: Iterable[Endpoint]) -> bool:
    """Ready or serving(-terminating): something the rules may send traffic to."""
    return any(ep.ready or ep.serving for ep in endpoints)


class SyncGate:
    """Whether both initial lists are complete.

    Nothing may be programmed before: a ruleset built from Services without
    their EndpointSlices would reject traffic to services that have endpoints.
    """

    KINDS = frozenset({KIND_SERVICES, KIND_ENDPOINT_SLICES})

    def __init__(self) -> None:
        self._synced: set[str] = set()

    def mark_synced(self, kind: str) -> None:
        """Record that the initial list of `kind` is complete (idempotent)."""
        if kind not in self.KINDS:
            raise ValueError(f"unknown kind {kind!r}; expected one of {sorted(self.KINDS)}")
        self._synced.add(kind)

    @property
    def ready(self) -> bool:
        return self._synced == self.KINDS
