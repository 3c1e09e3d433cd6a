"""Conntrack cleanup on the kernel: the netlink sockets, and the post-commit hook.

Layer: kernel edge (pyroute2, in a worker thread; imports the core's
conntrack plan and apply loop, never the proxier). One job: after every
successful commit, run the core's cleanup plan (core/conntrack.py: what is
deleted and why) against the kernel's conntrack table. Callers: cli.py and
the demo build a `Conntrack`; agent.py installs `conntrack_hook(...)` as a
post-commit hook of the Proxier; tests use `FakeConntrack`
(kernel/fake_conntrack.py), which runs the same apply loop.

`Conntrack.apply(filters)` is the only netlink code: one dump per (family,
protocol, port), filtered *in the kernel* on the original tuple (daddr +
proto + dport for a lone IPv4 destination; proto + dport when several
destinations share the port, for node ports and for IPv6), a re-check in
Python, then one delete per stale entry by its exact original tuple plus
CTA_ID (and CTA_ZONE), so an entry that was replaced in between is not
touched.

Failures (a netlink error, EPERM, ENOBUFS, a dead worker) never reach the
sync: `apply` counts them in its CleanupResult, the agent adds them to
nftproxy_conntrack_cleanup_errors_total, and `conntrack_hook` logs them
once -- the first failure at WARNING, the same causes again at DEBUG (a
persistent error would otherwise log at every sync), the first clean
cleanup after them at INFO. The next full sync reconciles every UDP/SCTP
port again, which repairs what a failed cleanup left.

Sockets: pyroute2 0.9's sync `Conntrack` keeps its socket and event loop
*per thread* and, with `netns=`, forks a child per thread to make the socket
(whose default `flags=O_CREAT` would also create a missing namespace). So
`Conntrack` owns one worker thread that enters the namespace with
`nftproxy.kernel.netns.enter` (never creates one; no fork) and there opens two
sockets, AF_INET and AF_INET6 (nfgen_family is per socket). pyroute2 is
imported by that worker only, without its package __init__
(kernel/pyroute2_modules.py): `plan()` and the fake cost no import.

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
- Deleting is one netlink request per entry (pyroute2 has no batch
  delete); thousands of stale flows take seconds.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from nftproxy.core.conntrack import (
    CleanupResult,
    Flow,
    FlowFilter,
    Query,
    SyncView,
    apply_filters,
    plan,
)
from nftproxy.core.model import IPFamily, L4Protocol
from nftproxy.kernel import netns as _netns
from nftproxy.kernel import pyroute2_modules

__all__ = [
    "Cleaner",
    "Conntrack",
    "ConntrackUnavailable",
    "conntrack_hook",
]

_PROTO_NUMBER = {
    L4Protocol.TCP: socket.IPPROTO_TCP,
    L4Protocol.UDP: socket.IPPROTO_UDP,
    L4Protocol.SCTP: socket.IPPROTO_SCTP,
}
_PROTO_BY_NUMBER = {n: p for p, n in _PROTO_NUMBER.items()}
_AF = {IPFamily.IPV4: socket.AF_INET, IPFamily.IPV6: socket.AF_INET6}


# --- the kernel -------------------------------------------------------------------------


class ConntrackUnavailable(OSError):
    """No conntrack socket could be opened (namespace missing, no
    CAP_NET_ADMIN, nf_conntrack absent). Raised by `Conntrack.start()` only."""


class _Sockets:
    """The worker's two pyroute2 sockets (one per nfgen_family)."""

    def __init__(self) -> None:
        # imported here, where used (~50 ms), without pyroute2's package __init__
        conntrack = pyroute2_modules.module("pyroute2.conntrack")
        self._attr_tuple: Any = pyroute2_modules.module(
            "pyroute2.netlink.nfnetlink.nfctsocket"
        ).NFCTAttrTuple
        self._netlink_error: Any = pyroute2_modules.module(
            "pyroute2.netlink.exceptions"
        ).NetlinkError
        self.by_family: dict[IPFamily, Any] = {}
        try:
            for family, af in _AF.items():
                sock = conntrack.Conntrack(nfgen_family=af)
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
        # The kernel compares IPv6 addresses of a CTA_FILTER the wrong way
        # round (6.18: a daddr filter returns the entries to every *other*
        # address), so IPv6 dumps filter on proto + dport only; the caller
        # re-checks the address.
        daddr = query.ip if query.family is IPFamily.IPV4 else None
        orig = self._attr_tuple(
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
        orig = self._attr_tuple(
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
        except self._netlink_error as exc:
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
        return self._worker.call(lambda s: apply_filters(filters, s.dump, s.delete, self._clock))


# --- the post-commit hook ------------------------------------------------------------------


class Cleaner(Protocol):
    """What the hook needs: Conntrack and FakeConntrack."""

    def apply(self, filters: Sequence[FlowFilter]) -> CleanupResult: ...


class _Failures:
    """Failed cleanups are logged once: the first at WARNING, repeats of the
    same causes at DEBUG (a netlink error that persists would otherwise log
    at every sync), and the first clean cleanup after them at INFO."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self._causes: frozenset[str] | None = None
        self._repeats = 0

    def failed(self, causes: frozenset[str], message: str, fields: dict[str, object]) -> None:
        new = causes != self._causes
        self._causes, self._repeats = causes, 0 if new else self._repeats + 1
        self.log.log(
            logging.WARNING if new else logging.DEBUG,
            "%s (until it changes, repeats are logged at debug level)",
            message,
            extra=fields,
        )

    def succeeded(self) -> None:
        if self._causes is not None:
            self.log.info("conntrack cleanup works again after %d repeated failures",
                          self._repeats + 1)
        self._causes, self._repeats = None, 0


def _cause(message: str) -> str:
    """The error of `dump udp 10.96.0.10:53: <error>` (core/conntrack.py),
    without the flow it happened to."""
    return message.split(": ", 1)[-1]


def conntrack_hook(
    conntrack: Cleaner,
    *,
    log: logging.Logger,
    on_result: Callable[[CleanupResult], None] | None = None,
) -> Callable[[SyncView], None]:
    """A Proxier post-commit hook: plan from the report, apply, log.

    Never raises: a failed plan or apply is logged once (`_Failures`) and
    reported to `on_result` (metrics) as a result with `errors` >= 1. Syncs
    that need no filter cost nothing and report nothing.
    """
    failures = _Failures(log)

    def conntrack_cleanup(report: SyncView) -> None:
        filters: list[FlowFilter] = []
        try:
            filters = plan(report)
            if not filters:
                return
            result = conntrack.apply(filters)
        except Exception as exc:
            log.debug("conntrack cleanup raised", exc_info=True)
            result = CleanupResult(filters=len(filters), errors=1, messages=(str(exc),))
            failures.failed(frozenset(result.messages), f"conntrack cleanup failed: {exc}", {})
        else:
            fields: dict[str, object] = {
                "filters": result.filters,
                "matched": result.matched,
                "deleted": result.deleted,
                "vanished": result.vanished,
                "errors": result.errors,
                "seconds": round(result.seconds, 4),
            }
            if result.errors:
                failures.failed(
                    frozenset(_cause(m) for m in result.messages),
                    f"conntrack cleanup had {result.errors} errors: "
                    + "; ".join(result.messages),
                    fields,
                )
            else:
                failures.succeeded()
                log.debug("conntrack cleanup", extra=fields)
        if on_result is not None:
            try:
                on_result(result)
            except Exception:
                log.exception("conntrack cleanup result callback failed")

    return conntrack_cleanup
