"""kube-proxy's iptables-mode ruleset for a list of services (bench only).

Layer: bench tooling. One job: write the `iptables-restore` input that
kube-proxy's iptables mode would write for ClusterIP services
(kube-proxy pkg/proxy/iptables/proxier.go): nat KUBE-SERVICES as a LINEAR
list of one rule per service port (destination, protocol, port -> KUBE-SVC),
the KUBE-NODEPORTS rule last; KUBE-SVC-<h> with the off-cluster masquerade
mark and the `statistic --mode random --probability 1/(n-i)` cascade;
KUBE-SEP-<h> with the hairpin mark and the DNAT; KUBE-MARK-MASQ and
KUBE-POSTROUTING; the filter chains kube-proxy hooks (KUBE-FORWARD,
KUBE-SERVICES, KUBE-EXTERNAL-SERVICES, KUBE-NODEPORTS, KUBE-PROXY-FIREWALL).
Chain names use kube-proxy's hashes (nftproxy.core.rules.names).

    python bench/probes/iptables_ruleset.py N > rules.txt   # N filler services + 1 target
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: benchlib
import benchlib  # noqa: F401  (puts the repository on sys.path)

from nftproxy.core.model import Endpoint, L4Protocol, ServicePortName
from nftproxy.core.rules import names

__all__ = ["IptService", "ruleset"]

MASQ = "0x4000/0x4000"


@dataclass(frozen=True)
class IptService:
    namespace: str
    name: str
    vip: str
    port: int
    endpoints: tuple[tuple[str, int], ...]
    port_name: str = "http"


def _spn(s: IptService) -> ServicePortName:
    return ServicePortName(s.namespace, s.name, s.port_name, L4Protocol.TCP)


def _sep(s: IptService, ip: str, port: int) -> str:
    return names.endpoint_chain(_spn(s), Endpoint(ip, port))


def ruleset(services: Sequence[IptService], cluster_cidr: str) -> str:
    """iptables-restore text; services appear in KUBE-SERVICES in order."""
    nat_chains = ["KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ"]
    nat_rules = [
        '-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        '-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        '-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING',
        f"-A KUBE-MARK-MASQ -j MARK --set-xmark {MASQ}",
        f"-A KUBE-POSTROUTING -m mark ! --mark {MASQ} -j RETURN",
        "-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0",
        '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT"'
        " -j MASQUERADE --random-fully",
    ]
    per_service: list[str] = []
    for s in services:
        spn = str(_spn(s))
        svc = names.service_chain(_spn(s))
        nat_chains.append(svc)
        nat_rules.append(
            f'-A KUBE-SERVICES -d {s.vip}/32 -p tcp -m comment --comment "{spn} cluster IP"'
            f" -m tcp --dport {s.port} -j {svc}"
        )
        per_service.append(
            f"-A {svc} ! -s {cluster_cidr} -d {s.vip}/32 -p tcp -m comment --comment"
            f' "{spn} cluster IP" -m tcp --dport {s.port} -j KUBE-MARK-MASQ'
        )
        n = len(s.endpoints)
        for i, (ip, port) in enumerate(s.endpoints):
            sep = _sep(s, ip, port)
            nat_chains.append(sep)
            stat = (
                f" -m statistic --mode random --probability {1.0 / (n - i):.11f}"
                if i < n - 1
                else ""
            )
            per_service.append(
                f'-A {svc} -m comment --comment "{spn} -> {ip}:{port}"{stat} -j {sep}'
            )
            per_service += [
                f'-A {sep} -s {ip}/32 -m comment --comment "{spn}" -j KUBE-MARK-MASQ',
                f'-A {sep} -p tcp -m comment --comment "{spn}" -m tcp'
                f" -j DNAT --to-destination {ip}:{port}",
            ]
    nat_rules.append(
        '-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must'
        ' be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS'
    )
    filter_chains = [
        "KUBE-SERVICES",
        "KUBE-EXTERNAL-SERVICES",
        "KUBE-FORWARD",
        "KUBE-NODEPORTS",
        "KUBE-PROXY-FIREWALL",
    ]
    new = "-m conntrack --ctstate NEW"
    filter_rules = [
        f'-A INPUT {new} -m comment --comment "kubernetes load balancer firewall"'
        " -j KUBE-PROXY-FIREWALL",
        '-A INPUT -m comment --comment "kubernetes health check service ports" -j KUBE-NODEPORTS',
        f'-A INPUT {new} -m comment --comment "kubernetes externally-visible service portals"'
        " -j KUBE-EXTERNAL-SERVICES",
        f'-A FORWARD {new} -m comment --comment "kubernetes load balancer firewall"'
        " -j KUBE-PROXY-FIREWALL",
        '-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD',
        f'-A FORWARD {new} -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        f'-A FORWARD {new} -m comment --comment "kubernetes externally-visible service portals"'
        " -j KUBE-EXTERNAL-SERVICES",
        f'-A OUTPUT {new} -m comment --comment "kubernetes load balancer firewall"'
        " -j KUBE-PROXY-FIREWALL",
        f'-A OUTPUT {new} -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP",
        '-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules"'
        f" -m mark --mark {MASQ} -j ACCEPT",
        '-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule"'
        " -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
    ]
    out = ["*nat"]
    out += [f":{c} ACCEPT [0:0]" for c in ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING")]
    out += [f":{c} - [0:0]" for c in nat_chains]
    out += nat_rules + per_service + ["COMMIT", "*filter"]
    out += [f":{c} ACCEPT [0:0]" for c in ("INPUT", "FORWARD", "OUTPUT")]
    out += [f":{c} - [0:0]" for c in filter_chains]
    out += [*filter_rules, "COMMIT", ""]
    return "\n".join(out)


def _filler_endpoint(k: int) -> tuple[str, int]:
    """Endpoint number k of the filler services: 10.244.128.0/17, never a pod."""
    return f"10.244.{128 + k // 250 % 128}.{k % 250 + 1}", 8080


def filler(n: int, endpoints: int = 2) -> list[IptService]:
    """n ClusterIP services that no test traffic targets."""
    return [
        IptService(
            "bench",
            f"filler-{i}",
            f"10.96.{i // 250}.{i % 250 + 1}",
            80,
            tuple(_filler_endpoint(i * endpoints + j) for j in range(endpoints)),
        )
        for i in range(n)
    ]


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    target = IptService("bench", "target", "10.96.200.1", 80, (("10.244.0.11", 8080),))
    sys.stdout.write(ruleset([*filler(n), target], "10.244.0.0/16"))
