"""Shared pieces of the benchmark scripts (bench/*.py).

Layer: bench tooling (not part of the nftproxy package). One job: what every
script needs -- a synthetic cluster as Kubernetes API JSON, a Proxier fed the
way the agent feeds it, result lines, percentiles, memory readings (this
process; a whole process tree: proctree.py) and the machine description
that goes next to every number (benchmachine.py; both re-exported here),
with the nftables userspace (Debian release, libnftables version) named on
every result line.

Output convention: every script prints its results on stdout as JSON lines
(one object per line, always with "bench" and "case"); progress and a human
table go to stderr. tests/test_bench_quick.py parses exactly these lines.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import os
import resource
import signal
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "tests"):  # nftproxy itself, and the k8s JSON builders
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from benchmachine import machine_info, userspace  # noqa: E402
from k8s import endpoint_slice, node, service  # noqa: E402  (tests/k8s.py)
from proctree import TreeMemory, TreeSampler, tree_cpu_s, tree_rss_mb  # noqa: E402

__all__ = [
    "NODE",
    "NODE_IP",
    "ClusterShape",
    "TreeMemory",
    "TreeSampler",
    "emit",
    "feed",
    "fmt_table",
    "machine_info",
    "make_cluster",
    "make_proxier",
    "malloc_trim",
    "parse_shape",
    "peak_rss_mb",
    "percentile",
    "progress",
    "rss_mb",
    "summary",
    "tree_cpu_s",
    "tree_rss_mb",
    "userspace",
]

NODE = "node-a"
NODE_IP = "192.168.50.1"
POD_CIDR = "10.128.0.0/9"  # room for 250,000 endpoints
SERVICE_BASE = ipaddress.IPv4Address("10.96.0.10")
LB_BASE = ipaddress.IPv4Address("172.16.0.10")
POD_BASE = ipaddress.IPv4Address("10.128.0.10")
NODE_PORT_BASE = 30000
SOURCE_RANGES = ("203.0.113.0/24", "198.51.100.0/24")


# --- output -------------------------------------------------------------------


def emit(bench: str, case: str, **fields: Any) -> dict[str, Any]:
    """Print one result line (JSON) on stdout and return it; every line
    names the userspace it was measured with."""
    row = {"bench": bench, "case": case, "userspace": userspace(), **fields}
    print(json.dumps(row, sort_keys=False), flush=True)
    return row


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def fmt_table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    cells = [[str(c) for c in header], *[[_fmt(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (p in 0..100) of a non-empty sample."""
    if not values:
        raise ValueError("percentile of an empty sample")
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    k = (len(xs) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (k - lo))


def summary(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """p50/p90/p99/max/mean of `values` times `scale` (e.g. 1000 for ms)."""
    return {
        "p50": round(percentile(values, 50) * scale, 3),
        "p90": round(percentile(values, 90) * scale, 3),
        "p99": round(percentile(values, 99) * scale, 3),
        "max": round(max(values) * scale, 3),
        "mean": round(sum(values) / len(values) * scale, 3),
        "n": len(values),
    }


# --- memory -------------------------------------------------------------------


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def rss_mb() -> float:
    """Resident set size of this process now (VmRSS), MB."""
    return round(_status_kb("VmRSS") / 1024, 1)


def peak_rss_mb() -> float:
    """Peak RSS of this process (getrusage ru_maxrss), MB."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def malloc_trim() -> None:
    ctypes.CDLL("libc.so.6").malloc_trim(0)


# --- a synthetic cluster ------------------------------------------------------------

# The service mix, by i % 20 (what each of 20 consecutive services is).
_MIX: tuple[tuple[str, dict[str, Any]], ...] = (
    *(("ClusterIP", {}),) * 12,
    ("ClusterIP", {"affinity_timeout": 10800}),
    ("ClusterIP", {"itp": "Local"}),
    ("NodePort", {}),
    ("NodePort", {}),
    ("NodePort", {"etp": "Local"}),
    ("LoadBalancer", {"source_ranges": SOURCE_RANGES}),
    ("LoadBalancer", {"source_ranges": SOURCE_RANGES, "etp": "Local"}),
    ("LoadBalancer", {}),
)
MIX_DESCRIPTION = (
    "per 20 services: 12 ClusterIP, 1 ClusterIP+ClientIP affinity, 1 ClusterIP iTP=Local, "
    "2 NodePort, 1 NodePort eTP=Local, 1 LoadBalancer+sourceRanges, "
    "1 LoadBalancer+sourceRanges+eTP=Local, 1 LoadBalancer; every 10th endpoint (counted "
    "over the whole cluster) on this node"
)
SLICE_PORTS = (("http", 8080, "TCP"),)
SERVICE_PORTS = (("http", 80, "TCP"),)


@dataclass(frozen=True)
class ClusterShape:
    services: int
    endpoints: int
    mix: bool = True
    """False: every service a plain ClusterIP (dataplane filler)."""
    affinity: bool = True
    """False: the mix without ClientIP affinity (its 1 in 20 is a plain ClusterIP)."""

    @property
    def label(self) -> str:
        suffix = ("" if self.mix else "-plain") + ("" if self.affinity else "-noaff")
        return f"{self.services}x{self.endpoints}{suffix}"


def parse_shape(size: str, endpoints: int = 10) -> ClusterShape:
    """"SxE" (or "S", with `endpoints` each) -> ClusterShape(S, E)."""
    services, _, per = size.partition("x")
    return ClusterShape(int(services), int(per or endpoints))


def service_ip(i: int) -> str:
    return str(SERVICE_BASE + i)


def changed_endpoint(shape: ClusterShape) -> int:
    """Which endpoint of a service the partial-sync and churn benches
    replace: the second (a remote one), or the only one."""
    return min(1, shape.endpoints - 1)


def endpoint_ip(i: int, j: int, per_service: int, generation: int = 0) -> str:
    """Endpoint j of service i; `generation` moves it to a fresh address
    (an endpoint replaced by a new pod)."""
    return str(POD_BASE + (i * per_service + j) + generation * 300_000)


def service_obj(i: int, shape: ClusterShape, name: str | None = None) -> dict[str, Any]:
    kind, extra = _MIX[i % len(_MIX)] if shape.mix else ("ClusterIP", {})
    kw: dict[str, Any] = dict(extra)
    if not shape.affinity:
        kw.pop("affinity_timeout", None)
    if kind in ("NodePort", "LoadBalancer"):
        kw["node_ports"] = [NODE_PORT_BASE + (i // 20) * 6 + i % 20 - 14]
    if kind == "LoadBalancer":
        kw["lb_ips"] = [str(LB_BASE + i)]
        if kw.get("etp") == "Local":
            kw["health_check_node_port"] = 40000 + i // 20
    return service(name or f"svc-{i}", service_ip(i), ports=SERVICE_PORTS, type=kind, **kw)


def slice_obj(
    i: int,
    shape: ClusterShape,
    *,
    name: str | None = None,
    generations: Mapping[int, int] | None = None,
    trigger: str | None = None,
) -> dict[str, Any]:
    """The EndpointSlice of service i; `generations[j]` replaces endpoint j.
    Every 10th endpoint of the cluster is on this node (endpoint 0 of each
    service when a service has a multiple of 10)."""
    gens = generations or {}
    eps = [
        {
            "ip": endpoint_ip(i, j, shape.endpoints, gens.get(j, 0)),
            "nodeName": NODE if (i * shape.endpoints + j) % 10 == 0 else f"node-{j % 7 + 1}",
            "ready": True,
        }
        for j in range(shape.endpoints)
    ]
    obj = endpoint_slice(name or f"svc-{i}", eps, ports=SLICE_PORTS)
    if trigger is not None:
        obj["metadata"]["annotations"] = {
            "endpoints.kubernetes.io/last-change-trigger-time": trigger
        }
    return obj


def make_cluster(shape: ClusterShape) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(services, slices) of `shape`, deterministic."""
    services = [service_obj(i, shape) for i in range(shape.services)]
    slices = [slice_obj(i, shape) for i in range(shape.services)]
    return services, slices


def node_obj() -> dict[str, Any]:
    return node(NODE, [NODE_IP], pod_cidrs=["10.128.0.0/24"])


def rfc3339(t: float) -> str:
    """Epoch seconds as RFC 3339 with microseconds (the trigger-time annotation)."""
    frac = f"{t % 1:.6f}"[1:]
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + frac + "Z"


# --- the proxier ----------------------------------------------------------------------


def bench_config(**kw: Any) -> Any:
    from nftproxy.core.config import ProxyConfig

    defaults: dict[str, Any] = {
        "node_name": NODE,
        "node_ips": (NODE_IP,),
        "cluster_cidrs": (POD_CIDR,),
        "table_name": "nftproxy",
    }
    return ProxyConfig(**{**defaults, **kw})


class FedProxier:
    """A Proxier with the agent's Intake in front and its heap policy, as the agent wires it: raw
    objects in (on_service(prev, cur), ...), everything else the Proxier's.
    `set_change_callback` sets what the Proxier's on_change calls (a runner's
    kick)."""

    def __init__(
        self, config: Any, backend: Any, hooks: Sequence[Callable[..., None]], **kw: Any
    ) -> None:
        from nftproxy.agent.heap import AgentHeapPolicy
        from nftproxy.agent.intake import Intake
        from nftproxy.agent.proxier import Proxier
        from nftproxy.kernel.libnftables import malloc_trim

        self._changed: Callable[[], None] = lambda: None
        # the agent's heap policy (agent.py): GC paused while a full sync is
        # built, state frozen after every sync (collect + malloc_trim after a
        # full one); without it a long-lived bench pays full-heap GC passes
        # the agent does not
        self.proxier = Proxier(
            config,
            backend,
            hooks=list(hooks),
            on_change=lambda: self._changed(),
            heap=AgentHeapPolicy(malloc_trim),
            **kw,
        )
        self.events = Intake(self.proxier, node_name=config.node_name, report=lambda _: None)

    def set_change_callback(self, fn: Callable[[], None]) -> None:
        self._changed = fn

    def __getattr__(self, name: str) -> Any:
        target = self.events if name.startswith("on_") else self.proxier
        return getattr(target, name)


def make_proxier(
    backend: Any, config: Any = None, hooks: Sequence[Callable[..., None]] = (), **kw: Any
) -> Any:
    """`kw`: more of the Proxier's arguments (e.g. drift_check_period)."""
    proxier = FedProxier(config or bench_config(), backend, hooks, **kw)
    proxier.on_node(node_obj())
    return proxier


def feed(
    proxier: Any, services: Iterable[dict[str, Any]], slices: Iterable[dict[str, Any]]
) -> None:
    """Deliver an initial list (adds), then mark both caches synced."""
    from nftproxy.cluster.events import KIND_ENDPOINT_SLICES, KIND_SERVICES

    for s in services:
        proxier.on_service(None, s)
    for e in slices:
        proxier.on_endpoint_slice(None, e)
    proxier.on_synced(KIND_SERVICES)
    proxier.on_synced(KIND_ENDPOINT_SLICES)


# --- namespaces --------------------------------------------------------------------------


def bench_netns(tag: str) -> contextlib.AbstractContextManager[str]:
    """A throwaway namespace `nftpx-b<tag>-<pid>-<hex>` (always deleted)."""
    from nftproxy.kernel import netns

    return netns.temporary(f"nftpx-b{tag}")


def require_root() -> None:
    """Exit unless root; also make SIGTERM unwind like Ctrl-C, so every
    `with` that owns a namespace (or a child process) cleans up."""
    if os.geteuid() != 0:
        sys.exit("this benchmark needs root (network namespaces, nftables)")
    signal.signal(signal.SIGTERM, _terminate)


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


# --- noise: other work on the machine ------------------------------------------------


def _busy_jiffies() -> int:
    """user + nice + system jiffies of all CPUs (irq/softirq left out)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return int(fields[0]) + int(fields[1]) + int(fields[2])


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class Noise:
    """CPU used by OTHER processes while this benchmark ran, as a share of
    the whole machine (0..1): a concurrent test run or VM skews every number
    here, so every result carries it. Children count as ours once waited."""

    def __init__(self) -> None:
        self.hz = os.sysconf("SC_CLK_TCK")
        self.start()

    def start(self) -> None:
        self.t0, self.j0, self.c0 = time.monotonic(), _busy_jiffies(), _own_cpu()

    def foreign(self) -> float:
        wall = time.monotonic() - self.t0
        if wall <= 0:
            return 0.0
        busy = (_busy_jiffies() - self.j0) / self.hz
        mine = _own_cpu() - self.c0
        return round(max(0.0, busy - mine) / wall / (os.cpu_count() or 1), 3)


def wait_quiet(limit: float = 0.15, max_wait: float = 600.0) -> float:
    """Wait (up to max_wait s) until other processes use < `limit` of the
    machine over 3 s; returns the last share seen (printed if too high)."""
    deadline = time.monotonic() + max_wait
    while True:
        n = Noise()
        time.sleep(3)
        share = n.foreign()
        if share < limit or time.monotonic() > deadline:
            if share >= limit:
                progress(f"WARNING: other processes use {share:.0%} of the CPUs; numbers skewed")
            return share
        progress(f"machine busy ({share:.0%} of the CPUs used by others); waiting")
        time.sleep(10)


def chain_count(proxier: Any) -> dict[str, int]:
    from nftproxy.core.model import IPFamily

    t = proxier.table_state(IPFamily.IPV4)
    return {
        "chains": len(t.chains),
        "rules": sum(c.size for c in t.chains.values()),
        "sets": len(t.sets),
        "elements": len(t.index),
    }


def raw(backend: Any, doc: str | Sequence[Mapping[str, Any]]) -> None:
    """Send nft text, or libnftables JSON objects, as one transaction past
    the typed commands (probes of shapes the product does not build)."""
    from nftproxy.core.nft.errors import rejection

    text = doc if isinstance(doc, str) else json.dumps({"nftables": list(doc)})
    rc, _, err = backend._call(lambda ctx: ctx.cmd(text))
    if rc != 0:
        raise rejection(str(err).strip())
