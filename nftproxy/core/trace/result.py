"""What a trace answers, as values: one `Path` per way the packet can go.

Layer: core/trace (pure). One job: the trace's output vocabulary -- per
path its probability, the verdict (accept / drop / reject) and where an
accepted packet went, the service port, its KUBE-SVC/SVL/EXT chains (and
the shared chooser that stands in for its KUBE-SVC/SVL/EXT) and the
KUBE-FW-<h> of its source-range check, the endpoint (DNAT target, the chain
that DNATed and the endpoint's KUBE-SEP-<h>), whether it is masqueraded,
the reasons, the affinity note, and every step on the way -- and their JSON
form (probabilities as fractions and as floats). KUBE-SEP-<h> and
KUBE-FW-<h> are kube-proxy's chain names, which nftproxy's ruleset keeps
in comments (identity.py): what an operator finds in `iptables-save`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from nftproxy.core.address import format_address
from nftproxy.core.trace.flow import Step
from nftproxy.core.trace.packet import Packet

__all__ = ["Endpoint", "Path", "Trace"]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """The DNAT target of a path, the chain whose rule DNATed (KUBE-SVC /
    KUBE-SVL, or a shared chooser `dispatch-...`), and the endpoint's
    kube-proxy name KUBE-SEP-<h> from the comment of that rule, or of the
    endpoints map's element it DNATed by ("" when the comment has none)."""

    address: str
    port: int | None
    chain: str
    comment: str = ""
    identity: str = ""

    def text(self) -> str:
        return format_address(self.address, self.port) if self.port else self.address


@dataclass(frozen=True, slots=True)
class Path:
    probability: Fraction
    verdict: str
    """"accept", "drop" or "reject"."""
    delivery: str
    """For "accept": "forwarded", "delivered to the node", ... ("" otherwise)."""
    destination: str
    """Where the packet is addressed in the end (after DNAT)."""
    service: str
    """The service port ("ns/name:port") of the map element that matched, or ""."""
    chains: tuple[str, ...]
    """The service's chains on the way (KUBE-EXT/SVC/SVL), in order; a
    shared chooser (`chooser`) as the KUBE-SVC/SVL/EXT-<h> it stands for."""
    endpoint: Endpoint | None
    masquerade: bool
    reasons: tuple[str, ...]
    """Why it is masqueraded (or keeps its source), or why it is dropped / rejected."""
    affinity: str
    reject_with: str
    steps: tuple[Step, ...]
    firewall: str = ""
    """KUBE-FW-<h> of the port whose loadBalancerSourceRanges checked the
    packet (a `firewall-vips` element matched), allowed or dropped; or ""."""
    chooser: str = ""
    """The shared chooser the destination went to (for a port without
    chains of its own: `dispatch-<proto>-<g>-<N>` for a cluster IP,
    external IP or LB VIP, `dispatch-nodeport-<proto>-<g>-<N>` for the node
    port), or ""."""

    def to_json(self) -> dict[str, Any]:
        return {
            "probability": float(self.probability),
            "probability_fraction": str(self.probability),
            "verdict": self.verdict,
            "delivery": self.delivery,
            "destination": self.destination,
            "service": self.service,
            "chains": list(self.chains),
            "firewall": self.firewall,
            "chooser": self.chooser,
            "endpoint": None if self.endpoint is None else _endpoint_json(self.endpoint),
            "masquerade": self.masquerade,
            "reasons": list(self.reasons),
            "affinity": self.affinity,
            "reject_with": self.reject_with,
            "steps": [_step_json(s) for s in self.steps],
        }


@dataclass(frozen=True, slots=True)
class Trace:
    packet: Packet
    table: str
    """"ip nftproxy" / "ip6 nftproxy"."""
    paths: tuple[Path, ...]

    def endpoints(self) -> Mapping[str, Fraction]:
        """Accepted endpoints ("addr:port") with their total probability."""
        out: dict[str, Fraction] = {}
        for p in self.paths:
            if p.verdict == "accept" and p.endpoint is not None:
                key = p.endpoint.text()
                out[key] = out.get(key, Fraction(0)) + p.probability
        return out

    def to_json(self) -> dict[str, Any]:
        pk = self.packet
        return {
            "packet": {
                "src": pk.src,
                "dst": pk.dst,
                "dport": pk.dport,
                "proto": pk.proto,
                "sport": pk.sport,
                "from": pk.origin.value,
                "iifname": pk.iifname,
            },
            "table": self.table,
            "paths": [p.to_json() for p in self.paths],
        }


def _endpoint_json(ep: Endpoint) -> dict[str, Any]:
    return {
        "address": ep.address,
        "port": ep.port,
        "chain": ep.chain,
        "identity": ep.identity,
        "comment": ep.comment,
    }


def _step_json(step: Step) -> dict[str, Any]:
    out: dict[str, Any] = {
        "hook": step.hook,
        "chain": step.chain,
        "rule": step.rule,
        "text": step.text,
    }
    if step.comment:
        out["comment"] = step.comment
    if step.share is not None:
        out["share"] = str(step.share)
    return out
