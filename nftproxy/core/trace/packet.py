"""What is traced: one packet, where it comes from, and what the node is.

Layer: core/trace (pure). One job: the inputs of a trace as values. A
`Packet` is the first packet of a new connection (src, dst, protocol,
destination port, optional source port) and its `Origin`: a pod on this
node or an external client (it enters through prerouting) or the node
itself (it leaves through output). `Host` is what routing needs to know of
the node: its own addresses (`fib ... type local`, and whether the packet
is delivered to the node or forwarded after DNAT).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

from nftproxy.core.address import format_address
from nftproxy.core.model import IPFamily
from nftproxy.core.trace.values import Address, protocol_number

__all__ = ["Host", "Origin", "Packet"]

_L4 = ("tcp", "udp", "sctp")


class Origin(str, Enum):
    POD = "pod"
    """A pod on this node: enters through prerouting from a pod interface."""
    NODE = "node"
    """The node itself: leaves through output (then loops back if local)."""
    EXTERNAL = "external"
    """Another machine: enters through prerouting."""


@dataclass(frozen=True, slots=True)
class Packet:
    src: str
    dst: str
    dport: int
    proto: str = "tcp"
    sport: int | None = None
    origin: Origin = Origin.EXTERNAL
    iifname: str | None = None
    """The input interface (`meta iifname`); None when not known (a rule
    that matches it then stops the trace and asks for it). The node's own
    packets have none: "" (as the kernel sees them in output)."""

    def __post_init__(self) -> None:
        src, dst = ipaddress.ip_address(self.src), ipaddress.ip_address(self.dst)
        if src.version != dst.version:
            raise ValueError(f"{self.src} and {self.dst} are not of the same IP family")
        if self.proto not in _L4:
            raise ValueError(f"protocol {self.proto!r} is not one of {', '.join(_L4)}")
        for port in (self.dport, self.sport):
            if port is not None and not 0 < port < 65536:
                raise ValueError(f"port {port} is not in 1..65535")
        object.__setattr__(self, "src", str(src))
        object.__setattr__(self, "dst", str(dst))

    @property
    def family(self) -> IPFamily:
        return IPFamily.IPV4 if ipaddress.ip_address(self.src).version == 4 else IPFamily.IPV6

    @property
    def protocol_number(self) -> int:
        return protocol_number(self.proto)

    def text(self) -> str:
        """ "192.168.50.2 -> 10.96.0.10:80/tcp from external"."""
        return (f"{self.src} -> {format_address(self.dst, self.dport)}/{self.proto} "
                f"from {self.origin.value}")


@dataclass(frozen=True, slots=True)
class Host:
    """The node as routing sees it: the addresses that are its own
    (loopback always is)."""

    addresses: frozenset[Address] = field(default_factory=frozenset)

    @classmethod
    def of(cls, addresses: Iterable[str]) -> Host:
        return cls(frozenset(ipaddress.ip_address(a) for a in addresses))

    def is_local(self, addr: Address) -> bool:
        return addr.is_loopback or addr in self.addresses

    def fib_type(self, addr: Address) -> str:
        """`fib <addr> type` as the kernel answers it for this host."""
        if self.is_local(addr):
            return "local"
        if addr.is_multicast:
            return "multicast"
        if addr == ipaddress.IPv4Address("255.255.255.255"):
            return "broadcast"
        return "unicast"
