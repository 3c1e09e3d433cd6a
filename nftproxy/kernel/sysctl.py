"""Conntrack sysctls and route_localnet at start-up, as kube-proxy sets them.

Layer: edge (reads and writes /proc/sys and /sys through a seam). One job:
apply the `linux.conntrack` settings of ProxyConfig once, when the agent
starts, and net.ipv4.conf.all.route_localnet=1 when localhost node ports
are served (`enable_route_localnet`). Callers: agent.py, and cli.py's
`sync` for route_localnet. `plan()` is pure (what to write, given the
current values); `apply_conntrack()` reads and writes through a `SysctlFS`,
so tests pass a dict-backed fake and the agent passes `HostFS()`.

What is set (kube-proxy cmd/kube-proxy/app/server_linux.go):
- nf_conntrack_max = max(maxPerCore x CPUs, min), only when larger than the
  current value (maxPerCore 0: leave it); the hash table size
  (/sys/module/nf_conntrack/parameters/hashsize) is raised to max/4 when
  smaller, as kube-proxy does.
- nf_conntrack_tcp_timeout_established / _close_wait when non-zero;
- nf_conntrack_tcp_be_liberal = 1 when asked;
- nf_conntrack_udp_timeout / _udp_timeout_stream when non-zero.

A conntrack setting that cannot be read or written (read-only /sys or
/proc in a container, the nf_conntrack module not loaded) is a warning,
never fatal: the proxy works without it. route_localnet is different:
localhost node ports cannot work without it, so failing to set it raises
(kube-proxy's iptables mode refuses to start too). It is never touched
when localhost node ports are off, and never set back to 0.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from nftproxy.core.config import ConntrackConfig

__all__ = [
    "ROUTE_LOCALNET",
    "HostFS",
    "SysctlFS",
    "SysctlWrite",
    "apply_conntrack",
    "enable_route_localnet",
    "plan",
]

NETFILTER = "/proc/sys/net/netfilter"
ROUTE_LOCALNET = "/proc/sys/net/ipv4/conf/all/route_localnet"
CONNTRACK_MAX = f"{NETFILTER}/nf_conntrack_max"
HASHSIZE = "/sys/module/nf_conntrack/parameters/hashsize"


class SysctlFS(Protocol):
    """Reading and writing single-value kernel files (the seam)."""

    def read(self, path: str) -> str: ...

    def write(self, path: str, value: str) -> None: ...


class HostFS:
    """The real /proc/sys and /sys (optionally below `root`, for a chroot)."""

    def __init__(self, root: str = "/") -> None:
        self.root = Path(root)

    def _path(self, path: str) -> Path:
        return self.root / path.lstrip("/")

    def read(self, path: str) -> str:
        return self._path(path).read_text()

    def write(self, path: str, value: str) -> None:
        self._path(path).write_text(value + "\n")


@dataclass(frozen=True, slots=True)
class SysctlWrite:
    """Write `value` to `path`; with `only_if_larger`, only when the current
    value is smaller (never lower a limit someone raised)."""

    path: str
    value: int
    only_if_larger: bool = False


def plan(config: ConntrackConfig, *, cpus: int) -> list[SysctlWrite]:
    """The writes kube-proxy would do for `config` on a machine with `cpus`."""
    writes: list[SysctlWrite] = []
    if config.max_per_core > 0:
        maximum = max(config.max_per_core * cpus, config.min)
        writes.append(SysctlWrite(CONNTRACK_MAX, maximum, only_if_larger=True))
        writes.append(SysctlWrite(HASHSIZE, maximum // 4, only_if_larger=True))
    timeouts = (
        ("nf_conntrack_tcp_timeout_established", config.tcp_established_timeout),
        ("nf_conntrack_tcp_timeout_close_wait", config.tcp_close_wait_timeout),
        ("nf_conntrack_udp_timeout", config.udp_timeout),
        ("nf_conntrack_udp_timeout_stream", config.udp_stream_timeout),
    )
    for name, seconds in timeouts:
        if seconds > 0:
            writes.append(SysctlWrite(f"{NETFILTER}/{name}", seconds))
    if config.tcp_be_liberal:
        writes.append(SysctlWrite(f"{NETFILTER}/nf_conntrack_tcp_be_liberal", 1))
    return writes


def cpu_count() -> int:
    """CPUs this process may run on (Go's runtime.NumCPU, as kube-proxy uses)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def apply_conntrack(
    config: ConntrackConfig,
    fs: SysctlFS,
    *,
    cpus: int | None = None,
    log: logging.Logger | None = None,
) -> list[SysctlWrite]:
    """Apply plan(config) through `fs`; return the writes done. Unreadable
    or unwritable files are logged as warnings and skipped."""
    log = log or logging.getLogger(__name__)
    done: list[SysctlWrite] = []
    for write in plan(config, cpus=cpus if cpus is not None else cpu_count()):
        try:
            current = _read_int(fs, write.path)
        except (OSError, ValueError) as exc:
            log.warning("cannot read sysctl; leaving it", extra={"path": write.path,
                                                                "error": str(exc)})
            continue
        if current == write.value or (write.only_if_larger and current >= write.value):
            continue
        try:
            fs.write(write.path, str(write.value))
        except OSError as exc:
            log.warning(
                "cannot set sysctl (read-only /proc or /sys?)",
                extra={"path": write.path, "value": write.value, "error": str(exc)},
            )
            continue
        log.info("set sysctl", extra={"path": write.path, "value": write.value, "was": current})
        done.append(write)
    return done


def _read_int(fs: SysctlFS, path: str) -> int:
    return int(fs.read(path).split()[0])


def enable_route_localnet(fs: SysctlFS, *, log: logging.Logger | None = None) -> bool:
    """net.ipv4.conf.all.route_localnet=1, which localhost node ports need:
    without it the kernel drops a packet to or from 127.0.0.0/8 that is
    routed off the loopback interface (the DNATed connection, its reply).
    True if it was written, False if it was already 1; OSError if it cannot
    be read or written. The exposure it opens (CVE-2020-8558) is closed by
    the ruleset's KUBE-FIREWALL rules (core/rules/skeleton.py)."""
    log = log or logging.getLogger(__name__)
    try:
        current = _read_int(fs, ROUTE_LOCALNET)
    except (ValueError, IndexError) as exc:
        raise OSError(f"cannot read {ROUTE_LOCALNET}: {exc}") from exc
    if current != 1:
        fs.write(ROUTE_LOCALNET, "1")
    log.info(
        "localhost node ports on (KubeProxyNFTablesLocalhostNodePorts): route_localnet set; "
        "KUBE-FIREWALL drops packets for 127.0.0.0/8 from other hosts (CVE-2020-8558); "
        "IPv4 only, ::1 is not served",
        extra={"path": ROUTE_LOCALNET, "value": 1, "was": current},
    )
    return current != 1
