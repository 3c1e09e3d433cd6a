"""Whole-state figures of the sync report, kept up to date per changed port.

Layer: agent (imports the core's model, tracker and render values). One
job: the figures a `SyncReport` gives about every service -- not only the
ones a sync touched -- without reading the whole maps on every sync:

- `HealthTally`: per service, its healthCheckNodePort where it needs a
  health server (eTP=Local on an externally accessible port), and, for
  those services only (the health server answers for no other), its number
  of distinct local Ready endpoint IPs over all its ports, over both
  families. The same values as `StateSnapshot.health_check_ports` /
  `local_ready_endpoints` merged over the families (the later family's port
  wins, the larger count wins), which a full sync recomputes (`rebuild`) and
  a partial sync updates for the ports it applied (`update`): O(changed).
  Only the ports that need a health server keep their local IPs (keeping
  every port's would cost memory at every size), and the endpoint ports
  their Service lacks (a slice's port name the Service does not have):
  kube-proxy counts a served service's local endpoints over every port of
  its endpoints, and such a port is no port of the Service to tell whether
  it is served.
- `NoLocalTally`: per family, the service ports whose Local traffic policies
  found no local endpoint (the sync_proxy_rules_no_local_endpoints_total
  gauges), counted as the render step reports them.

What is handed out are `PersistentMap`s: an update derives new ones that
share every untouched shard, so an earlier report keeps its values and an
update costs O(changed), not a copy of every service's figure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeVar

from nftproxy.core.model import Endpoint, IPFamily, NamespacedName, ServicePort, ServicePortName
from nftproxy.core.pmap import MapEdit, PersistentMap
from nftproxy.core.render import NoLocal, RenderedFamily
from nftproxy.core.tracker import StateSnapshot

__all__ = ["HealthTally", "NoLocalTally"]

V = TypeVar("V")
_ByPort = dict[NamespacedName, dict[ServicePortName, V]]


def _put(table: _ByPort[V], spn: ServicePortName, value: V | None) -> None:
    """Set (or, for None, drop) the value of `spn` under its service."""
    ports = table.get(spn.service)
    if value is not None:
        if ports is None:
            ports = table[spn.service] = {}
        ports[spn] = value
    elif ports is not None:
        ports.pop(spn, None)
        if not ports:
            del table[spn.service]


def _needs_server(port: ServicePort) -> bool:
    """eTP=Local on an externally accessible port, with a healthCheckNodePort."""
    return bool(port.health_check_node_port) and port.external_policy_local


class _FamilyHealth:
    """One family's per-port inputs of the health figures."""

    def __init__(self) -> None:
        self.check_ports: _ByPort[int] = {}
        self.local_ips: _ByPort[frozenset[str]] = {}

    def set_port(
        self, spn: ServicePortName, port: ServicePort | None, endpoints: Iterable[Endpoint]
    ) -> None:
        check = port.health_check_node_port if port is not None and _needs_server(port) else 0
        _put(self.check_ports, spn, check or None)
        keep = check or port is None  # a port the Service lacks counts if the Service is served
        ips = frozenset(ep.ip for ep in endpoints if ep.is_local and ep.ready) if keep else None
        _put(self.local_ips, spn, ips or None)

    def check_port(self, svc: NamespacedName) -> int | None:
        """The port of the service's last port (in name order) that needs a server."""
        ports = self.check_ports.get(svc)
        return ports[max(ports)] if ports else None

    def local_count(self, svc: NamespacedName) -> int:
        per_port = self.local_ips.get(svc)
        return len(frozenset().union(*per_port.values())) if per_port else 0


class HealthTally:
    """healthCheckNodePort and local ready endpoints per service (see the
    module docstring); `families` in the order their ports override."""

    def __init__(self, families: Iterable[IPFamily]) -> None:
        self._order = tuple(families)
        self._families = {f: _FamilyHealth() for f in self._order}
        self._ports: PersistentMap[NamespacedName, int] = PersistentMap()
        self._local: PersistentMap[NamespacedName, int] = PersistentMap()

    @property
    def health_check_ports(self) -> Mapping[NamespacedName, int]:
        return self._ports

    @property
    def local_endpoints(self) -> Mapping[NamespacedName, int]:
        return self._local

    def rebuild(self, states: Mapping[IPFamily, StateSnapshot]) -> None:
        """Recompute from the whole maps (a full sync)."""
        self._families = {f: _FamilyHealth() for f in self._order}
        self._ports, self._local = PersistentMap(), PersistentMap()
        # from empty tallies, only the ports that need a server add anything,
        # and the endpoint ports the Service lacks
        kept = {
            f: [
                *(spn for spn, port in s.services.items() if _needs_server(port)),
                *(spn for spn in s.endpoints if spn not in s.services),
            ]
            for f, s in states.items()
        }
        self.update(states, kept)

    def update(
        self,
        states: Mapping[IPFamily, StateSnapshot],
        updated: Mapping[IPFamily, Iterable[ServicePortName]],
    ) -> None:
        """Take in the ports one apply() updated, from the maps it left."""
        touched: set[NamespacedName] = set()
        for family, ports in updated.items():
            state, health = states[family], self._families[family]
            for spn in ports:
                health.set_port(spn, state.services.get(spn), state.endpoints.get(spn, ()))
                touched.add(spn.service)
        check_ports, local_counts = self._ports.edit(), self._local.edit()
        for svc in touched:
            port, local = self._merged(svc)
            if self._ports.get(svc) == port and self._local.get(svc) == local:
                continue
            _set(check_ports, svc, port)
            _set(local_counts, svc, local)
        if touched:
            self._ports, self._local = check_ports.done(), local_counts.done()

    def _merged(self, svc: NamespacedName) -> tuple[int | None, int | None]:
        port: int | None = None
        local = 0
        for f in self._order:
            port = self._families[f].check_port(svc) or port
            local = max(local, self._families[f].local_count(svc))
        return port, (local or None) if port else None


def _set(table: MapEdit[NamespacedName, int], key: NamespacedName, value: int | None) -> None:
    if value is None:
        table.pop(key, None)
    else:
        table[key] = value


class NoLocalTally:
    """One family's service ports left without a local endpoint by a Local
    policy, counted (internal, external) as render results come in."""

    def __init__(self) -> None:
        self._ports: dict[ServicePortName, NoLocal] = {}  # only ports with a True
        self.internal = 0
        self.external = 0

    def record(self, rendered: RenderedFamily) -> None:
        """Take in one committed render (a full one replaces everything)."""
        if rendered.full:
            self._ports.clear()
            self.internal = self.external = 0
        for spn, value in rendered.no_local.items():
            old = self._ports.pop(spn, None)
            if old is not None:
                self.internal -= old[0]
                self.external -= old[1]
            if value is not None and any(value):
                self._ports[spn] = value
                self.internal += value[0]
                self.external += value[1]
