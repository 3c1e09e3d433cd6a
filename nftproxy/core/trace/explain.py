"""A walked branch told in kube-proxy's words: service, endpoint, masquerade, why.

Layer: core/trace (pure; reads the KUBE-* names of core/rules). One job:
turn one ended `Flow` into a `Path`. The walk itself knows nothing of
Kubernetes; here the rules that acted are recognised by their chains and
the sets they look up:
- masquerade: the rule that set the mark -- the hairpin rule of
  KUBE-POSTROUTING (its `hairpin-endpoints` lookup: the client is the
  endpoint), or the rule that jumped to the marking chain: a KUBE-SVC/SVL
  cluster-IP rule, or the one of a shared chooser (`dispatch-<p>-<N>`,
  which stands in for them), with a source condition (off-cluster source)
  or without one (masqueradeAll), a KUBE-EXT rule (externalTrafficPolicy=
  Cluster, or the node's own traffic to a Local one; the shared
  `external-local` / `nodeport-local` chains do what KUBE-EXT does for
  eTP=Local ports), or the KUBE-SERVICES / KUBE-NODEPORTS rule that looks
  the destination up in `masquerade-vips` / `masquerade-nodeports`
  (KUBE-EXT's marking of an eTP=Cluster external destination; the element
  names the KUBE-EXT-<h>, and the chooser's own cluster-IP rule, which
  marks it again, adds no reason);
- drop / reject: the `firewall-allow` rule of KUBE-FIREWALL-CHECK
  (loadBalancerSourceRanges), the KUBE-FIREWALL rule of localhost node
  ports (a packet for 127.0.0.0/8 from another host), an element of a
  no-endpoint map (no
  endpoints -> reject; Local policy without a local endpoint -> drop), the
  cluster-ips set (an unknown port of a cluster IP) or the service-cidrs set
  (an unallocated ServiceCIDR address).
kube-proxy's names that are no chains here come from comments
(identity.py): the endpoint's KUBE-SEP-<h> from the comment of the
endpoints map's element (or of the cascade rule) that DNATed, the port's
KUBE-FW-<h> from the `firewall-vips` element matched, and for a port whose
destination goes to a shared chooser the KUBE-SVC/SVL/EXT-<h> from the
comment of the `service-ips` / `service-nodeports` element (the path names
it among its chains, and the dispatch chain as its `chooser`).
Anything else is named by its chain and rule, never guessed.
"""

from __future__ import annotations

from nftproxy.core.address import format_address
from nftproxy.core.rules import dispatch
from nftproxy.core.rules import skeleton as sk
from nftproxy.core.trace import syntax as sx
from nftproxy.core.trace.flow import Affinity, ElementHit, Flow, MarkSet, Where
from nftproxy.core.trace.identity import (
    ENDPOINT,
    EXTERNAL,
    FIREWALL,
    chooser,
    identity,
    split,
)
from nftproxy.core.trace.result import Endpoint, Path
from nftproxy.core.trace.ruleset import Rule, Ruleset
from nftproxy.core.trace.values import Kind, matches, protocol_name

__all__ = ["explain"]

_SERVICE_CHAINS = ("KUBE-EXT-", "KUBE-SVC-", "KUBE-SVL-")
_NO_ENDPOINT_MAPS = (sk.NO_ENDPOINT_SERVICES, sk.NO_ENDPOINT_NODEPORTS)
_MARKING_SETS = (sk.MASQUERADE_VIPS, sk.MASQUERADE_NODEPORTS)
_EXTERNAL_CLUSTER = "external destination of an externalTrafficPolicy=Cluster service"


def explain(flow: Flow, rs: Ruleset) -> Path:
    shared = _shared_choosers(flow)
    chains = _service_chains(flow, shared)
    firewall = next((e for e in flow.elements if e.set == sk.FIREWALL_VIPS), None)
    endpoint = None
    if flow.dnat is not None:
        d = flow.dnat
        endpoint = Endpoint(
            d.addr, d.port, d.at.chain, d.comment or "", identity(d.comment, ENDPOINT)
        )
    masquerade = flow.masquerade is not None
    if flow.verdict == "accept":
        reasons = (
            _masquerade_reasons(flow, rs, shared) if masquerade else _kept_reasons(flow, chains)
        )
        if firewall is not None:
            reasons += (f"source {flow.saddr} is inside loadBalancerSourceRanges",)
    else:
        reasons = (_stop_reason(flow, rs),)
    return Path(
        probability=flow.probability,
        verdict=flow.verdict,
        delivery=flow.delivery,
        destination=format_address(str(flow.daddr), flow.dport),
        service=_service(flow, firewall),
        chains=chains,
        firewall=identity(firewall.comment, FIREWALL) if firewall else "",
        endpoint=endpoint,
        masquerade=masquerade,
        reasons=reasons,
        affinity=_affinity(flow.affinity, str(flow.saddr)),
        reject_with=flow.reject_with,
        steps=flow.steps,
        chooser=next((c for c in reversed(shared) if not dispatch.is_external_local_chain(c)), ""),
    )


def _service(flow: Flow, firewall: ElementHit | None) -> str:
    """The service port a dispatch map's element names; before any (a drop
    by the source ranges), the one of the `firewall-vips` element."""
    named = next((e.comment for e in flow.elements if e.verdict and e.comment), None)
    if named is None and firewall is not None:
        named = firewall.comment
    return split(named)[1]


def _shared_choosers(flow: Flow) -> dict[str, str]:
    """Shared choosers entered, each with the KUBE-SVC/SVL/EXT-<h>
    its map element's comment says it stands for."""
    out: dict[str, str] = {}
    for e in flow.elements:
        target = e.verdict.split()[-1] if e.verdict else ""
        if dispatch.is_shared_chain(target) and chooser(e.comment):
            out.setdefault(target, chooser(e.comment))
    return out


def _service_chains(flow: Flow, shared: dict[str, str]) -> tuple[str, ...]:
    """KUBE-EXT/SVC/SVL chains entered, in order (a chain whose rules
    all let the packet pass shows only as the target of a map element; a
    shared chooser as the KUBE-SVC/SVL-<h> it stands for)."""
    entered = [e.verdict.split()[-1] for e in flow.elements if e.verdict]
    entered += [s.chain for s in flow.steps]
    ordered = sorted(set(entered), key=lambda c: min(_first_seen(flow, c)))
    named = (shared.get(c, c) for c in ordered)
    return tuple(c for c in named if c.startswith(_SERVICE_CHAINS))


def _first_seen(flow: Flow, chain: str) -> list[int]:
    at = [i for i, s in enumerate(flow.steps) if s.chain == chain or s.text.endswith(" " + chain)]
    return at or [len(flow.steps)]


def _rule(rs: Ruleset, where: Where | None) -> Rule | None:
    if where is None or where.rule == 0 or where.chain not in rs.chains:
        return None
    rules = rs.chains[where.chain].rules
    return rules[where.rule - 1] if where.rule <= len(rules) else None


def _matches(rule: Rule) -> list[sx.Match]:
    return [s for s in rule.statements if isinstance(s, sx.Match)]


def _is_source_match(m: sx.Match) -> bool:
    left = m.left
    return (isinstance(left, sx.Payload) and left.field == "saddr") or (
        isinstance(left, sx.Key) and str(left) == "meta iifname"
    )


def _looks_up(rule: Rule, set_name: str) -> bool:
    return any(isinstance(m.right, sx.SetRef) and m.right.name == set_name for m in _matches(rule))


def _looks_up_hairpin(rule: Rule) -> bool:
    return _looks_up(rule, sk.HAIRPIN_ENDPOINTS)


# --- masquerade --------------------------------------------------------------------------


def _masquerade_reasons(flow: Flow, rs: Ruleset, shared: dict[str, str]) -> tuple[str, ...]:
    reasons = [_mark_reason(flow, m, rs, shared) for m in flow.marks]
    if any(r.startswith(_EXTERNAL_CLUSTER + ":") for r in reasons):
        # the marking rule of the external destination is named: the shared
        # chooser's own mark of it (its cluster-IP rule) repeats it
        reasons = [r for r in reasons if r != _EXTERNAL_CLUSTER]
    return tuple(dict.fromkeys(reasons)) or ("masqueraded (no mark was set on the way)",)


def _mark_reason(flow: Flow, mark: MarkSet, rs: Ruleset, shared: dict[str, str]) -> str:
    caller, marking, at = _rule(rs, mark.caller), _rule(rs, mark.at), mark.at
    if marking is not None and _looks_up_hairpin(marking):
        return "hairpin: the endpoint itself is the source"
    if caller is None:
        return f"marked for masquerade by {at.chain}/rule {at.rule}"
    chain = caller.chain
    marked = next((s for s in _MARKING_SETS if _looks_up(caller, s)), None)
    if marked is not None:
        return _external_mark(flow, caller, marked)
    if chain.startswith("KUBE-EXT-") or dispatch.is_external_local_chain(chain):
        return _external_chain_mark(caller)
    if shared.get(chain, "").startswith(EXTERNAL):
        return _EXTERNAL_CLUSTER
    if chain.startswith(("KUBE-SVC-", "KUBE-SVL-")) or dispatch.is_shared_chain(chain):
        if any(_is_source_match(m) for m in _matches(caller)):
            return "off-cluster source to a cluster IP (not from a pod on this node)"
        return "masqueradeAll: all traffic to the cluster IP is masqueraded"
    return f"marked for masquerade by {caller.where}"


def _external_chain_mark(caller: Rule) -> str:
    """A KUBE-EXT chain's mark (or external-local's / nodeport-local's, which
    do what KUBE-EXT does for eTP=Local ports): the node's own traffic with
    the Local policy, every packet with the Cluster policy."""
    if any(isinstance(m.left, sx.Fib) and m.left.field == "saddr" for m in _matches(caller)):
        return "the node's own traffic to an externalTrafficPolicy=Local destination (Local policy)"
    return _EXTERNAL_CLUSTER


def _external_mark(flow: Flow, caller: Rule, marked: str) -> str:
    """KUBE-EXT's mark of an external destination whose element goes to a
    shared chooser: set by `caller` (KUBE-SERVICES or KUBE-NODEPORTS) for
    the destination's element of `marked`, which names the KUBE-EXT-<h>."""
    hit = next((e for e in flow.elements if e.set == marked and e.at.chain == caller.chain), None)
    ext = identity(hit.comment, EXTERNAL) if hit is not None else ""
    by = f"{ext}'s mark, set by" if ext else "marked by"
    return f"{_EXTERNAL_CLUSTER}: {by} {caller.where} (@{marked})"


def _kept_reasons(flow: Flow, chains: tuple[str, ...]) -> tuple[str, ...]:
    if flow.dnat is None:
        return ("no service matched: the packet is not translated",)
    ext = any(c.startswith("KUBE-EXT-") for c in chains)
    if ext and any(c.startswith("KUBE-SVL-") for c in chains):
        return ("externalTrafficPolicy=Local: the client's address is kept",)
    if ext:
        return (
            "pod traffic to an external destination of a Local-policy service: "
            "sent to any endpoint, source kept",
        )
    return ("not marked for masquerade",)


# --- drop / reject -------------------------------------------------------------------------


def _stop_reason(flow: Flow, rs: Ruleset) -> str:
    at, via = flow.verdict_at, flow.verdict_via
    stopped = _rule(rs, at)
    if stopped is not None and _looks_up(stopped, sk.FIREWALL_ALLOW):
        return f"source {flow.saddr} is outside the service's loadBalancerSourceRanges"
    if stopped is not None and (stopped.comment or "").startswith(sk.KUBE_FIREWALL + ":"):
        return (f"{flow.daddr} is a loopback address and {flow.saddr} is not: "
                f"{sk.KUBE_FIREWALL} drops it (route_localnet, CVE-2020-8558)")
    element = next((e for e in reversed(flow.elements) if e.at in (at, via)), None)
    if element is not None and element.set in _NO_ENDPOINT_MAPS:
        return _no_endpoint_reason(flow, element.set, rs)
    for rule in (stopped, _rule(rs, via)):
        if rule is not None and _looks_up(rule, sk.CLUSTER_IPS):
            return (
                f"{flow.daddr} is a cluster IP without port {flow.dport}/"
                f"{_proto(flow)}: unknown port of a cluster IP"
            )
        if rule is not None and _looks_up(rule, sk.SERVICE_CIDRS):
            return f"{flow.daddr} is in a ServiceCIDR but no service has it: unallocated address"
        if rule is not None and rule.chain == sk.FORWARD:
            return f"{rule.comment or 'dropped by ' + sk.FORWARD}"
    where = at or via
    name = f"{where.chain}/rule {where.rule}" if where else "a base chain's policy"
    return f"{flow.verdict} by {name}"


def _no_endpoint_reason(flow: Flow, set_name: str, rs: Ruleset) -> str:
    if flow.verdict == "reject":
        return "the service has no endpoints"
    internal = set_name == sk.NO_ENDPOINT_SERVICES and _is_cluster_ip(flow, rs)
    policy = "internalTrafficPolicy" if internal else "externalTrafficPolicy"
    return f"{policy}=Local and no endpoint on this node"


def _is_cluster_ip(flow: Flow, rs: Ruleset) -> bool:
    if sk.CLUSTER_IPS not in rs.sets:
        return False
    return any(matches(e.pattern, flow.daddr) for e in rs.elements(sk.CLUSTER_IPS, (Kind.ADDR,)))


def _proto(flow: Flow) -> str:
    return protocol_name(flow.proto)


# --- affinity ------------------------------------------------------------------------------


def _affinity(notes: tuple[Affinity, ...], src: str) -> str:
    for note in notes:
        if note.pinned:
            left = f", {note.expires}s left" if note.expires is not None else ""
            return f"affinity pins {src} to this endpoint (@{note.set}{left})"
    for note in notes:
        timeout = f" for {note.timeout}s" if note.timeout is not None else ""
        return f"affinity would pin {src} to this endpoint{timeout} (@{note.set})"
    return ""
