"""Conntrack cleanup, pure: which flows to forget after a sync, and the loop forgetting them.

Layer: core (pure; imports model and tracker only -- no pyroute2, no
socket, no threads). One job: decide, from a sync report, which conntrack
entries would keep a UDP or SCTP flow going to an endpoint that no longer
serves the service (or past a service that has just become usable), and
run the dump/delete loop over callables the kernel edge and the fake
provide. Callers: kernel/conntrack.py (`Conntrack` and the post-commit
`conntrack_hook`), kernel/fake_conntrack.py (`FakeConntrack`), tests.

Why: NAT is decided once, on a flow's first packet. UDP has no end, so a
client that keeps sending from the same source port keeps its entry (and so
its DNAT to the old endpoint) alive for ever (kubernetes#125467, #139628). The
same holds for a flow cached while a service had no rules: it stays un-NATed
after the endpoints appear. TCP needs nothing: a dead endpoint resets the
connection and the client reconnects with a new tuple.

What is deleted (kube-proxy's reconciler, pkg/proxy/conntrack/cleanup.go,
v1.32+; upstream-nftables-notes.md §3.4): for each UDP/SCTP service port,
entries whose *original* destination is its cluster IP, an external IP or a
load-balancer VIP and its port (or whose original destination port is its
node port, any address) and whose *reply source* is not a currently serving
endpoint IP of that port. That one rule covers removed endpoints, endpoints
that stopped serving, 0 -> n endpoints (an un-NATed entry's reply source is
the service IP itself), n -> 0, and deleted services (nothing is kept).
Traffic policy and topology are ignored, as upstream.

Design (style guide 5, "decide in pure code, act once"):
- `plan(report) -> list[FlowFilter]` is pure: which destinations, and which
  reply sources to keep. Partial syncs look only at the ports the sync
  touched (update.updated, newly_active, deleted_ports), so cleanup stays
  O(changed). Full syncs (start-up, after a failed commit, hourly) reconcile
  every UDP/SCTP port, like upstream's reconciler does on every sync: that is
  what repairs flows missed by a failed cleanup or created while nftproxy was
  down. A deleted port's destination keeps the reply sources of a current
  port that now claims it (re-created service), so its flows survive.
- `apply_filters(filters, dump, delete, clock)` is the one apply loop, shared
  by the kernel's `Conntrack` and `FakeConntrack`: one dump per (family,
  protocol, port) -- a lone IPv4 destination also filters on its address;
  several destinations sharing the port (port 53 of every DNS-like service
  on a full sync), node ports and IPv6 share one dump -- a re-check here,
  then one delete per stale entry (the kernel edge answers the queries of
  a full sync from one dump per (family, protocol): kernel/conntrack.py).
  ENOENT (expired or replaced meanwhile) is counted as `vanished`; other
  failures are counted in `errors` and never raised (nft-python-notes.md
  §4).

Known limits:
- If two service ports claim the same IP:port (a conflict the API allows
  for external IPs), the one in scope decides what is kept.
- A flow that was only ever rejected (service without endpoints) leaves no
  entry, since the rejected packet never confirms it; the 0 -> n case that
  needs cleanup is a flow forwarded un-NATed before the rules existed.
- UDP flows of the node's own sockets to a service port are matched like
  any other flow (as upstream).
"""

from __future__ import annotations

import errno
import functools
import ipaddress
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from nftproxy.core.model import Endpoint, IPFamily, L4Protocol, ServicePort, ServicePortName
from nftproxy.core.tracker import UpdateResult

__all__ = [
    "CLEANED_PROTOCOLS",
    "CleanupResult",
    "Flow",
    "FlowFilter",
    "Query",
    "SyncView",
    "apply_filters",
    "canonical_ip",
    "plan",
    "plan_family",
]

CLEANED_PROTOCOLS = frozenset({L4Protocol.UDP, L4Protocol.SCTP})
"""Connectionless (UDP) or multi-homed/long-lived (SCTP): their flows outlive
an endpoint. TCP flows end with a reset and are left alone."""

_MAX_MESSAGES = 10
"""Error messages kept per CleanupResult (all errors are counted)."""


@functools.lru_cache(maxsize=1 << 14)  # several calls per conntrack entry, on few addresses
def canonical_ip(ip: str) -> str:
    """One spelling per address, so kernel and API strings compare equal
    (IPv6 above all: "fd00:0::1" and "fd00::1")."""
    return ipaddress.ip_address(ip).compressed


# --- values -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Flow:
    """One conntrack entry as cleanup sees it: the original tuple, the reply
    source (where NAT sent the flow) and, from the kernel, its id and zone.

    >>> Flow(IPFamily.IPV4, L4Protocol.UDP, "192.168.50.2", "10.96.0.10", 4000, 53,
    ...      reply_src="10.244.1.2")  # doctest: +ELLIPSIS
    Flow(family=<IPFamily.IPV4: 'IPv4'>, protocol=<L4Protocol.UDP: 'UDP'>, ...)
    """

    family: IPFamily
    protocol: L4Protocol
    src: str
    dst: str
    sport: int
    dport: int
    reply_src: str
    ct_id: int | None = None
    zone: int | None = None


@dataclass(frozen=True, slots=True)
class FlowFilter:
    """Delete the `protocol` flows whose original destination is `ip`:`port`
    (`ip` None: any address -- a node port) unless their reply source is in
    `keep` (the serving endpoint IPs; empty: delete every match)."""

    family: IPFamily
    protocol: L4Protocol
    port: int
    ip: str | None = None
    keep: frozenset[str] = frozenset()

    def matches(self, flow: Flow) -> bool:
        """The flow's original destination is the one this filter names."""
        return (
            flow.family is self.family
            and flow.protocol is self.protocol
            and flow.dport == self.port
            and (self.ip is None or canonical_ip(flow.dst) == self.ip)
        )

    def is_stale(self, flow: Flow) -> bool:
        """It matches and NAT sent it somewhere that no longer serves."""
        return self.matches(flow) and canonical_ip(flow.reply_src) not in self.keep


@dataclass(frozen=True, slots=True)
class CleanupResult:
    """What one apply() did. `matched`: entries the filtered dumps returned;
    `vanished`: stale entries already gone when deleted (ENOENT: expired, or
    replaced by a new entry with the same tuple); `errors`: failed dumps and
    deletes, with the first few `messages`."""

    filters: int = 0
    matched: int = 0
    deleted: int = 0
    vanished: int = 0
    errors: int = 0
    seconds: float = 0.0
    messages: tuple[str, ...] = ()


# --- the pure part: plan ------------------------------------------------------------


class _StateView(Protocol):
    @property
    def services(self) -> Mapping[ServicePortName, ServicePort]: ...

    @property
    def endpoints(self) -> Mapping[ServicePortName, tuple[Endpoint, ...]]: ...


class _FamilyView(Protocol):
    @property
    def family(self) -> IPFamily: ...

    @property
    def update(self) -> UpdateResult: ...

    @property
    def state(self) -> _StateView: ...


class SyncView(Protocol):
    """What cleanup reads of proxier.SyncReport (structural, so this module
    stays below the proxier in the layering)."""

    @property
    def full(self) -> bool: ...

    @property
    def families(self) -> Sequence[_FamilyView]: ...


_Destination = tuple[L4Protocol, str | None, int]
"""(protocol, original destination IP or None for a node port, port)."""


def _destinations(port: ServicePort) -> list[_Destination]:
    """Every original destination a flow to this service port may have."""
    ips = [port.cluster_ip] if port.cluster_ip else []
    ips += [*port.external_ips, *port.load_balancer_vips]
    out: list[_Destination] = [(port.protocol, canonical_ip(ip), port.port) for ip in ips]
    if port.node_port:
        out.append((port.protocol, None, port.node_port))
    return out


def _serving_ips(endpoints: Iterable[Endpoint]) -> set[str]:
    """Reply sources a flow may legitimately have: serving endpoints (ready
    or serving-terminating), as upstream's `IsServing`."""
    return {canonical_ip(ep.ip) for ep in endpoints if ep.serving}


def plan_family(
    family: IPFamily,
    update: UpdateResult,
    services: Mapping[ServicePortName, ServicePort],
    endpoints: Mapping[ServicePortName, tuple[Endpoint, ...]],
    *,
    full: bool,
) -> list[FlowFilter]:
    """The filters for one family after a sync (see the module docstring).

    Scope: every UDP/SCTP service port on a full sync, else only the ports
    this sync touched; deleted ports in both cases. Destinations shared by
    several ports in scope keep the union of their serving endpoints.
    """
    scope = set(services) if full else set(update.updated | update.newly_active)
    keep: dict[_Destination, set[str]] = {}
    for spn in sorted(scope):
        port = services.get(spn)
        if port is None or port.protocol not in CLEANED_PROTOCOLS:
            continue
        serving = _serving_ips(endpoints.get(spn, ()))
        for dest in _destinations(port):
            keep.setdefault(dest, set()).update(serving)
    deleted = [p for p in update.deleted_ports if p.protocol in CLEANED_PROTOCOLS]
    if deleted:
        claims = _claims(services, endpoints)  # O(services), only when UDP/SCTP ports went away
        for port in deleted:
            for dest in _destinations(port):
                if dest not in keep:
                    keep[dest] = set(claims.get(dest, ()))
    return [
        FlowFilter(family, proto, port_number, ip, frozenset(ips))
        for (proto, ip, port_number), ips in sorted(keep.items(), key=_dest_order)
    ]


def _dest_order(item: tuple[_Destination, set[str]]) -> tuple[str, str, int]:
    (proto, ip, port), _ = item
    return (proto.value, ip or "", port)


def _claims(
    services: Mapping[ServicePortName, ServicePort],
    endpoints: Mapping[ServicePortName, tuple[Endpoint, ...]],
) -> dict[_Destination, set[str]]:
    """Serving endpoint IPs per destination of every current UDP/SCTP port."""
    out: dict[_Destination, set[str]] = {}
    for spn, port in services.items():
        if port.protocol in CLEANED_PROTOCOLS:
            serving = _serving_ips(endpoints.get(spn, ()))
            for dest in _destinations(port):
                out.setdefault(dest, set()).update(serving)
    return out


def plan(report: SyncView) -> list[FlowFilter]:
    """The filters for a sync report, IPv4 first (pure)."""
    return [
        flt
        for fam in report.families
        for flt in plan_family(
            fam.family, fam.update, fam.state.services, fam.state.endpoints, full=report.full
        )
    ]


# --- the apply loop shared by the kernel and the fake -----------------------------------


@dataclass(frozen=True, slots=True)
class Query:
    """One dump request: the original-tuple fields the kernel filters on
    (`ip` None: any destination address)."""

    family: IPFamily
    protocol: L4Protocol
    port: int
    ip: str | None = None


def _queries(filters: Sequence[FlowFilter]) -> dict[Query, list[FlowFilter]]:
    """One dump per (family, protocol, port): a lone IPv4 destination is
    filtered on its address too; several destinations sharing a port (port
    53 of many services on a full sync) share one dump, as does IPv6 (see
    kernel/conntrack.py `_Link.dump`). Each filter lands in exactly one query."""
    by_port: dict[tuple[IPFamily, L4Protocol, int], list[FlowFilter]] = {}
    for flt in filters:
        by_port.setdefault((flt.family, flt.protocol, flt.port), []).append(flt)
    out: dict[Query, list[FlowFilter]] = {}
    for (family, protocol, port), group in by_port.items():
        ip = group[0].ip if len(group) == 1 else None
        out[Query(family, protocol, port, ip)] = group
    return out


class _Tally:
    def __init__(self) -> None:
        self.matched = self.deleted = self.vanished = self.errors = 0
        self.messages: list[str] = []

    def error(self, what: str, exc: BaseException) -> None:
        self.errors += 1
        if len(self.messages) < _MAX_MESSAGES:
            self.messages.append(f"{what}: {exc}")


def apply_filters(
    filters: Sequence[FlowFilter],
    dump: Callable[[Query], list[Flow]],
    delete: Callable[[Flow], None],
    clock: Callable[[], float],
) -> CleanupResult:
    """Dump per query, delete the stale matches. `dump` returns the flows the
    query names (it may return more: every flow is re-checked against the
    filters); `delete` raises OSError (errno ENOENT: already gone) or
    anything else on failure. A flow two filters match (a node port equal
    to a service port) goes if either calls it stale. Nothing is raised from
    here."""
    start = clock()
    tally = _Tally()
    for query, group in _queries(filters).items():
        by_ip: dict[str | None, list[FlowFilter]] = {}
        for flt in group:
            by_ip.setdefault(flt.ip, []).append(flt)
        try:
            flows = dump(query)
        except Exception as exc:  # counted; the next query may work
            tally.error(f"dump {_describe(query)}", exc)
            continue
        for flow in flows:
            matching = [
                f
                for f in (*by_ip.get(canonical_ip(flow.dst), ()), *by_ip.get(None, ()))
                if f.matches(flow)
            ]
            if not matching:
                continue
            tally.matched += 1
            if not any(f.is_stale(flow) for f in matching):
                continue
            _delete_one(flow, delete, tally)
    return CleanupResult(
        filters=len(filters),
        matched=tally.matched,
        deleted=tally.deleted,
        vanished=tally.vanished,
        errors=tally.errors,
        seconds=clock() - start,
        messages=tuple(tally.messages),
    )


def _delete_one(flow: Flow, delete: Callable[[Flow], None], tally: _Tally) -> None:
    try:
        delete(flow)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            tally.vanished += 1
        else:
            tally.error(f"delete {_describe_flow(flow)}", exc)
    except Exception as exc:
        tally.error(f"delete {_describe_flow(flow)}", exc)
    else:
        tally.deleted += 1


def _describe(query: Query) -> str:
    where = f"[{query.ip}]" if query.ip and ":" in query.ip else query.ip or "*"
    return f"{query.protocol.nft} {where}:{query.port}"


def _describe_flow(flow: Flow) -> str:
    return (
        f"{flow.protocol.nft} {flow.src}:{flow.sport} -> {flow.dst}:{flow.dport}"
        f" (reply from {flow.reply_src})"
    )
