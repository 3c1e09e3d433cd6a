"""One service port -> its fragment (nftproxy.core.rules.service): dispatch and masquerade.

The renderer's tests are split by aspect over three modules, each in
kube-proxy's words (docs/kube-proxy-semantics.md, upstream-nftables-notes.md
§1.5-§1.15), in ruleset v2's shapes. This one holds:
- dispatch: which element lands in which map or set with which verdict
  (service-ips and friends, hairpin-endpoints, firewall-vips/-allow), and
  which chains exist (one table of sentence-named cases), including external
  and internal traffic policy Local and terminating endpoints;
- every private renderer has a test in one of the service test modules
  (meta-test at the end).
A port without ClientIP affinity has no chain, whatever its endpoint
count: its destinations go to the shared choosers (rules/dispatch.py),
which its fragment lists in `shared`; only a port with ClientIP affinity
keeps KUBE-SVC/SVL/EXT chains (in the affinity table), so the tests of
kube-proxy's chains render such ports, and check the shared choosers'
rules beside.
test_rules_masquerade.py: masquerade decisions per local-traffic detector
and per protocol.
test_rules_dispatch*.py: which ports are dispatched, their elements, the
shared choosers and their maps.
test_rules_service_endpoints.py: the shared chooser's endpoints-map
elements, endpoint comments, hairpin, IPv6, session affinity's cascade.
test_rules_service_external.py: KUBE-EXT, source ranges, whole-fragment
properties, the printer.

Rules are read through builders.text() (nft syntax; fails on unknown shapes);
the named ports, chains and addresses the cases use are builders' too.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from builders import (
    AFFINITY,
    CIP,
    CONFIG,
    EIP,
    EP1,
    EP2,
    ETP_LOCAL,
    ITP_LOCAL,
    LB,
    LB_RANGES,
    LOCAL,
    LOCAL_AND_REMOTE,
    NODEPORT,
    REMOTE,
    Elements,
    dispatch,
    elements_of,
    endpoint,
    hairpin,
    labels,
    many,
    render,
    service_port,
)

from nftproxy.core.config import ProxyConfig
from nftproxy.core.model import (
    Endpoint,
    IPMode,
    LoadBalancerIngress,
    ServicePort,
    SessionAffinity,
)
from nftproxy.core.rules import names
from nftproxy.core.rules import service as service_mod
from nftproxy.core.rules.dispatch import is_shared_chain
from nftproxy.core.rules.fragment import Element, Verdict

# --- dispatch: one table of cases ---------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    port: ServicePort
    endpoints: tuple[Endpoint, ...]
    elements: Elements
    chains: frozenset[str]
    internal_dropped: bool = False
    external_dropped: bool = False
    config: ProxyConfig = field(default=CONFIG)


EXTERNAL_IP = service_port(external_ips=(EIP,))
LB_PORT = service_port(
    node_port=3001,
    load_balancer_ingress=(LoadBalancerIngress(LB), LoadBalancerIngress("5.6.7.8", IPMode.PROXY)),
)
CLUSTER_IPS: Elements = {"cluster-ips": {(CIP,): None}}
SVC_CIP: Elements = {**CLUSTER_IPS, "service-ips": {(CIP, "tcp", 80): "goto SVC"}}


def shared(*ips: str, vips: tuple[str, ...] = (), node_port: int = 0) -> Elements:
    """A shared port's elements (rules/dispatch.py): the service-ips
    element of its cluster IP and of each external VIP `vips` goes to the
    shared chooser of its count, which picks from the VIP's
    vip-endpoints elements, one per endpoint `ips` in order; the VIPs are
    marked for masquerade (masquerade-vips); it is an active cluster IP.
    With a `node_port`: its service-nodeports element goes to the node port
    chooser of its count, which picks from its nodeport-endpoints elements,
    and it is marked for masquerade (masquerade-nodeports)."""
    dests = (CIP, *vips)
    out: Elements = {
        **CLUSTER_IPS,
        "service-ips": {(d, "tcp", 80): f"goto dispatch-tcp-{len(ips)}" for d in dests},
        "vip-endpoints-tcp": {
            (d, 80, i): f"{ip}:80" for d in dests for i, ip in enumerate(ips)},
    }
    if vips:
        out["masquerade-vips"] = {(v, "tcp", 80): None for v in vips}
    return {**out, **(shared_nodeport(node_port, *ips) if node_port else {})}


def local_shared(
    cluster: tuple[str, ...], local: tuple[str, ...], vips: tuple[str, ...], node_port: int = 0
) -> Elements:
    """An eTP=Local port's elements (rules/dispatch.py): its cluster IP
    as a shared port's; each external VIP's service-ips element (its node
    port's service-nodeports element) goes to the shared external-local
    (nodeport-local) chain; the destination's cluster chooser picks from the
    `cluster` endpoints, its local chooser, with local endpoints, from the
    `local` ones."""
    nc, nl = len(cluster), len(local)
    out: Elements = {
        **CLUSTER_IPS,
        "service-ips": {
            (CIP, "tcp", 80): f"goto dispatch-tcp-{nc}",
            **{(v, "tcp", 80): "goto external-local" for v in vips},
        },
        "vip-endpoints-tcp": {
            (d, 80, i): f"{ip}:80" for d in (CIP, *vips) for i, ip in enumerate(cluster)},
    }
    if vips:
        out["external-cluster-choosers"] = {
            (v, "tcp", 80): f"goto dispatch-tcp-{nc}" for v in vips}
    if vips and local:
        out["external-local-choosers"] = {
            (v, "tcp", 80): f"goto dispatch-local-tcp-{nl}" for v in vips}
        out["vip-local-endpoints-tcp"] = {
            (v, 80, i): f"{ip}:80" for v in vips for i, ip in enumerate(local)}
    if node_port:
        key = ("tcp", node_port)
        out["service-nodeports"] = {key: "goto nodeport-local"}
        out["nodeport-cluster-choosers"] = {key: f"goto dispatch-nodeport-tcp-{nc}"}
        out["nodeport-endpoints-tcp"] = {
            (node_port, i): f"{ip}:80" for i, ip in enumerate(cluster)}
        if local:
            out["nodeport-local-choosers"] = {key: f"goto dispatch-nodeport-local-tcp-{nl}"}
            out["nodeport-local-endpoints-tcp"] = {
                (node_port, i): f"{ip}:80" for i, ip in enumerate(local)}
    return out


def shared_nodeport(node_port: int, *ips: str) -> Elements:
    """A shared port's node port elements (see `shared`)."""
    return {
        "service-nodeports": {("tcp", node_port): f"goto dispatch-nodeport-tcp-{len(ips)}"},
        "nodeport-endpoints-tcp": {(node_port, i): f"{ip}:80" for i, ip in enumerate(ips)},
        "masquerade-nodeports": {("tcp", node_port): None},
    }


AFFINITY_ITP_LOCAL = replace(AFFINITY, internal_traffic_policy=LOCAL)
FIREWALLED: Elements = {
    "firewall-vips": {(LB, "tcp", 80): None},
    "firewall-allow": {(LB, "tcp", 80, "203.0.113.0/25"): None},
}


DISPATCH_CASES = [
    Case(
        "cluster IP with endpoints goes to KUBE-SVC's shared chooser, is an active cluster IP, "
        "and its endpoint on another node is no hairpin pair",
        service_port(), REMOTE, shared(EP1), frozenset(),
    ),
    Case(
        "cluster IP with ClientIP affinity goes to its own KUBE-SVC",
        AFFINITY, REMOTE, SVC_CIP, frozenset({"SVC"}),
    ),
    Case(
        "cluster IP without endpoints is rejected and gets no chains at all",
        service_port(), (),
        {**CLUSTER_IPS, "no-endpoint-services": {(CIP, "tcp", 80): "goto KUBE-REJECT"}},
        frozenset(),
    ),
    Case(
        "node port with eTP=Cluster goes to the shared node port chooser, marked for masquerade",
        NODEPORT, REMOTE, shared(EP1, node_port=3001), frozenset(),
    ),
    Case(
        "node port with ClientIP affinity goes to its own KUBE-EXT",
        replace(AFFINITY, node_port=3001), REMOTE,
        {**SVC_CIP, "service-nodeports": {("tcp", 3001): "goto EXT"}},
        frozenset({"SVC", "EXT"}),
    ),
    Case(
        "node port without endpoints is rejected through no-endpoint-nodeports",
        NODEPORT, (),
        {
            **CLUSTER_IPS,
            "no-endpoint-services": {(CIP, "tcp", 80): "goto KUBE-REJECT"},
            "no-endpoint-nodeports": {("tcp", 3001): "goto KUBE-REJECT"},
        },
        frozenset(),
    ),
    Case(
        "external IP goes to the shared chooser, marked for masquerade",
        EXTERNAL_IP, REMOTE, shared(EP1, vips=(EIP,)), frozenset(),
    ),
    Case(
        "external IP with ClientIP affinity goes to its own KUBE-EXT",
        replace(AFFINITY, external_ips=(EIP,)), REMOTE,
        {
            **CLUSTER_IPS,
            "service-ips": {(CIP, "tcp", 80): "goto SVC", (EIP, "tcp", 80): "goto EXT"},
        },
        frozenset({"SVC", "EXT"}),
    ),
    Case(
        "external IP without endpoints is rejected like the cluster IP",
        EXTERNAL_IP, (),
        {**CLUSTER_IPS, "no-endpoint-services": {
            (CIP, "tcp", 80): "goto KUBE-REJECT", (EIP, "tcp", 80): "goto KUBE-REJECT"}},
        frozenset(),
    ),
    Case(
        "LB VIP goes to the shared chooser and an ipMode Proxy ingress is not captured",
        LB_PORT, REMOTE, shared(EP1, vips=(LB,), node_port=3001),
        frozenset(),
    ),
    Case(
        "LB VIP with ClientIP affinity goes to its own KUBE-EXT, Proxy ingress not captured",
        replace(LB_PORT, session_affinity=SessionAffinity.CLIENT_IP), REMOTE,
        {
            **CLUSTER_IPS,
            "service-ips": {(CIP, "tcp", 80): "goto SVC", (LB, "tcp", 80): "goto EXT"},
            "service-nodeports": {("tcp", 3001): "goto EXT"},
        },
        frozenset({"SVC", "EXT"}),
    ),
    Case(
        "LB VIP and node port without endpoints are rejected, Proxy ingress still ignored",
        LB_PORT, (),
        {
            **CLUSTER_IPS,
            "no-endpoint-services": {
                (CIP, "tcp", 80): "goto KUBE-REJECT", (LB, "tcp", 80): "goto KUBE-REJECT"},
            "no-endpoint-nodeports": {("tcp", 3001): "goto KUBE-REJECT"},
        },
        frozenset(),
    ),
    Case(
        "LB VIP with source ranges is a firewall-vips element with its allowed ranges",
        LB_RANGES, REMOTE, {**shared(EP1, vips=(LB,)), **FIREWALLED},
        frozenset(),
    ),
    Case(
        "LB VIP with source ranges and its own KUBE-EXT has the same firewall elements",
        replace(LB_RANGES, session_affinity=SessionAffinity.CLIENT_IP), REMOTE,
        {
            **CLUSTER_IPS,
            "service-ips": {(CIP, "tcp", 80): "goto SVC", (LB, "tcp", 80): "goto EXT"},
            **FIREWALLED,
        },
        frozenset({"SVC", "EXT"}),
    ),
    Case(
        "LB VIP with source ranges and no endpoints is still firewalled, then rejected",
        LB_RANGES, (),
        {
            **CLUSTER_IPS,
            "no-endpoint-services": {
                (CIP, "tcp", 80): "goto KUBE-REJECT", (LB, "tcp", 80): "goto KUBE-REJECT"},
            **FIREWALLED,
        },
        frozenset(),
    ),
    Case(
        "eTP=Local with a local endpoint sends every external destination to external-local",
        ETP_LOCAL, LOCAL_AND_REMOTE,
        {**local_shared((EP1, EP2), (EP1,), (EIP, LB), 3001), **hairpin(EP1)},
        frozenset(),
    ),
    Case(
        "eTP=Local without a local endpoint drops external destinations, no local chooser",
        ETP_LOCAL, REMOTE,
        {
            **local_shared((EP1,), (), (EIP, LB), 3001),
            "no-endpoint-services": {(EIP, "tcp", 80): "drop", (LB, "tcp", 80): "drop"},
            "no-endpoint-nodeports": {("tcp", 3001): "drop"},
        },
        frozenset(),
        external_dropped=True,
    ),
    Case(
        "eTP=Local with ClientIP affinity sends every external destination to KUBE-EXT",
        replace(ETP_LOCAL, session_affinity=SessionAffinity.CLIENT_IP), LOCAL_AND_REMOTE,
        {
            **CLUSTER_IPS,
            "service-ips": {
                (CIP, "tcp", 80): "goto SVC", (EIP, "tcp", 80): "goto EXT",
                (LB, "tcp", 80): "goto EXT"},
            "service-nodeports": {("tcp", 3001): "goto EXT"},
            **hairpin(EP1),
        },
        frozenset({"SVC", "SVL", "EXT"}),
    ),
    Case(
        "eTP=Local with no endpoints anywhere rejects rather than drops",
        ETP_LOCAL, (),
        {
            **CLUSTER_IPS,
            "no-endpoint-services": {
                (CIP, "tcp", 80): "goto KUBE-REJECT", (EIP, "tcp", 80): "goto KUBE-REJECT",
                (LB, "tcp", 80): "goto KUBE-REJECT"},
            "no-endpoint-nodeports": {("tcp", 3001): "goto KUBE-REJECT"},
        },
        frozenset(),
    ),
    Case(
        "iTP=Local with a local endpoint sends the cluster IP to KUBE-SVL's shared chooser "
        "of the local endpoints",
        ITP_LOCAL, LOCAL_AND_REMOTE, {**shared(EP1), **hairpin(EP1)}, frozenset(),
    ),
    Case(
        "iTP=Local with ClientIP affinity sends the cluster IP to its own KUBE-SVL",
        AFFINITY_ITP_LOCAL, LOCAL_AND_REMOTE,
        {**CLUSTER_IPS, "service-ips": {(CIP, "tcp", 80): "goto SVL"}, **hairpin(EP1)},
        frozenset({"SVL"}),
    ),
    Case(
        "iTP=Local without a local endpoint drops cluster IP traffic",
        ITP_LOCAL, REMOTE,
        {**CLUSTER_IPS, "no-endpoint-services": {(CIP, "tcp", 80): "drop"}},
        frozenset(),
        internal_dropped=True,
    ),
    Case(
        "iTP=Local with no endpoints anywhere rejects",
        ITP_LOCAL, (),
        {**CLUSTER_IPS, "no-endpoint-services": {(CIP, "tcp", 80): "goto KUBE-REJECT"}},
        frozenset(),
    ),
    Case(
        "iTP=Local does not affect node port traffic, which uses all endpoints",
        replace(ITP_LOCAL, node_port=3001), REMOTE,
        {
            **CLUSTER_IPS,
            "no-endpoint-services": {(CIP, "tcp", 80): "drop"},
            **shared_nodeport(3001, EP1),
        },
        frozenset(),
        internal_dropped=True,
    ),
    Case(
        "terminating endpoints serve when none is ready",
        service_port(), (endpoint(EP2, ready=False, terminating=True, serving=True),),
        shared(EP2), frozenset(),
    ),
    Case(
        "terminating endpoints are ignored while one is ready",
        service_port(),
        (endpoint(EP1), endpoint(EP2, ready=False, terminating=True, serving=True)),
        shared(EP1), frozenset(),
    ),
    Case(
        "terminating endpoints serve their own KUBE-SVC when none is ready",
        AFFINITY, (endpoint(EP2, ready=False, terminating=True, serving=True),),
        SVC_CIP, frozenset({"SVC"}),
    ),
    Case(
        "non-serving terminating endpoints count as no endpoints",
        service_port(), (endpoint(EP2, ready=False, terminating=True, serving=False),),
        {**CLUSTER_IPS, "no-endpoint-services": {(CIP, "tcp", 80): "goto KUBE-REJECT"}},
        frozenset(),
    ),
    Case(
        "eTP=Local falls back to a local terminating endpoint for external traffic",
        replace(NODEPORT, external_traffic_policy=LOCAL),
        (endpoint(EP1), endpoint(EP2, local=True, ready=False, terminating=True, serving=True)),
        {**local_shared((EP1,), (EP2,), (), 3001), **hairpin(EP2)},
        frozenset(),
    ),
]


def in_affinity_table(elements: Elements) -> Elements:
    """The elements of a port with ClientIP affinity, whose chains are the
    affinity table's: each destination's goto into one of them is in that
    table's map of the same name ("affinity:service-ips"), and the main
    table's map accepts the destination (its nat chain ends there, the
    affinity table's runs next)."""
    out: Elements = {}
    for name, elems in elements.items():
        for key, value in elems.items():
            own = value in ("goto SVC", "goto SVL", "goto EXT")
            if own and name in ("service-ips", "service-nodeports"):
                out.setdefault(name, {})[key] = "accept"
                out.setdefault(f"affinity:{name}", {})[key] = value
            else:
                out.setdefault(name, {})[key] = value
    return out


@pytest.mark.parametrize("case", DISPATCH_CASES, ids=lambda c: c.id)
def test_dispatch(case: Case) -> None:
    rendered = render(case.port, case.endpoints, config=case.config)
    lab = labels(case.port)
    expected = in_affinity_table(case.elements) if case.port.affinity else case.elements
    assert dispatch(rendered.fragment, lab) == expected
    assert {lab[c.name] for c in rendered.fragment.chains} == case.chains
    assert (rendered.internal_dropped, rendered.external_dropped) == (
        case.internal_dropped, case.external_dropped)
    # the shared chains it lists are exactly those its elements go to
    fragment = rendered.fragment
    gotos = {e.value.target for e in fragment.elements
             if isinstance(e.value, Verdict) and is_shared_chain(e.value.target)}
    assert {c.name for b in fragment.shared for c in b.chains} == gotos


def test_no_port_declares_a_set_of_its_own() -> None:
    """Source ranges, node ports, external IPs and ClientIP affinity are
    elements of shared sets, or entries the datapath adds to one."""
    port = replace(LB_RANGES, node_port=3001, external_ips=(EIP,))
    assert render(port, REMOTE).fragment.sets == ()
    affinity = replace(port, session_affinity=SessionAffinity.CLIENT_IP)
    assert render(affinity, REMOTE).fragment.sets == ()


def test_a_port_with_affinity_keeps_its_chains_and_their_gotos_in_the_affinity_table() -> None:
    """Its KUBE-SVC/EXT chains are the affinity table's (a goto element added
    to the main table then makes the kernel re-validate the main table only,
    without these cascades), their rules name that table's own objects, each
    destination is an `accept` in the main table's map and a goto in the
    affinity table's, both with the port's comment; everything else stays in
    the main table. A port of as many endpoints without affinity has no chain."""
    port = replace(AFFINITY, node_port=3001, external_ips=(EIP,),
                   load_balancer_ingress=(LoadBalancerIngress(LB),),
                   load_balancer_source_ranges=("203.0.113.0/25",))
    fragment = render(port, REMOTE).fragment
    svc, ext = names.service_chain(port.name), names.external_chain(port.name)
    assert {c.name for c in fragment.chains} == {f"affinity:{svc}", f"affinity:{ext}"}
    text = str([r.expr for c in fragment.chains for r in c.rules])
    assert "'@affinity'" in text and "'KUBE-MARK-MASQ'" in text and "affinity:" not in text
    by_set: dict[str, dict[object, Element]] = {}
    for e in fragment.elements:
        by_set.setdefault(e.set_name, {})[e.key] = e
    for name in ("service-ips", "service-nodeports"):
        main, aside = by_set[name], by_set[f"affinity:{name}"]
        assert main.keys() == aside.keys() and main
        for key, e in main.items():
            assert (e.value, e.comment) == (Verdict("accept"), aside[key].comment)
            assert aside[key].value in (Verdict("goto", svc), Verdict("goto", ext))
    assert {n for n in by_set if n.startswith("affinity:")} == {
        "affinity:service-ips", "affinity:service-nodeports"}
    assert {"cluster-ips", "firewall-vips", "firewall-allow"} <= by_set.keys()
    many_eps = render(service_port(), many(65)).fragment
    assert many_eps.chains == ()
    assert elements_of(many_eps, "service-ips") == {
        (CIP, "tcp", 80): Verdict("goto", "dispatch-tcp-65")}
    sticky = render(replace(port, node_port=0, external_ips=(), load_balancer_ingress=()),
                    many(65)).fragment
    assert {c.name for c in sticky.chains} == {f"affinity:{svc}"}


# --- meta-test: every renderer has a test ------------------------------------

RENDERER_TESTS = {
    "_cluster_ip_elements": "test_dispatch",
    "_shared_vip": "test_each_external_vip_goes_to_the_shared_chooser_with_its_own_elements",
    "_shared_nodeport": "test_the_node_port_goes_to_the_shared_node_port_chooser",
    "_local_vip": "test_an_etp_local_vip_goes_to_external_local_and_its_two_choosers",
    "_local_nodeport": "test_an_etp_local_node_port_goes_to_nodeport_local_and_its_two_choosers",
    "_picked": "test_shared_elements_are_the_endpoints_in_order_keyed_by_cluster_ip",
    "_external_elements": "test_dispatch",
    "_nodeport_elements": "test_dispatch",
    "_masquerade_rule": "test_cluster_ip_masquerade_rule_comes_first_in_kube_svc",
    "_endpoint_tail": "test_endpoint_rule_dnats_with_the_service_protocol",
    "_endpoint_comment": "test_endpoint_comments_name_the_endpoint_by_its_kube_sep_identity",
    "_affinity_rules": "test_affinity_lookups_come_after_masquerade_and_before_the_cascade",
    "_policy_chains": "test_etp_local_local_chain_contains_only_local_endpoints",
    "_external_chain": "test_etp_local_external_chain_short_circuits_pods_and_host",
    "_firewall_elements": "test_source_ranges_are_firewall_vips_and_firewall_allow_elements",
    "_hairpin_elements": "test_hairpin_elements_pair_each_reachable_endpoint_with_itself",
    "_may_hairpin_here": "test_only_an_endpoint_that_can_be_its_own_client_here_is_a_hairpin_pair",
    "_in_affinity_table": (
        "test_a_port_with_affinity_keeps_its_chains_and_their_gotos_in_the_affinity_table"
    ),
}
HELPERS = {"_key", "_contains_any", "_merge", "_net", "_internal_endpoints",
           "_local_policy_choosers"}
RENDERED = ("Chain", "Element", "Rule", "SetDecl", "Json")
"""What a renderer returns (in its annotation); a helper returns none of these."""
SERVICE_TEST_MODULES = (
    "test_rules_service.py",
    "test_rules_masquerade.py",
    "test_rules_service_endpoints.py",
    "test_rules_service_external.py",
    "test_rules_dispatch.py",
    "test_rules_dispatch_external.py",
    "test_rules_dispatch_local.py",
)
"""The modules testing rules/service.py, where RENDERER_TESTS's tests live."""


def _test_functions(modules: tuple[str, ...] = SERVICE_TEST_MODULES) -> set[str]:
    """Names of the module-level test functions of `modules` (files beside this one)."""
    found: set[str] = set()
    for module in modules:
        tree = ast.parse((Path(__file__).parent / module).read_text(), module)
        found |= {
            node.name for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
        }
    return found


def test_every_private_renderer_has_a_test() -> None:
    """A new renderer in rules/service.py must be added here with its test."""
    private = {
        name for name, fn in inspect.getmembers(service_mod, inspect.isfunction)
        if name.startswith("_") and fn.__module__ == service_mod.__name__
    }
    renderers = {
        name for name in private
        if any(t in str(inspect.signature(getattr(service_mod, name)).return_annotation)
               for t in RENDERED)
    }
    assert renderers <= set(RENDERER_TESTS)
    assert not renderers & HELPERS
    assert private == set(RENDERER_TESTS) | HELPERS
    tests = _test_functions()
    assert test_every_private_renderer_has_a_test.__name__ in tests  # the scan reads this file
    missing = set(RENDERER_TESTS.values()) - tests
    assert not missing, f"no such test in {SERVICE_TEST_MODULES}: {sorted(missing)}"
