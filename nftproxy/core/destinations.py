"""Which service ports claim the same destination, and which one wins.

Layer: core (pure; imports model and the planner's winner rule). One job:
index the destinations of every Service's ports -- cluster IP, external IPs
and LB VIPs as ip . protocol . port (one `service-ips` key, whichever field
names it), node ports as family . protocol . port (one `service-nodeports`
key per family table) -- and say, for the destinations a change touched,
who loses them. The API server never lets two Services claim one (it
allocates cluster IPs and node ports); a file source, or an external IP
set by hand, can. The winner is the planner's (core/nft/claims.py
`winner_of`: the service port whose name sorts first), so what is reported
is what is programmed.

Caller: the agent's Intake (agent/intake.py), once per Service event; it
reports each `Conflict` once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from nftproxy.core.model import IPFamily, ServicePort, ServicePortName
from nftproxy.core.nft.claims import winner_of

__all__ = ["Conflict", "Destinations"]

Key = tuple[str, str, int]
"""(address, or the family of a node port; protocol; port)."""

_NODE_PORT = "nodePort"


@dataclass(frozen=True, slots=True, order=True)
class Conflict:
    """`loser` claims `key` too, and `winner` has it."""

    key: Key
    loser: ServicePortName
    winner: ServicePortName
    field: str
    """Where the loser names the destination (spec.clusterIP, spec.externalIPs, ...)."""

    @property
    def destination(self) -> str:
        """"10.96.0.10:80/TCP", "[fd00::1]:80/TCP", "nodePort 30080/TCP (IPv4)"."""
        where, protocol, port = self.key
        if where in _FAMILIES:
            return f"nodePort {port}/{protocol} ({where})"
        host = f"[{where}]" if ":" in where else where
        return f"{host}:{port}/{protocol}"

    def message(self) -> str:
        return (
            f"{self.destination} is also claimed by {self.winner}, which wins "
            f"(the service port whose name sorts first); not programmed for {self.loser}"
        )


_FAMILIES = frozenset(f.value for f in IPFamily)


def claims_of(port: ServicePort) -> list[tuple[Key, str]]:
    """Every destination `port` claims, with the field that names it."""
    protocol = port.protocol.value
    out: list[tuple[Key, str]] = [((port.cluster_ip, protocol, port.port), "spec.clusterIP")]
    out += [((ip, protocol, port.port), "spec.externalIPs") for ip in port.external_ips]
    out += [
        ((ip, protocol, port.port), "status.loadBalancer.ingress")
        for ip in port.load_balancer_vips
    ]
    if port.node_port:
        out.append(((port.family.value, protocol, port.node_port), f"spec.ports.{_NODE_PORT}"))
    return out


Claim = tuple[ServicePortName, str]
"""A service port and the field that names the destination."""


class Destinations:
    """Destination -> the service ports claiming it; `update` one Service
    at a time, with its ports before and after (as the Proxier is told).
    A destination claimed once (nearly all) costs its key and one pair.
    Not thread-safe: the caller holds its lock."""

    def __init__(self) -> None:
        self._claims: dict[Key, Claim | tuple[Claim, ...]] = {}

    def __len__(self) -> int:
        return len(self._claims)

    def update(self, old: Iterable[ServicePort], new: Iterable[ServicePort]) -> set[Key]:
        """The ports `old` claim no more, the ports `new` claim now; the
        destinations whose claimants changed."""
        touched: set[Key] = set()
        for port in old:
            for key, _ in claims_of(port):
                self._release(key, port.name)
                touched.add(key)
        for port in new:
            for key, field in claims_of(port):
                self._claim(key, (port.name, field))
                touched.add(key)
        return touched

    def _claimants(self, key: Key) -> tuple[Claim, ...]:
        found = self._claims.get(key)
        if found is None:
            return ()
        return (found,) if isinstance(found[0], ServicePortName) else found

    def _claim(self, key: Key, claim: Claim) -> None:
        claimants = self._claimants(key)
        if any(spn == claim[0] for spn, _ in claimants):
            return  # the port's first field names it
        self._claims[key] = (*claimants, claim) if claimants else claim

    def _release(self, key: Key, spn: ServicePortName) -> None:
        rest = tuple(c for c in self._claimants(key) if c[0] != spn)
        if not rest:
            self._claims.pop(key, None)
        else:
            self._claims[key] = rest[0] if len(rest) == 1 else rest

    def conflicts(self, keys: Iterable[Key]) -> set[Conflict]:
        """The losers of `keys`: every claimant but the winner."""
        found: set[Conflict] = set()
        for key in keys:
            claimants = self._claimants(key)
            if len(claimants) < 2:
                continue
            winner = winner_of([spn for spn, _ in claimants])
            for spn, field in claimants:
                if spn != winner and isinstance(winner, ServicePortName):
                    found.add(Conflict(key, spn, winner, field))
        return found
