"""The demo's traffic report: which paths to try, and how to describe what they did.

Layer: tools (pure functions over values: below demo, its only caller;
converts with the core, reads sandbox.probe's Attempt values).
One job: from the objects the file source delivered (`Cluster`) and the
sandbox's addresses (`Addresses`), list every path worth trying per service
port (`plan` -> `Block`s of `Check`s: cluster IP, load-balancer VIPs from
inside and outside loadBalancerSourceRanges, external IPs, the node port,
the healthCheckNodePort) and its endpoints per IP family (an endpoint can
be ready in one family's slice and terminating in the other's; each
family's paths are judged by that family's endpoints only), then turn
what each path did (`Result`) into one row -- who answered how often and
which source the pod saw, or how it failed (reject, drop) and why the
service says it should (`describe`, `render`). Nothing here sends a packet: demo.py runs the checks.
"""

from __future__ import annotations

import ipaddress
import statistics
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from nftproxy.cluster.events import Obj
from nftproxy.core import convert
from nftproxy.core.address import format_address
from nftproxy.core.model import Endpoint, IPFamily, ServicePort, ServicePortName, TrafficPolicy
from nftproxy.tools.sandbox.probe import Attempt

__all__ = [
    "Addresses",
    "Block",
    "Check",
    "Cluster",
    "HealthCheck",
    "Result",
    "describe",
    "plan",
    "render",
]

_WIDTH = 100


@dataclass(frozen=True)
class Cluster:
    """The objects the file source delivered (what the agent was given)."""

    services: Mapping[tuple[str, str], Obj] = field(default_factory=dict)
    slices: Mapping[tuple[str, str], Obj] = field(default_factory=dict)
    node_name: str = ""


# --- what to check ---------------------------------------------------------------------


@dataclass(frozen=True)
class Addresses:
    """The sandbox as the report needs it (pure data)."""

    node: Mapping[IPFamily, str]
    clients: Mapping[IPFamily, tuple[str, ...]]
    pods: Mapping[str, str]
    """Pod name by address."""
    gateways: frozenset[str]
    """What a masqueraded source looks like to a pod."""


@dataclass(frozen=True)
class Check:
    """One path: `count` attempts from `src` (in the client) to addr:port."""

    proto: str
    addr: str
    port: int
    src: str
    note: str = ""
    """Why it should fail, when the service says so (shown if it does)."""

    @property
    def target(self) -> str:
        return format_address(self.addr, self.port)


@dataclass(frozen=True)
class HealthCheck:
    """GET / on a healthCheckNodePort of the node, from the client."""

    addr: str
    port: int


@dataclass(frozen=True)
class Block:
    """One service port: a heading and its paths."""

    name: str
    kind: str
    """e.g. "ClusterIP, TCP 80"."""
    details: tuple[str, ...]
    """What else shapes its paths: node port, LB, policies, affinity, ranges."""
    endpoints: tuple[str, ...]
    """One line per IP family of the service port: "IPv4 endpoints: web-0 ready, ..."."""
    checks: tuple[Check, ...]
    health: HealthCheck | None = None


def plan(cluster: Cluster, sandbox: Addresses) -> list[Block]:
    """Every path worth trying for every service port in `cluster` (pure)."""
    endpoints = _endpoints(cluster)
    blocks: list[Block] = []
    for _key, svc in sorted(cluster.services.items()):
        ports: dict[ServicePortName, list[ServicePort]] = {}
        for family in IPFamily:
            found, _problems = convert.service_ports(svc, family)
            for spn, sp in found.items():
                ports.setdefault(spn, []).append(sp)
        kind = str((svc.get("spec") or {}).get("type") or "ClusterIP")
        for spn, sps in sorted(ports.items(), key=lambda item: str(item[0])):
            eps = {sp.family: endpoints.get((spn, sp.family), []) for sp in sps}
            checks = [c for sp in sps for c in _checks(sp, eps[sp.family], sandbox)]
            health = None
            hc = next((sp.health_check_node_port for sp in sps if sp.health_check_node_port), 0)
            if hc and IPFamily.IPV4 in sandbox.node:
                health = HealthCheck(sandbox.node[IPFamily.IPV4], hc)
            heading, details = _summary(kind, sps)
            blocks.append(
                Block(str(spn), heading, details,
                      tuple(_endpoint_text(f, e, sandbox) for f, e in eps.items()),
                      tuple(checks), health)
            )
    return blocks


def _endpoints(cluster: Cluster) -> dict[tuple[ServicePortName, IPFamily], list[Endpoint]]:
    """The endpoints of each service port in each family (from that family's slices)."""
    out: dict[tuple[ServicePortName, IPFamily], list[Endpoint]] = {}
    for _key, obj in sorted(cluster.slices.items()):
        info, _problems = convert.slice_info(obj, cluster.node_name)
        if info is None:
            continue
        for spn, eps in info.ports.items():
            out.setdefault((spn, info.family), []).extend(eps)
    return out


def _checks(sp: ServicePort, eps: Sequence[Endpoint], sandbox: Addresses) -> Iterator[Check]:
    proto = sp.protocol.value.lower()
    clients = sandbox.clients.get(sp.family, ())
    if not clients:
        return
    client = clients[0]
    serving = [e for e in eps if e.serving]
    none = "the service has no endpoints" if not serving else ""
    no_local = none
    local_policy = sp.external_traffic_policy is TrafficPolicy.LOCAL
    if not none and local_policy and not any(e.is_local for e in serving):
        no_local = "no endpoint on this node (externalTrafficPolicy Local)"
    yield Check(proto, sp.cluster_ip, sp.port, client, none)
    ranges = [ipaddress.ip_network(r, strict=False) for r in sp.load_balancer_source_ranges]
    for vip in sp.load_balancer_vips:
        if not ranges:
            yield Check(proto, vip, sp.port, client, no_local)
            continue
        for src in clients:
            if any(ipaddress.ip_address(src) in r for r in ranges):
                yield Check(proto, vip, sp.port, src, no_local)
            else:
                yield Check(proto, vip, sp.port, src, "source outside loadBalancerSourceRanges")
    for ip in sp.external_ips:
        yield Check(proto, ip, sp.port, client, no_local)
    node = sandbox.node.get(sp.family)
    if sp.node_port and node:
        yield Check(proto, node, sp.node_port, client, no_local)


def _summary(kind: str, sps: Sequence[ServicePort]) -> tuple[str, tuple[str, ...]]:
    """("LoadBalancer, TCP 80", ("nodePort 30081", ...)): the kind, then what shapes paths."""
    sp = sps[0]
    parts = []
    if sp.node_port:
        parts.append(f"nodePort {sp.node_port}")
    lbs = [ip for p in sps for ip in p.load_balancer_vips]
    if lbs:
        parts.append(f"LB {', '.join(lbs)}")
    ext = [ip for p in sps for ip in p.external_ips]
    if ext:
        parts.append(f"externalIPs {', '.join(ext)}")
    if sp.externally_accessible and sp.external_traffic_policy is TrafficPolicy.LOCAL:
        parts.append("externalTrafficPolicy Local")
    if sp.internal_traffic_policy is TrafficPolicy.LOCAL:
        parts.append("internalTrafficPolicy Local")
    if sp.affinity:
        parts.append(f"sessionAffinity ClientIP ({sp.affinity_timeout}s)")
    ranges = [r for p in sps for r in p.load_balancer_source_ranges]
    if ranges:
        parts.append(f"loadBalancerSourceRanges {', '.join(ranges)}")
    if sp.health_check_node_port:
        parts.append(f"healthCheckNodePort {sp.health_check_node_port}")
    return f"{kind}, {sp.protocol.value} {sp.port}", tuple(parts)


def _endpoint_text(family: IPFamily, eps: Sequence[Endpoint], sandbox: Addresses) -> str:
    """"IPv4 endpoints: web-0 ready, web-1 terminating, web-2 ready on other-node"."""
    head = f"{family.value} endpoints: "
    if not eps:
        return head + "none"
    seen: dict[str, str] = {}
    for e in sorted(eps, key=lambda e: (sandbox.pods.get(e.ip, e.ip), e.ip)):
        name = sandbox.pods.get(e.ip)
        label = name or f"{e.address} (no such pod in the sandbox)"
        state = "ready" if e.ready else "terminating" if e.serving else "not serving"
        where = "" if e.is_local else f" on {e.node_name or '?'}"
        seen.setdefault(label, f"{label} {state}{where}")
    return head + ", ".join(seen.values())


@dataclass(frozen=True)
class Result:
    """What one path did: the attempts (first and more), or why none ran."""

    check: Check
    attempts: tuple[Attempt, ...] = ()
    skipped: str = ""



# --- describing -------------------------------------------------------------------------


def describe(result: Result, sandbox: Addresses) -> tuple[str, str]:
    """(outcome, source): e.g. ("web-0: 11  web-2: 9", "masqueraded (10.244.0.1)")
    or ("refused in <t> ms x3 (reject)", "")."""
    if result.skipped and not result.attempts:
        return result.skipped, ""
    attempts = result.attempts
    answered = [a for a in attempts if a.ok]
    failed = Counter(a.error or "?" for a in attempts if not a.ok)
    if answered:
        pods = Counter(a.pod or "?" for a in answered)
        text = "  ".join(f"{pod}: {n}" for pod, n in sorted(pods.items()))
        if failed:
            text += "  + " + ", ".join(f"{n} {kind}" for kind, n in sorted(failed.items()))
        return text, _source_text(answered, result.check.src, sandbox)
    kind, n = failed.most_common(1)[0]
    ms = statistics.median(a.seconds for a in attempts if a.error == kind) * 1000
    took = f"{ms:.0f} ms" if ms >= 1 else "< 1 ms"
    text = {
        "refused": f"refused in {took} x{n} (reject)",
        "timeout": f"no answer in {ms / 1000:.1f} s x{n} (drop)",
        "unreachable": f"unreachable x{n} (ICMP)",
        "reset": f"reset x{n}",
        "closed": f"closed without an answer x{n}",
    }.get(kind, f"{kind} x{n}")
    if len(failed) > 1:
        text += " + " + ", ".join(f"{m} {k}" for k, m in sorted(failed.items()) if k != kind)
    return text, result.check.note


def _source_text(answered: Sequence[Attempt], src: str, sandbox: Addresses) -> str:
    parts = []
    for peer in sorted({a.peer or "?" for a in answered}):
        if peer == src:
            parts.append(f"preserved ({peer})")
        elif peer in sandbox.gateways:
            parts.append(f"masqueraded ({peer})")
        else:
            parts.append(f"seen as {peer}")
    return ", ".join(parts)


def render(blocks: Sequence[Block], results: Mapping[Check, Result],
           health: Mapping[HealthCheck, str], sandbox: Addresses) -> str:
    """The traffic report: per service port a heading, then one row per path."""
    rows: list[tuple[int, tuple[str, str, str]]] = []
    for i, block in enumerate(blocks):
        for check in block.checks:
            outcome, source = describe(results[check], sandbox)
            path = f"{check.src} -> {check.target}"
            if check.proto != "tcp":
                path += f" {check.proto}"
            rows.append((i, (path, outcome, source)))
        if block.health is not None:
            h = block.health
            rows.append((i, (f"health check http://{h.addr}:{h.port}/", health[h], "")))
    head = ("FROM -> TO", "RESULT (who answered: how often)", "SOURCE THE POD SAW / WHY")
    widths = [max(len(r[c]) for r in [head, *(row for _, row in rows)]) for c in range(3)]

    def line(cells: tuple[str, str, str]) -> str:
        return "    " + "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    out = [line(head)]
    for i, block in enumerate(blocks):
        out += ["", f"  {block.name}  {block.kind}"]
        out += _pack(block.details, "; ")
        for text in block.endpoints:
            out += _pack(text.split(", "), ", ")
        out += [line(row) for j, row in rows if j == i]
    return "\n".join(out)


def _pack(parts: Sequence[str], sep: str) -> list[str]:
    """`parts` joined by `sep` on lines of at most _WIDTH where possible,
    never breaking a part; continuation lines indented further."""
    lines: list[str] = []
    for part in parts:
        if lines and len(lines[-1]) + len(sep) + len(part) <= _WIDTH:
            lines[-1] += sep + part
        else:
            if lines:
                lines[-1] += sep.rstrip()
            lines.append(("      " if lines else "    ") + part)
    return lines
