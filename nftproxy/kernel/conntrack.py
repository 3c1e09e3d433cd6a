"""Conntrack cleanup: forget UDP and SCTP flows that point where no rule sends traffic.

Layer: conntrack edge (a sibling of nft/; imports model and tracker only,
never proxier). One job: after every successful commit, delete the conntrack
entries that would keep a UDP or SCTP flow going to an endpoint that no
longer serves the service (or past a service that has just become usable).
Callers: cli.py builds a `Conntrack` and installs `conntrack_hook(...)` as a
post-commit hook of the Proxier; tests use `FakeConntrack`.

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
- `Conntrack.apply(filters)` is the only netlink code: one dump per
  (family, protocol, port), filtered *in the kernel* on the original tuple
  (daddr + proto + dport for a lone IPv4 destination; proto + dport when
  several destinations share the port -- port 53 of every DNS-like service
  on a full sync -- and for node ports and IPv6), a re-check in Python,
  then one delete per stale entry by its exact original tuple plus CTA_ID
  (and CTA_ZONE), so an entry that was replaced in between is not touched.
  ENOENT (expired or replaced meanwhile) is counted as `vanished`; other
  failures are counted in `errors` and never raised (nft-python-notes.md
  §4).
- `FakeConntrack` holds flow tuples and runs the same apply loop.

Sockets: pyroute2 0.9's sync `Conntrack` keeps its socket and event loop
*per thread* and, with `netns=`, forks a child per thread to make the socket
(whose default `flags=O_CREAT` would also create a missing namespace). So
`Conntrack` owns one worker thread that enters the namespace with
`nftproxy.kernel.netns.enter` (never creates one; no fork) and there opens two
sockets, AF_INET and AF_INET6 (nfgen_family is per socket). pyroute2 is
imported by that worker only: `plan()` and the fake cost no 140 ms import.

Known limits / costs (kernel 6.18, pyroute2 0.9.7, 2 vCPUs,
nf_conntrack_buckets 262144; `test_cleanup_cost_with_10k_unrelated_entries`
in tests/test_conntrack_kernel.py prints them):
- With 10,000 unrelated UDP entries in the table, the cleanup after a
  partial sync that touched one UDP service port (cluster IP + node port:
  2 dumps, nothing stale) takes ~9.5 ms; with 100 stale entries to delete
  ~57-77 ms (~0.5 ms per delete, one netlink round trip each). A full sync
  reconciling 250 UDP ports (500 filters, 251 dumps) takes ~1.2 s. An
  unfiltered dump of the same table takes 2.1-3 s: never dump everything.
  (Medians of quiet runs; with other tests loading the 2 vCPUs every figure
  doubled.)
- A dump costs ~4.5 ms even when it matches nothing: the kernel walks the
  whole conntrack hash (all buckets, all namespaces) per dump (~4 ms on an
  empty table here). So a full sync costs ~4.5 ms per distinct UDP/SCTP
  port and node port, in the sync thread. Matched entries are parsed by
  pyroute2 at ~0.25 ms each: a port with thousands of live flows (kube-dns)
  costs that much per cleanup of it.
- The kernel compares IPv6 addresses in a CTA_FILTER the wrong way round
  (6.18: a daddr filter returns the entries to every *other* address), so
  IPv6 dumps filter on proto + dport only and the address is checked here;
  flows to other IPv6 addresses on the same port are parsed for nothing.
- Kernels before 5.8 ignore CTA_FILTER and return every entry; the Python
  re-check keeps the result right but each dump then costs a full dump.
- If two service ports claim the same IP:port (a conflict the API allows
  for external IPs), the one in scope decides what is kept.
- Deleting is one netlink request per entry (pyroute2 has no batch
  delete); thousands of stale flows take seconds.
- A flow that was only ever rejected (service without endpoints) leaves no
  entry, since the rejected packet never confirms it; the 0 -> n case that
  needs cleanup is a flow forwarded un-NATed before the rules existed.
- UDP flows of the node's own sockets to a service port are matched like
  any other flow (as upstream).
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from nftproxy.core.model import Endpoint, IPFamily, L4Protocol, ServicePort, ServicePortName
from nftproxy.core.tracker import UpdateResult
from nftproxy.kernel import netns as _netns

__all__ = [
    "CLEANED_PROTOCOLS",
    "Cleaner",
    "CleanupResult",
    "Conntrack",
    "ConntrackUnavailable",
    "FakeConntrack",
    "Flow",
    "FlowFilter",
    "Query",
    "SyncView",
    "conntrack_hook",
    "plan",
    "plan_family",
]

CLEANED_PROTOCOLS = frozenset({L4Protocol.UDP, L4Protocol.SCTP})
"""Connectionless (UDP) or multi-homed/long-lived (SCTP): their flows outlive
an endpoint. TCP flows end with a reset and are left alone."""

_PROTO_NUMBER = {
    L4Protocol.TCP: socket.IPPROTO_TCP,
    L4Protocol.UDP: socket.IPPROTO_UDP,
    L4Protocol.SCTP: socket.IPPROTO_SCTP,
}
_PROTO_BY_NUMBER = {n: p for p, n in _PROTO_NUMBER.items()}
_AF = {IPFamily.IPV4: socket.AF_INET, IPFamily.IPV6: socket.AF_INET6}
_MAX_MESSAGES = 10
"""Error messages kept per CleanupResult (all errors are counted)."""

T = TypeVar("T")


def _canonical(ip: str) -> str:
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
            and (self.ip is None or _canonical(flow.dst) == self.ip)
        )

    def is_stale(self, flow: Flow) -> bool:
        """It matches and NAT sent it somewhere that no longer serves."""
        return self.matches(flow) and _canonical(flow.reply_src) not in self.keep


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
    out: list[_Destination] = [(port.protocol, _canonical(ip), port.port) for ip in ips]
    if port.node_port:
        out.append((port.protocol, None, port.node_port))
    return out


def _serving_ips(endpoints: Iterable[Endpoint]) -> set[str]:
    """Reply sources a flow may legitimately have: serving endpoints (ready
    or serving-terminating), as upstream's `IsServing`."""
    return {_canonical(ep.ip) for ep in endpoints if ep.serving}


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


# --- the shared apply loop ------------------------------------------------------------


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
    `_Sockets.dump`). Each filter lands in exactly one query."""
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


def _apply(
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
                for f in (*by_ip.get(_canonical(flow.dst), ()), *by_ip.get(None, ()))
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


# --- the fake ---------------------------------------------------------------------------


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
        return _apply(filters, self._dump, self._delete, self.clock)

    def _dump(self, query: Query) -> list[Flow]:
        self.dumps.append(query)
        if query in self.broken:
            raise OSError(errno.ENOBUFS, "No buffer space available")
        return [
            f
            for f in self.flows
            if (f.family, f.protocol, f.dport) == (query.family, query.protocol, query.port)
            and (query.ip is None or _canonical(f.dst) == query.ip)
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


# --- the kernel -------------------------------------------------------------------------


class ConntrackUnavailable(OSError):
    """No conntrack socket could be opened (namespace missing, no
    CAP_NET_ADMIN, nf_conntrack absent). Raised by `Conntrack.start()` only."""


class _Sockets:
    """The worker's two pyroute2 sockets (one per nfgen_family)."""

    def __init__(self) -> None:
        from pyroute2 import Conntrack as _PyConntrack  # 140 ms: only where used

        self.by_family: dict[IPFamily, Any] = {}
        try:
            for family, af in _AF.items():
                sock = _PyConntrack(nfgen_family=af)
                self.by_family[family] = sock
                sock.count()  # opens the socket, here, in this thread's netns
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for sock in self.by_family.values():
            sock.close()
        self.by_family.clear()

    def dump(self, query: Query) -> list[Flow]:
        from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

        # The kernel compares IPv6 addresses of a CTA_FILTER the wrong way
        # round (6.18: a daddr filter returns the entries to every *other*
        # address), so IPv6 dumps filter on proto + dport only; the caller
        # re-checks the address.
        daddr = query.ip if query.family is IPFamily.IPV4 else None
        orig = NFCTAttrTuple(
            family=_AF[query.family],
            daddr=daddr,
            proto=_PROTO_NUMBER[query.protocol],
            dport=query.port,
        )
        sock = self.by_family[query.family]
        # Read the whole (filtered) dump before deleting: the socket is busy until then.
        msgs = list(sock.dump(tuple_orig=orig))
        return [flow for msg in msgs if (flow := _flow_of(query.family, msg)) is not None]

    def delete(self, flow: Flow) -> None:
        from pyroute2.netlink.exceptions import NetlinkError
        from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

        orig = NFCTAttrTuple(
            family=_AF[flow.family],
            saddr=flow.src,
            daddr=flow.dst,
            proto=_PROTO_NUMBER[flow.protocol],
            sport=flow.sport,
            dport=flow.dport,
        )
        extra: dict[str, int] = {}
        if flow.ct_id is not None:
            extra["id"] = flow.ct_id  # ENOENT if the tuple now names another entry
        if flow.zone:
            extra["zone"] = flow.zone
        try:
            self.by_family[flow.family].entry("del", tuple_orig=orig, **extra)
        except NetlinkError as exc:
            raise OSError(exc.code, str(exc)) from exc


def _flow_of(family: IPFamily, msg: Any) -> Flow | None:
    """A Flow from one nfct_msg; None for entries without ports (not ours)."""
    v = "V4" if family is IPFamily.IPV4 else "V6"
    orig, reply = msg.get_attr("CTA_TUPLE_ORIG"), msg.get_attr("CTA_TUPLE_REPLY")
    if orig is None or reply is None:
        return None
    o_ip, o_l4 = orig.get_attr("CTA_TUPLE_IP"), orig.get_attr("CTA_TUPLE_PROTO")
    r_ip = reply.get_attr("CTA_TUPLE_IP")
    protocol = _PROTO_BY_NUMBER.get(o_l4.get_attr("CTA_PROTO_NUM"))
    sport, dport = o_l4.get_attr("CTA_PROTO_SRC_PORT"), o_l4.get_attr("CTA_PROTO_DST_PORT")
    if protocol is None or sport is None or dport is None:
        return None
    return Flow(
        family=family,
        protocol=protocol,
        src=o_ip.get_attr(f"CTA_IP_{v}_SRC"),
        dst=o_ip.get_attr(f"CTA_IP_{v}_DST"),
        sport=sport,
        dport=dport,
        reply_src=r_ip.get_attr(f"CTA_IP_{v}_SRC"),
        ct_id=msg.get_attr("CTA_ID"),
        zone=msg.get_attr("CTA_ZONE"),
    )


class Conntrack(_netns.WorkerOwner["_Sockets"]):
    """The kernel's conntrack table, in the caller's netns or a named one.

    The constructor only stores its arguments; `start()` opens the sockets
    (ConntrackUnavailable if it cannot); `apply()` may be called from any
    thread (calls are serialised on the worker). Use as a context manager or
    call `close()`.
    """

    def __init__(
        self, *, netns: str | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        self._worker = _netns.Worker(
            netns,
            _Sockets,
            name="conntrack",
            close_resource=_Sockets.close,
            wrap_error=lambda exc: ConntrackUnavailable(
                f"cannot open conntrack sockets (netns {netns}): {exc}"
            ),
        )

    def apply(self, filters: Sequence[FlowFilter]) -> CleanupResult:
        """Delete the stale flows of every filter; failures are counted in
        the result, never raised (RuntimeError only if not started)."""
        if not self._worker.running:
            raise RuntimeError("Conntrack not started (or closed)")
        if not filters:
            return CleanupResult()
        return self._worker.call(lambda s: _apply(filters, s.dump, s.delete, self._clock))


# --- the post-commit hook ------------------------------------------------------------------


class Cleaner(Protocol):
    """What the hook needs: Conntrack and FakeConntrack."""

    def apply(self, filters: Sequence[FlowFilter]) -> CleanupResult: ...


def conntrack_hook(
    conntrack: Cleaner,
    *,
    log: logging.Logger,
    on_result: Callable[[CleanupResult], None] | None = None,
) -> Callable[[SyncView], None]:
    """A Proxier post-commit hook: plan from the report, apply, log.

    Never raises: a failed plan or apply is logged and reported to
    `on_result` (metrics) as a result with `errors` >= 1. Syncs that need no
    filter cost nothing and report nothing.
    """

    def conntrack_cleanup(report: SyncView) -> None:
        filters: list[FlowFilter] = []
        try:
            filters = plan(report)
            if not filters:
                return
            result = conntrack.apply(filters)
        except Exception as exc:
            log.warning("conntrack cleanup failed: %s", exc, exc_info=True)
            result = CleanupResult(filters=len(filters), errors=1, messages=(str(exc),))
        else:
            fields = {
                "filters": result.filters,
                "matched": result.matched,
                "deleted": result.deleted,
                "vanished": result.vanished,
                "errors": result.errors,
                "seconds": round(result.seconds, 4),
            }
            if result.errors:
                log.warning(
                    "conntrack cleanup had %d errors: %s",
                    result.errors,
                    "; ".join(result.messages),
                    extra=fields,
                )
            else:
                log.debug("conntrack cleanup", extra=fields)
        if on_result is not None:
            try:
                on_result(result)
            except Exception:
                log.exception("conntrack cleanup result callback failed")

    return conntrack_cleanup
