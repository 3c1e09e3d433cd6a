"""Shared builders for the translator tests: one address plan, small constructors.

The address plan follows upstream kube-proxy's "Conventions for tests using
NewFakeProxier", so cases read like theirs:

- this node: node-a, 192.168.0.2 / fd00:192::2, pod CIDR 10.0.1.0/24 / fd00:10:1::/64
- cluster CIDR (ClusterCIDR detector): 10.0.0.0/8 / fd00:10::/48
- cluster IPs: 172.30.0.0/16 / fd00:172:30::/112
- endpoints: 10.180.0.0/16 / fd00:10:180::/64 (is_local marks the ones on node-a)
- external IPs 192.168.99.0/24, load-balancer ingress 1.2.3.0/24 and 5.6.7.8

Rules are read through `text()`, a small nft-syntax printer that knows only
the statement shapes the renderers emit and fails loudly on anything else,
so assertions say what a rule does rather than how its JSON is spelled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nftproxy.core.config import ProxyConfig
from nftproxy.core.model import (
    Endpoint,
    IPFamily,
    L4Protocol,
    NodeInfo,
    ServicePort,
    ServicePortName,
)
from nftproxy.core.rules.detect import local_detector
from nftproxy.core.rules.fragment import Chain, Fragment, Key, Rule, Verdict
from nftproxy.core.rules.service import RenderContext, RenderedPort, render_service_port

__all__ = [
    "CONFIG",
    "NODE",
    "chain_of",
    "context",
    "elements_of",
    "endpoint",
    "render",
    "rules_of",
    "service_port",
    "spn",
    "text",
]

NODE = NodeInfo(
    "node-a",
    ipv4=("192.168.0.2",),
    ipv6=("fd00:192::2",),
    pod_cidrs=("10.0.1.0/24", "fd00:10:1::/64"),
)
CONFIG = ProxyConfig(node_name="node-a", cluster_cidrs=("10.0.0.0/8", "fd00:10::/48"))
_CLUSTER_IP = {IPFamily.IPV4: "172.30.0.41", IPFamily.IPV6: "fd00:172:30::41"}


def spn(
    name: str = "svc1", ns: str = "ns1", port: str = "p80", protocol: L4Protocol = L4Protocol.TCP
) -> ServicePortName:
    return ServicePortName(ns, name, port, protocol)


def service_port(
    name: str = "svc1",
    *,
    ns: str = "ns1",
    port_name: str = "p80",
    family: IPFamily = IPFamily.IPV4,
    cluster_ip: str | None = None,
    port: int = 80,
    protocol: L4Protocol = L4Protocol.TCP,
    **fields: Any,
) -> ServicePort:
    """A ClusterIP service port; keyword `fields` set any other ServicePort field."""
    return ServicePort(
        name=spn(name, ns, port_name, protocol),
        family=family,
        cluster_ip=cluster_ip or _CLUSTER_IP[family],
        port=port,
        protocol=protocol,
        **fields,
    )


def endpoint(
    ip: str,
    port: int = 80,
    *,
    local: bool = False,
    ready: bool = True,
    terminating: bool = False,
    serving: bool | None = None,
) -> Endpoint:
    return Endpoint(
        ip=ip,
        port=port,
        ready=ready,
        serving=ready if serving is None else serving,
        terminating=terminating,
        node_name="node-a" if local else "node-b",
        is_local=local,
    )


def context(
    family: IPFamily = IPFamily.IPV4, config: ProxyConfig = CONFIG, node: NodeInfo = NODE
) -> RenderContext:
    return RenderContext(family, config, node, local_detector(family, config, node))


def render(
    port: ServicePort,
    endpoints: Sequence[Endpoint] = (),
    *,
    config: ProxyConfig = CONFIG,
    node: NodeInfo = NODE,
) -> RenderedPort:
    return render_service_port(port, endpoints, context(port.family, config, node))


def chain_of(fragment: Fragment, name: str) -> Chain:
    found = [c for c in fragment.chains if c.name == name]
    assert len(found) == 1, f"{name} appears {len(found)} times in the fragment"
    return found[0]


def elements_of(fragment: Fragment, set_name: str) -> dict[Key, Verdict | None]:
    return {e.key: e.verdict for e in fragment.elements if e.set_name == set_name}


# --- reading rules ------------------------------------------------------------

_MARK_OPS = ("&", "|", "^")
"""Binary operations on the packet mark; their constant prints in hex, as nft."""


def _value(v: Any) -> str:
    if isinstance(v, dict):
        if "payload" in v:
            return f"{v['payload']['protocol']} {v['payload']['field']}"
        if "meta" in v:
            key = v["meta"]["key"]
            return key if key == "iifname" else f"meta {key}"
        if "ct" in v:
            return f"ct {v['ct']['key']}"
        if "fib" in v:
            return f"fib {' . '.join(v['fib']['flags'])} {v['fib']['result']}"
        if "numgen" in v:
            return f"numgen {v['numgen']['mode']} mod {v['numgen']['mod']}"
        if "prefix" in v:
            return f"{v['prefix']['addr']}/{v['prefix']['len']}"
        if "set" in v:
            return "{ " + ", ".join(_value(x) for x in v["set"]) + " }"
        if "concat" in v:
            return " . ".join(_value(x) for x in v["concat"])
        for op in _MARK_OPS:
            if op in v:
                left, right = v[op]
                return f"{_value(left)} {op} {right:#x}"
    if isinstance(v, list) and v:
        return ", ".join(_value(x) for x in v)
    if isinstance(v, str | int) and not isinstance(v, bool):
        return str(v)
    raise AssertionError(f"text() does not know the expression {v!r}")


def _statement(s: Mapping[str, Any]) -> str:
    ((kind, body),) = s.items()
    if kind == "match":
        # nft's implicit operator: == for values and sets, `in` for flags (ct state/status)
        op = "" if body["op"] in ("==", "in") else body["op"] + " "
        return f"{_value(body['left'])} {op}{_value(body['right'])}"
    if kind in ("jump", "goto"):
        return f"{kind} {body['target']}"
    if kind in ("drop", "accept", "return"):
        return kind
    if kind == "dnat":
        addr = body["addr"]
        return f"dnat to {f'[{addr}]' if ':' in addr else addr}:{body['port']}"
    if kind == "set":
        return f"{body['op']} {body['set']} {{ {_value(body['elem'])} }}"
    if kind == "mangle":
        return f"{_value(body['key'])} set {_value(body['value'])}"
    if kind == "vmap":
        return f"{_value(body['key'])} vmap {body['data']}"
    if kind == "masquerade":
        return " ".join(("masquerade", *body.get("flags", ())))
    if kind == "reject":
        return " ".join(("reject with", body["type"], *([body["expr"]] if "expr" in body else [])))
    raise AssertionError(f"text() does not know the statement {s!r}")


def text(rule: Rule) -> str:
    """A rule in nft syntax, e.g. `ip saddr != 10.0.0.0/8 jump KUBE-MARK-MASQ`."""
    return " ".join(_statement(s) for s in rule.expr)


def rules_of(fragment: Fragment, chain: str) -> list[str]:
    return [text(r) for r in chain_of(fragment, chain).rules]
