"""Conntrack cleanup on the kernel: the ctnetlink socket, and the post-commit hook.

Layer: kernel edge (a raw netlink socket, in a worker thread; imports the
core's conntrack plan and apply loop, never the proxier). One job: after
every successful commit, run the core's cleanup plan (core/conntrack.py:
what is deleted and why) against the kernel's conntrack table. Callers:
cli.py and the demo build a `Conntrack`; agent.py installs
`conntrack_hook(...)` as a post-commit hook of the Proxier; tests use
`FakeConntrack` (kernel/fake_conntrack.py), which runs the same apply loop.

`Conntrack.apply(filters)` is the only netlink code. The core's apply loop
asks for the flows of each (family, protocol, port); the dumps that answer
are filtered *in the kernel* on the original tuple:
- while a (family, protocol) has at most `_PORT_DUMPS` ports (a partial
  sync: a service port and its node port), one dump per port, on proto +
  dport (+ daddr for a lone IPv4 destination);
- with more ports (a full sync), one dump for all of them, on proto only;
  the entries of other ports are dropped while parsing. Every dump walks
  the whole conntrack hash, so one dump per port would cost ports x table
  size.
The core re-checks every flow, then each stale entry is deleted by its exact
original tuple plus CTA_ID (and CTA_ZONE), so an entry that was replaced in
between is not touched.

Failures (a netlink error, EPERM, ENOBUFS, a dead worker) never reach the
sync: `apply` counts them in its CleanupResult, the agent adds them to
nftproxy_conntrack_cleanup_errors_total, and `conntrack_hook` logs them
once -- the first failure at WARNING, the same causes again at DEBUG (a
persistent error would otherwise log at every sync), the first clean
cleanup after them at INFO. The next full sync reconciles every UDP/SCTP
port again, which repairs what a failed cleanup left.

Socket: one NETLINK_NETFILTER socket (nfgen_family is per message), opened
by `Conntrack`'s worker thread after it entered the namespace with
`nftproxy.kernel.netns.enter` (never creates one), which makes every request
(capabilities are checked per thread). Messages are built and parsed here
with `struct`, on kernel/nfnetlink.py's headers: pyroute2's generic decoder
made every returned entry expensive, and a port with thousands of live
flows (kube-dns) returns thousands of entries at each cleanup of it.

Known limits / costs (`test_cleanup_cost_with_10k_unrelated_entries` in
tests/test_conntrack_kernel.py prints them):
- A dump walks the whole conntrack hash (all buckets, all namespaces) even
  when it matches nothing; a cleanup makes at most `_PORT_DUMPS` dumps per
  (family, protocol).
- Every entry a dump returns is parsed: a port with many live flows costs
  in proportion to them, and a cleanup of more than `_PORT_DUMPS` ports of
  a protocol reads every entry of that protocol and family in the
  namespace.
- The kernel compares IPv6 addresses in a CTA_FILTER the wrong way round
  (6.18: a daddr filter returns the entries to every *other* address), so
  IPv6 dumps never filter on the address and the core checks it; flows to
  other IPv6 addresses on the same port are parsed for nothing.
- Kernels before 5.8 ignore CTA_FILTER and return every entry; the
  re-checks keep the result right but each dump then returns the table.
- Deleting is one netlink round trip per entry (the core's loop deletes
  flow by flow); thousands of stale flows take thousands of round trips.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

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
from nftproxy.kernel.nfnetlink import (
    ATTR,
    HEADER,
    NETLINK_NETFILTER,
    NFGENMSG,
    NLA_TYPE_MASK,
    NLM_F_DUMP,
    NLM_F_REQUEST,
    NLMSG_DONE,
    NLMSG_ERROR,
)

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
_FAMILY_BY_AF: dict[int, IPFamily] = {af: family for family, af in _AF.items()}

# linux/netlink.h, linux/netfilter/nfnetlink_conntrack.h and
# net/netfilter/nf_conntrack_netlink.c (the CTA_FILTER flags)
_SOL_NETLINK, _NETLINK_CAP_ACK = 270, 10
_NLM_F_ACK = 0x4
_NLA_F_NESTED = 0x8000
_CTNETLINK = 1 << 8  # NFNL_SUBSYS_CTNETLINK, in the message type's high byte
_CT_GET, _CT_DELETE, _CT_GET_STATS = 1, 2, 5
_CTA_TUPLE_ORIG, _CTA_TUPLE_REPLY, _CTA_ID, _CTA_ZONE, _CTA_FILTER = 1, 2, 12, 18, 25
_CTA_TUPLE_IP, _CTA_TUPLE_PROTO = 1, 2
_CTA_IP = {IPFamily.IPV4: (1, 2), IPFamily.IPV6: (3, 4)}  # CTA_IP_V{4,6}_{SRC,DST}
_CTA_PROTO_NUM, _CTA_PROTO_SRC_PORT, _CTA_PROTO_DST_PORT = 1, 2, 3
_CTA_FILTER_ORIG_FLAGS = 1
_FILTER_IP_DST, _FILTER_PROTO_NUM, _FILTER_PROTO_DST_PORT = 1 << 1, 1 << 3, 1 << 5
_BE16, _BE32 = struct.Struct("!H"), struct.Struct("!I")
_U32, _INT = struct.Struct("=I"), struct.Struct("=i")
# Ports of one (family, protocol) dumped one by one, each filtered in the kernel on
# its port: returning an entry costs far more than the kernel's walk past it.
_PORT_DUMPS = 4
_RECV_SIZE = 1 << 16  # the kernel's dump batches are at most 32 KiB
_TIMEOUT = 5.0


# --- the kernel -------------------------------------------------------------------------


class ConntrackUnavailable(OSError):
    """No conntrack socket could be opened (namespace missing, no
    CAP_NET_ADMIN, nf_conntrack absent). Raised by `Conntrack.start()` only."""


def _attr(kind: int, payload: bytes) -> bytes:
    size = ATTR.size + len(payload)
    return ATTR.pack(size, kind) + payload + bytes(-size % 4)


def _nest(kind: int, *attrs: bytes) -> bytes:
    return _attr(kind | _NLA_F_NESTED, b"".join(attrs))


def _orig_tuple(
    family: IPFamily,
    protocol: L4Protocol,
    *,
    src: str | None = None,
    dst: str | None = None,
    sport: int | None = None,
    dport: int | None = None,
) -> bytes:
    """CTA_TUPLE_ORIG with the fields given."""
    af, (src_type, dst_type) = _AF[family], _CTA_IP[family]
    ip = b"".join(
        _attr(kind, socket.inet_pton(af, addr))
        for kind, addr in ((src_type, src), (dst_type, dst))
        if addr is not None
    )
    l4 = _attr(_CTA_PROTO_NUM, bytes([_PROTO_NUMBER[protocol]])) + b"".join(
        _attr(kind, _BE16.pack(port))
        for kind, port in ((_CTA_PROTO_SRC_PORT, sport), (_CTA_PROTO_DST_PORT, dport))
        if port is not None
    )
    parts = [_nest(_CTA_TUPLE_IP, ip)] if ip else []
    return _nest(_CTA_TUPLE_ORIG, *parts, _nest(_CTA_TUPLE_PROTO, l4))


def _find(buf: bytes, pos: int, end: int, kind: int) -> tuple[int, int] | None:
    """(start, end) of the value of the first attribute of type `kind` in
    buf[pos:end], None if there is none. A loop of its own, as `_attrs`:
    every flow a dump returns is parsed, and nfnetlink's walk copies."""
    while pos + ATTR.size <= end:
        size, got = ATTR.unpack_from(buf, pos)
        if size < ATTR.size or pos + size > end:
            return None
        if got & NLA_TYPE_MASK == kind:
            return pos + ATTR.size, pos + size
        pos += (size + 3) & ~3
    return None


def _attrs(buf: bytes, pos: int, end: int) -> dict[int, tuple[int, int]]:
    """{type: (start, end) of its value} of the attributes in buf[pos:end]."""
    out: dict[int, tuple[int, int]] = {}
    while pos + ATTR.size <= end:
        size, kind = ATTR.unpack_from(buf, pos)
        if size < ATTR.size or pos + size > end:
            break
        out[kind & NLA_TYPE_MASK] = (pos + ATTR.size, pos + size)
        pos += (size + 3) & ~3
    return out


def _nested(buf: bytes, attrs: dict[int, tuple[int, int]], kind: int) -> dict[int, tuple[int, int]]:
    """The attributes inside attribute `kind` of `attrs` ({} if it is absent)."""
    return _attrs(buf, *attrs[kind]) if kind in attrs else {}


def _dport(buf: bytes, pos: int, end: int) -> int | None:
    """The original destination port of the entry whose attributes are in
    buf[pos:end], found without parsing the rest of it."""
    orig = _find(buf, pos, end, _CTA_TUPLE_ORIG)
    l4 = None if orig is None else _find(buf, *orig, _CTA_TUPLE_PROTO)
    port = None if l4 is None else _find(buf, *l4, _CTA_PROTO_DST_PORT)
    return None if port is None else int(_BE16.unpack_from(buf, port[0])[0])


def _flow_at(buf: bytes, pos: int, end: int, ports: frozenset[int]) -> Flow | None:
    """The Flow of the conntrack entry in buf[pos:end] (a message after its
    nlmsghdr); None for an entry without ports or to a port not in `ports`."""
    family = _FAMILY_BY_AF.get(buf[pos])
    pos += NFGENMSG.size
    dport = _dport(buf, pos, end)  # first: a dump of several ports drops most entries here
    if family is None or dport not in ports:
        return None
    top = _attrs(buf, pos, end)
    orig, reply = _nested(buf, top, _CTA_TUPLE_ORIG), _nested(buf, top, _CTA_TUPLE_REPLY)
    o_ip, o_l4 = _nested(buf, orig, _CTA_TUPLE_IP), _nested(buf, orig, _CTA_TUPLE_PROTO)
    r_ip = _nested(buf, reply, _CTA_TUPLE_IP)
    af, (src, dst) = _AF[family], _CTA_IP[family]
    if not (src in o_ip and dst in o_ip and src in r_ip and _CTA_PROTO_SRC_PORT in o_l4):
        return None
    number = o_l4.get(_CTA_PROTO_NUM)
    protocol = None if number is None else _PROTO_BY_NUMBER.get(buf[number[0]])
    if protocol is None:
        return None

    def ip(attrs: dict[int, tuple[int, int]], kind: int) -> str:
        start, stop = attrs[kind]
        return socket.inet_ntop(af, buf[start:stop])

    def optional(attrs: dict[int, tuple[int, int]], kind: int, fmt: struct.Struct) -> int | None:
        return int(fmt.unpack_from(buf, attrs[kind][0])[0]) if kind in attrs else None

    return Flow(
        family=family,
        protocol=protocol,
        src=ip(o_ip, src),
        dst=ip(o_ip, dst),
        sport=int(_BE16.unpack_from(buf, o_l4[_CTA_PROTO_SRC_PORT][0])[0]),
        dport=dport,
        reply_src=ip(r_ip, src),
        ct_id=optional(top, _CTA_ID, _BE32),
        zone=optional(top, _CTA_ZONE, _BE16),
    )


def _open_socket() -> socket.socket:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    try:
        sock.setsockopt(_SOL_NETLINK, _NETLINK_CAP_ACK, 1)  # acks without the request
        sock.settimeout(_TIMEOUT)
        sock.bind((0, 0))
    except BaseException:
        sock.close()
        raise
    return sock


class _Link:
    """The worker's ctnetlink socket, in the worker's namespace."""

    def __init__(self) -> None:
        self._seq = 0
        self._sock = _open_socket()
        try:  # fails here, not at the first cleanup, without CAP_NET_ADMIN or conntrack
            for _ in self._request(_CT_GET_STATS, socket.AF_UNSPEC, b"", _NLM_F_ACK):
                pass
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self._sock.close()

    def _request(
        self, kind: int, af: int, body: bytes, flags: int
    ) -> Iterator[tuple[bytes, int, int]]:
        """Send one ctnetlink request; yield (buffer, start, end) of each
        message of its answer up to NLMSG_DONE or the ack. The kernel's error
        answer raises OSError(errno)."""
        self._seq = seq = self._seq % 0xFFFFFFFF + 1
        length = HEADER.size + NFGENMSG.size + len(body)
        header = HEADER.pack(length, _CTNETLINK | kind, NLM_F_REQUEST | flags, seq, 0)
        answered = False
        try:
            self._sock.send(header + NFGENMSG.pack(af, 0, 0) + body)
            while True:
                buf, _, msg_flags, _ = self._sock.recvmsg(_RECV_SIZE)
                if msg_flags & socket.MSG_TRUNC:
                    raise OSError(errno.EMSGSIZE, "netlink message truncated")
                pos = 0
                while pos + HEADER.size <= len(buf):
                    size, msg_type, _, msg_seq, _ = HEADER.unpack_from(buf, pos)
                    if size < HEADER.size:
                        raise OSError(errno.EBADMSG, "malformed netlink message")
                    if msg_seq == seq:
                        if msg_type in (NLMSG_DONE, NLMSG_ERROR):
                            answered = True
                            code = -_INT.unpack_from(buf, pos + HEADER.size)[0]
                            if code:
                                raise OSError(code, os.strerror(code))
                            return
                        yield buf, pos + HEADER.size, pos + size
                    pos += (size + 3) & ~3
        finally:
            # the rest of an answer, or a dump still running, would meet the next request
            if not answered:
                self._sock.close()
                self._sock = _open_socket()

    def dump(
        self, family: IPFamily, protocol: L4Protocol, ports: frozenset[int], ip: str | None
    ) -> list[Flow]:
        """The flows of `protocol` to one of `ports`. The kernel filters on the
        protocol, and on the port and `ip` when there is one port -- on `ip`
        for IPv4 only: the kernel's IPv6 address match is inverted (see above)."""
        flags, port, dst = _FILTER_PROTO_NUM, None, None
        if len(ports) == 1:
            (port,) = ports
            flags |= _FILTER_PROTO_DST_PORT
            if ip is not None and family is IPFamily.IPV4:
                dst, flags = ip, flags | _FILTER_IP_DST
        body = _orig_tuple(family, protocol, dst=dst, dport=port) + _nest(
            _CTA_FILTER, _attr(_CTA_FILTER_ORIG_FLAGS, _U32.pack(flags))
        )
        # Read the whole dump before deleting: the socket is busy until then.
        return [
            flow
            for buf, start, end in self._request(_CT_GET, _AF[family], body, NLM_F_DUMP)
            if (flow := _flow_at(buf, start, end, ports)) is not None
        ]

    def delete(self, flow: Flow) -> None:
        body = _orig_tuple(
            flow.family,
            flow.protocol,
            src=flow.src,
            dst=flow.dst,
            sport=flow.sport,
            dport=flow.dport,
        )
        if flow.ct_id is not None:  # ENOENT if the tuple now names another entry
            body += _attr(_CTA_ID, _BE32.pack(flow.ct_id))
        if flow.zone:
            body += _attr(_CTA_ZONE, _BE16.pack(flow.zone))
        for _ in self._request(_CT_DELETE, _AF[flow.family], body, _NLM_F_ACK):
            pass


def _dumper(link: _Link, filters: Sequence[FlowFilter]) -> Callable[[Query], list[Flow]]:
    """The `dump` of one apply_filters run: one dump per query while a
    (family, protocol) has at most _PORT_DUMPS ports, else one dump for all
    its queries (see the module docstring)."""
    ports: dict[tuple[IPFamily, L4Protocol], frozenset[int]] = {}
    for flt in filters:
        key = (flt.family, flt.protocol)
        ports[key] = ports.get(key, frozenset()) | {flt.port}
    shared: dict[tuple[IPFamily, L4Protocol], dict[int, list[Flow]]] = {}

    def dump(query: Query) -> list[Flow]:
        key = (query.family, query.protocol)
        wanted = ports.get(key, frozenset())
        if len(wanted) <= _PORT_DUMPS:
            return link.dump(query.family, query.protocol, frozenset({query.port}), query.ip)
        if key not in shared:
            by_port: dict[int, list[Flow]] = {}
            for flow in link.dump(query.family, query.protocol, wanted, None):
                by_port.setdefault(flow.dport, []).append(flow)
            shared[key] = by_port
        return shared[key].pop(query.port, [])

    return dump


class Conntrack(_netns.WorkerOwner["_Link"]):
    """The kernel's conntrack table, in the caller's netns or a named one.

    The constructor only stores its arguments; `start()` opens the socket
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
            _Link,
            name="conntrack",
            close_resource=_Link.close,
            wrap_error=lambda exc: ConntrackUnavailable(
                f"cannot open conntrack socket (netns {netns}): {exc}"
            ),
        )

    def apply(self, filters: Sequence[FlowFilter]) -> CleanupResult:
        """Delete the stale flows of every filter; failures are counted in
        the result, never raised (RuntimeError only if not started)."""
        if not self._worker.running:
            raise RuntimeError("Conntrack not started (or closed)")
        if not filters:
            return CleanupResult()
        return self._worker.call(
            lambda link: apply_filters(filters, _dumper(link, filters), link.delete, self._clock)
        )


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
