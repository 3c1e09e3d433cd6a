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
The service-port tests (tests/test_rules_service*.py) share the named ports,
chains and readings (SVC1, ETP_LOCAL, dispatch(), dnat_to(), ...) defined
here in the section that names them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nftproxy.core.config import ProxyConfig
from nftproxy.core.model import (
    Endpoint,
    IPFamily,
    L4Protocol,
    LoadBalancerIngress,
    NodeInfo,
    ServicePort,
    ServicePortName,
    SessionAffinity,
    TrafficPolicy,
)
from nftproxy.core.rules import dispatch as shared_dispatch
from nftproxy.core.rules import names
from nftproxy.core.rules import skeleton as sk
from nftproxy.core.rules.detect import local_detector
from nftproxy.core.rules.fragment import (
    Chain,
    Fragment,
    Key,
    Rule,
    SetDecl,
    Target,
    Verdict,
    affinity_table_name,
    kernel_name,
)
from nftproxy.core.rules.service import RenderContext, RenderedPort, render_service_port

__all__ = [
    "AFFINITY",
    "CIP",
    "CONFIG",
    "EIP",
    "EP1",
    "EP2",
    "EP3",
    "ETP_LOCAL",
    "ETP_LOCAL_NODEPORT",
    "EXT",
    "FW",
    "ITP_LOCAL",
    "LB",
    "LB_RANGES",
    "LOCAL",
    "LOCAL_AND_REMOTE",
    "MASQ",
    "NODE",
    "NODEPORT",
    "REMOTE",
    "SVC",
    "SVC1",
    "SVL",
    "Elements",
    "chain_of",
    "context",
    "dispatch",
    "dnat_to",
    "elements_of",
    "endpoint",
    "hairpin",
    "labels",
    "many",
    "nodeport_dnat",
    "render",
    "rules_of",
    "sep",
    "service_port",
    "shared_chains",
    "shared_dnat",
    "shared_rules",
    "shared_sets",
    "spn",
    "text",
    "to",
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
    nodeless: bool = False,
) -> Endpoint:
    """On this node (node-a) if `local`, else on node-b, or on none
    (`nodeless`: an EndpointSlice that names no node)."""
    return Endpoint(
        ip=ip,
        port=port,
        ready=ready,
        serving=ready if serving is None else serving,
        terminating=terminating,
        node_name="node-a" if local else "" if nodeless else "node-b",
        is_local=local,
    )


def many(n: int, *, local: bool = False, base: str = "10.180") -> tuple[Endpoint, ...]:
    """n distinct IPv4 endpoints (10.180.0.1, ...), remote unless `local`."""
    return tuple(endpoint(f"{base}.{i // 250}.{i % 250 + 1}", local=local) for i in range(n))


def context(
    family: IPFamily = IPFamily.IPV4, config: ProxyConfig = CONFIG, node: NodeInfo = NODE
) -> RenderContext:
    detector = local_detector(family, config, node)
    return RenderContext(family, config, node, detector, sk.choosers(family, config, node))


def render(
    port: ServicePort,
    endpoints: Sequence[Endpoint] = (),
    *,
    config: ProxyConfig = CONFIG,
    node: NodeInfo = NODE,
) -> RenderedPort:
    """The port's fragment, as a sync renders it."""
    return render_service_port(port, endpoints, context(port.family, config, node))


def chain_of(fragment: Fragment, name: str) -> Chain:
    """The fragment's chain `name`, in whichever table it is (a port with
    ClientIP affinity has its chains in the affinity table: fragment.AFFINITY_TABLE)."""
    found = [c for c in fragment.chains if c.name == name] or [
        c for c in fragment.chains if kernel_name(c.name) == name
    ]
    assert len(found) == 1, f"{name} appears {len(found)} times in the fragment"
    return found[0]


def elements_of(fragment: Fragment, set_name: str) -> dict[Key, Verdict | Target | None]:
    """The set's elements."""
    return {e.key: e.value for e in fragment.elements if e.set_name == set_name}


# --- the service-port tests' named ports, chains and readings -------------------
# (tests/test_rules_service*.py write their cases in these words)

LOCAL = TrafficPolicy.LOCAL
EP1, EP2, EP3 = "10.180.0.1", "10.180.0.2", "10.180.0.3"
CIP = "172.30.0.41"
EIP = "192.168.99.22"
LB = "1.2.3.4"
MASQ = "jump KUBE-MARK-MASQ"

SVC1 = service_port()
SVC = names.service_chain(SVC1.name)
SVL = names.local_chain(SVC1.name)
EXT = names.external_chain(SVC1.name)
FW = names.firewall_chain(SVC1.name)
NODEPORT = service_port(node_port=3001)
LB_RANGES = service_port(
    load_balancer_ingress=(LoadBalancerIngress(LB),),
    load_balancer_source_ranges=("203.0.113.0/25",),
)
ETP_LOCAL = service_port(
    node_port=3001,
    external_ips=(EIP,),
    load_balancer_ingress=(LoadBalancerIngress(LB),),
    external_traffic_policy=LOCAL,
)
ETP_LOCAL_NODEPORT = service_port(node_port=3001, external_traffic_policy=LOCAL)
"""An eTP=Local node port (through nodeport-local and its choosers maps)."""
ITP_LOCAL = service_port(internal_traffic_policy=LOCAL)
AFFINITY = service_port(session_affinity=SessionAffinity.CLIENT_IP, affinity_timeout=600)
REMOTE = (endpoint(EP1),)
LOCAL_AND_REMOTE = (endpoint(EP1, local=True), endpoint(EP2))

Elements = dict[str, dict[tuple[Any, ...], Any]]
"""set name -> {key: verdict label (None in plain sets)}."""


def to(ip: str, port: int = 80, protocol: str = "tcp") -> str:
    """What a cascade rule ends with when it sends to ip:port."""
    return f"meta l4proto {protocol} dnat to {ip}:{port}"


def client_key(port: ServicePort, ip: str, family: str = "ip", number: int = 80) -> str:
    """The key a rule looks up in (and updates) the shared affinity set for
    a client of endpoint ip:number of `port`: the source, then the
    endpoint's constant key (names.affinity_key, from its KUBE-SEP-<h>)."""
    k1, k2 = names.affinity_key(port.name, endpoint(ip, number))
    constant = "numgen random mod 1 offset"
    return f"{family} saddr . {constant} {k1} . {constant} {k2}"


def sep(ip: str, port: ServicePort = SVC1, number: int = 80) -> str:
    """kube-proxy's KUBE-SEP-<h> of endpoint ip:number of `port`."""
    return names.endpoint_chain(port.name, endpoint(ip, number))


def labels(port: ServicePort) -> dict[str, str]:
    """Chain name -> short label: SVC, SVL, EXT (the shared choosers, by
    their own name: dispatch-tcp-1, `_verdict_label`)."""
    spn = port.name
    own = {names.service_chain(spn): "SVC", names.local_chain(spn): "SVL",
           names.external_chain(spn): "EXT"}
    return {
        **own,
        **{affinity_table_name(chain): label for chain, label in own.items()},
        "KUBE-REJECT": "KUBE-REJECT",
    }


def _verdict_label(v: Verdict | Target | None, lab: Mapping[str, str]) -> str | None:
    if v is None or isinstance(v, Target):
        return None if v is None else str(v)
    if not v.target:
        return v.kind
    shared = shared_dispatch.is_shared_chain(v.target)
    return f"{v.kind} {v.target if shared else lab[v.target]}"


def dispatch(fragment: Fragment, lab: Mapping[str, str]) -> Elements:
    """set name -> {key: verdict label (None in plain sets)}, for every element."""
    out: Elements = {}
    for e in fragment.elements:
        out.setdefault(e.set_name, {})[e.key] = _verdict_label(e.value, lab)
    return out


def shared_dnat(n: int, protocol: str = "tcp", ip: str = "ip") -> str:
    """A shared VIP chooser's DNAT rule (dispatch-<protocol>-<n>) in nft
    syntax: key (VIP, port, i), i uniform over 0..n-1."""
    return (f"meta l4proto {protocol} dnat {ip} to {ip} daddr . {protocol} dport . "
            f"numgen random mod {n} map @vip-endpoints-{protocol}")


def nodeport_dnat(n: int, protocol: str = "tcp", ip: str = "ip") -> str:
    """A shared node port chooser's DNAT rule (dispatch-nodeport-<protocol>-<n>)
    in nft syntax: key (node port, i), i uniform over 0..n-1."""
    return (f"meta l4proto {protocol} dnat {ip} to {protocol} dport . "
            f"numgen random mod {n} map @nodeport-endpoints-{protocol}")


def hairpin(*ips: str) -> Elements:
    """The hairpin-endpoints elements of endpoints `ips` (each paired with itself)."""
    return {"hairpin-endpoints": {(ip, ip): None for ip in ips}}


def dnat_to(rule: Rule) -> str:
    """The ip:port ([ip6]:port) the rule DNATs to; every chooser rule has one."""
    (dnat,) = [s["dnat"] for s in rule.expr if "dnat" in s]
    addr = dnat["addr"]
    return f"{f'[{addr}]' if ':' in addr else addr}:{dnat['port']}"


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
            ng = v["numgen"]
            offset = f" offset {ng['offset']}" if ng.get("offset") else ""
            return f"numgen {ng['mode']} mod {ng['mod']}{offset}"
        if "map" in v:
            return f"{_value(v['map']['key'])} map {v['map']['data']}"
        if "prefix" in v:
            return f"{v['prefix']['addr']}/{v['prefix']['len']}"
        if "set" in v:
            return "{ " + ", ".join(_value(x) for x in v["set"]) + " }"
        if "concat" in v:
            return " . ".join(_value(x) for x in v["concat"])
        if "elem" in v:
            return f"{_value(v['elem']['val'])} timeout {v['elem']['timeout']}s"
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
        if isinstance(addr, dict):
            return f"dnat {body['family']} to {_value(addr)}"
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
    """The chain's rules in nft syntax."""
    return [text(r) for r in chain_of(fragment, chain).rules]


# --- the shared objects a fragment uses ----------------------------------------


def shared_chains(fragment: Fragment) -> dict[str, Chain]:
    """The chains of the shared bundles the fragment uses (`Fragment.shared`:
    the choosers and eTP=Local chains rules/dispatch.py makes), by name."""
    return {c.name: c for s in fragment.shared for c in s.chains}


def shared_sets(fragment: Fragment) -> dict[str, SetDecl]:
    """The maps of the shared bundles the fragment uses, by name."""
    return {d.name: d for s in fragment.shared for d in s.sets}


def shared_rules(fragment: Fragment, chain: str) -> list[str]:
    """The rules of the shared chain `chain` the fragment uses, in nft syntax."""
    return [text(r) for r in shared_chains(fragment)[chain].rules]
