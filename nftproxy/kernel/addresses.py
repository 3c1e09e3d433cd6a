"""The host's interface addresses, read and watched over rtnetlink.

Layer: kernel edge (pyroute2 and a netlink socket, on threads that entered
the agent's network namespace; imports the core's model only). One job: hand
the addresses of the host's interfaces to whoever selects node-port
addresses from them (nodePortAddresses CIDRs: kube-proxy's GetNodeIPs takes
the host's interface addresses, not the Node object's). The filtering
(CIDRs, "primary", loopback) is the core's: core/rules/skeleton.py
`nodeport_ips`. Callers: cli.py `sync` reads once (`read_host_addresses`);
`run` and the demo give the Agent an `AddressWatch`, which it starts only
when nodePortAddresses restricts node ports.

A reading (`HostAddresses`) holds every address of every interface, per
family, sorted, loopback and link-local included; for a point-to-point IPv4
address the local end (IFA_LOCAL), as Go's net.InterfaceAddrs.

Keeping it current: netlink address events, not a periodic re-read. The
watch subscribes to RTNLGRP_IPV4_IFADDR and RTNLGRP_IPV6_IFADDR on a plain
netlink socket (subscribed before the first reading, so no change falls in
between); any message -- or an overrun (ENOBUFS) -- means "something
changed": the socket is drained and the addresses are read again in full, so
nothing is parsed from events and a lost event cannot leave a stale value.
A reading equal to the last one is not handed on.

Why events (`test_costs_of_reading_and_of_events` in
tests/test_addresses_kernel.py prints what each costs): a reading grows
with the node's addresses (pyroute2 parses each one); an address added is
handed on one reading later; while nothing changes the watch costs nothing
(a thread blocked in select). A periodic check would cost a reading per
period whether or not anything changed, and reach the rules up to a period
late: re-reading on every sync adds a reading to every sync (with a
thousand addresses, more than a partial sync itself costs) and still waits
up to syncPeriod when nothing else changes; events reach the rules within
minSyncPeriod. The price is one thread and one socket.
Pods coming and going add IPv6 link-local addresses on host veths, so
events come with pod churn too: each costs one reading, and the Proxier
re-programs only when the node-port addresses it selects changed.

Known limits: Linux only; a reading that fails inside the watch is logged
and the last value kept (the next event retries).
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import selectors
import socket
import threading
from collections.abc import Callable
from typing import Any

from nftproxy.core.model import HostAddresses
from nftproxy.kernel import netns as _netns
from nftproxy.kernel import pyroute2_modules

__all__ = ["AddressWatch", "AddressesUnavailable", "read_host_addresses"]

_RTMGRP_IPV4_IFADDR = 0x10  # 1 << (RTNLGRP_IPV4_IFADDR - 1)
_RTMGRP_IPV6_IFADDR = 0x100  # 1 << (RTNLGRP_IPV6_IFADDR - 1)
_RCVBUF = 1 << 20


class AddressesUnavailable(OSError):
    """The addresses could not be read (namespace missing, no netlink).
    Raised by `read_host_addresses` and `AddressWatch.start()` only."""


def _reading(messages: Any) -> HostAddresses:
    """A HostAddresses from RTM_NEWADDR messages (pyroute2 ifaddrmsg)."""
    found: dict[int, set[ipaddress.IPv4Address | ipaddress.IPv6Address]] = {
        socket.AF_INET: set(),
        socket.AF_INET6: set(),
    }
    for msg in messages:
        text = msg.get("IFA_LOCAL") or msg.get("IFA_ADDRESS")
        if text is None or msg["family"] not in found:
            continue
        found[msg["family"]].add(ipaddress.ip_address(text))
    return HostAddresses(
        tuple(str(a) for a in sorted(found[socket.AF_INET])),
        tuple(str(a) for a in sorted(found[socket.AF_INET6])),
    )


class _Rtnl:
    """The worker's sockets: the event subscription first, then pyroute2's
    IPRoute for the readings (its socket is bound to the opening thread)."""

    def __init__(self, *, subscribe: bool) -> None:
        # imported here, where used, without pyroute2's package __init__
        iproute = pyroute2_modules.module("pyroute2.iproute")

        self.events: socket.socket | None = None
        if subscribe:
            self.events = _subscribe()
        try:
            self.ipr = iproute.IPRoute()
        except BaseException:
            self.close_events()
            raise

    def read(self) -> HostAddresses:
        return _reading(self.ipr.get_addr())

    def close_events(self) -> None:
        if self.events is not None:
            self.events.close()

    def close(self) -> None:
        self.close_events()
        self.ipr.close()


def _subscribe() -> socket.socket:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RCVBUF)
        sock.bind((0, _RTMGRP_IPV4_IFADDR | _RTMGRP_IPV6_IFADDR))
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _drain(sock: socket.socket) -> None:
    """Read every pending event (their content does not matter)."""
    while True:
        try:
            sock.recv(65536)
        except BlockingIOError:
            return
        except OSError as exc:
            if exc.errno != errno.ENOBUFS:  # an overrun: a full reading follows anyway
                raise


def _worker(netns: str | None, *, subscribe: bool) -> _netns.Worker[_Rtnl]:
    return _netns.Worker(
        netns,
        lambda: _Rtnl(subscribe=subscribe),
        name="addresses",
        close_resource=_Rtnl.close,
        wrap_error=lambda exc: AddressesUnavailable(
            f"cannot read interface addresses (netns {netns}): {exc}"
        ),
    )


def _read(worker: _netns.Worker[_Rtnl]) -> HostAddresses:
    try:
        return worker.call(_Rtnl.read)
    except Exception as exc:  # pyroute2's NetlinkError is no OSError
        raise AddressesUnavailable(f"cannot read interface addresses: {exc}") from exc


def read_host_addresses(netns: str | None = None) -> HostAddresses:
    """One reading of the addresses in `netns` (None: this process's)."""
    worker = _worker(netns, subscribe=False)
    worker.start()
    try:
        return _read(worker)
    finally:
        worker.stop()


class AddressWatch:
    """The host's addresses, handed to a callback now and on every change.

    The constructor only stores; `start(on_change)` subscribes, reads once,
    hands that reading to `on_change` before returning (AddressesUnavailable
    if it cannot), then watches on a thread of its own, calling `on_change`
    there with every reading that differs from the last. `close()` stops it
    (idempotent). One start per watch.
    """

    def __init__(self, *, netns: str | None = None, log: logging.Logger | None = None) -> None:
        self._worker = _worker(netns, subscribe=True)
        self._log = log or logging.getLogger(__name__)
        self._wake_r, self._wake_w = -1, -1
        self._thread: threading.Thread | None = None
        self._last: HostAddresses | None = None

    def start(self, on_change: Callable[[HostAddresses], None]) -> None:
        self._worker.start()
        try:
            self._last = _read(self._worker)
            on_change(self._last)
            events = self._worker.call(lambda r: r.events)
        except BaseException:
            self._worker.stop()
            raise
        assert events is not None  # subscribe=True
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(
            target=self._watch, args=(events, on_change), name="addresses-watch", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            os.write(self._wake_w, b"x")
            self._thread.join()
            self._thread = None
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
        self._worker.stop()

    def _watch(self, events: socket.socket, on_change: Callable[[HostAddresses], None]) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(events, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while all(key.fileobj is events for key, _ in sel.select()):
                try:
                    _drain(events)
                except OSError as exc:  # the socket is unusable: stop, never spin
                    self._log.error("interface address events lost, watch stopped: %s", exc)
                    return
                self._changed(on_change)

    def _changed(self, on_change: Callable[[HostAddresses], None]) -> None:
        try:
            reading = self._worker.call(_Rtnl.read)
        except Exception as exc:  # keep the last value; the next event retries
            self._log.warning("reading interface addresses failed: %s", exc)
            return
        if reading == self._last:
            return
        self._last = reading
        try:
            on_change(reading)
        except Exception:  # a failing consumer must not end the watch
            self._log.exception("handing on interface addresses failed")
