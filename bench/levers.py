"""Structural levers, prototyped on the REAL translator's output (bench only).

Layer: bench tooling. One job: let the other scripts run the real Proxier,
planner and backend with one of these ruleset structures, so a lever is
measured exactly as the product would pay for it if it were applied:

- `baseline`     the product as it is (KUBE-SVC cascade -> one KUBE-SEP chain
                 per endpoint: hairpin mark, affinity update, DNAT).
- `inline`       (a) DNAT inlined into the KUBE-SVC/KUBE-SVL cascade: every
                 `goto KUBE-SEP-x` becomes that endpoint's affinity update +
                 `meta l4proto tcp dnat to ip:port`; no KUBE-SEP chains.
                 Hairpin keeps kube-proxy's EXACT semantics (masquerade only
                 when the client is the endpoint it was sent to): one element
                 `ep . ep` per endpoint in a plain concatenated set
                 `hairpin-endpoints` (owned by the service's fragment, like a
                 cluster-ips element), and one rule at the head of
                 KUBE-POSTROUTING: `ct status dnat ip saddr . ip daddr
                 @hairpin-endpoints meta mark set meta mark | 0x4000`. After
                 DNAT the destination IS the chosen endpoint, so
                 `saddr == daddr` is exactly "the client is the chosen
                 endpoint". Plain-set elements never trigger the kernel's
                 table validation, and the rule is in the skeleton.
- `inline-loose` (a') the notes' `inlinem`: per-endpoint `ip saddr EP jump
                 KUBE-MARK-MASQ` at the head of the service chain (masquerades
                 when the client is ANY endpoint of the service).
- `fwset`        (d) loadBalancerSourceRanges without a KUBE-FW chain and an
                 interval set per service: two shared sets, `firewall-vips`
                 (vip . proto . port) and `firewall-allow` (vip . proto . port
                 . source range, a concatenated interval set), checked by one
                 rule in KUBE-FIREWALL-CHECK (same place, pre-DNAT, same
                 drop). libnftables 1.0.6 fetches the elements of every
                 NON-concatenated interval set of the namespace before any
                 batch that adds or deletes an element (one netlink dump per
                 set: NFT_CACHE_SETELEM_MAYBE); concatenated ones are skipped.
- `shardK`, `inline+shardK`  (b) services spread over K self-contained tables
                 (`nftproxy`, `nftproxy1`, ... by crc32 of namespace/name), each
                 with its own nat base chains, dispatch maps and KUBE-MARK-MASQ,
                 so a commit validates only the shards it touches. Prototyped as
                 K Proxier instances sharing one NftBackend (one libnftables
                 context); a sync of the facade syncs every shard and sends
                 all their commands as ONE transaction. Each shard carries a
                 full copy of the skeleton, ip and ip6 (the product would keep
                 filter/postrouting in one common table): the per-table costs
                 measured here are an upper bound.
- `+split`       with shards: a FULL sync commits shard by shard (K
                 transactions, each atomic and self-contained) instead of one:
                 libnftables' peak memory follows the largest transaction.
- `+gcfreeze`    gc.freeze() after every full sync: the long-lived state
                 (~660k tracked objects at 10,000 x 10) leaves the cyclic
                 GC's generations, so no later collection walks it (a full
                 collection takes 0.3-0.4 s at that size).

(c) the 1.0.6 cache-free "block" forms (rules inside `add chain X { ... }`,
elements inside `add map ... { elements = ... }`) exist only in nft's text
syntax: JSON has no rules inside a chain object. They cannot be used while
the product sends JSON; partial_sync.py measures the chain-dump tax they (or
libnftables >= 1.1.1) would remove.

`python bench/levers.py [--quick]` checks the prototypes by traffic in a
sandbox (hairpin exactness, affinity, masquerade of off-cluster clients) and
prints one result line per check.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import benchlib as bl

BENCH = "levers"
HAIRPIN_SET = "hairpin-endpoints"
SEP_PREFIX = "KUBE-SEP-"

__all__ = ["HAIRPIN_SET", "VARIANTS", "Facade", "build", "lever"]


# --- (a) inline DNAT ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Sep:
    ip: str
    hairpin: Any  # the SEP chain's hairpin Rule
    affinity: tuple[Any, ...]  # affinity update statements
    dnat: tuple[Any, ...]  # l4proto match + dnat statement


def _sep_parts(chain: Any) -> _Sep:
    hairpin, affinity, dnat = None, (), ()
    for rule in chain.rules:
        last = rule.expr[-1]
        if "jump" in last:
            hairpin = rule
        elif "dnat" in last:
            dnat = tuple(rule.expr)
        elif "set" in last:
            affinity = tuple(rule.expr)
    if hairpin is None or not dnat:
        raise ValueError(f"unexpected KUBE-SEP chain shape: {chain}")
    ip = hairpin.expr[0]["match"]["right"]
    return _Sep(ip, hairpin, affinity, dnat)


def _inline_fragment(fragment: Any, *, exact: bool, family: Any) -> Any:
    from nftproxy.core.rules.fragment import Chain, Element, Rule

    seps = {c.name: _sep_parts(c) for c in fragment.chains if c.name.startswith(SEP_PREFIX)}
    if not seps:
        return fragment
    chains = []
    for chain in fragment.chains:
        if chain.name in seps:
            continue
        rules = []
        used: list[_Sep] = []
        for rule in chain.rules:
            last = rule.expr[-1]
            target = last.get("goto", {}).get("target") if isinstance(last, dict) else None
            if target in seps:
                sep = seps[target]
                used.append(sep)
                rules.append(Rule((*rule.expr[:-1], *sep.affinity, *sep.dnat), rule.comment))
            else:
                rules.append(rule)
        if not exact and used:
            seen: dict[str, Any] = {}
            for sep in used:
                seen.setdefault(sep.ip, sep.hairpin)
            rules = [*seen.values(), *rules]
        chains.append(Chain(chain.name, tuple(rules), chain.hook))
    elements = fragment.elements
    if exact:
        ips = sorted({s.ip for s in seps.values()})
        elements = (*elements, *(Element(HAIRPIN_SET, (ip, ip)) for ip in ips))
    return dataclasses.replace(fragment, chains=tuple(chains), elements=elements)


def _hairpin_skeleton(fragment: Any, config: Any) -> Any:
    from nftproxy.core.rules import expr
    from nftproxy.core.rules import skeleton as sk
    from nftproxy.core.rules.fragment import Chain, Rule, SetDecl

    ip = fragment.family.nft_family
    addr = sk.addr_type(fragment.family)
    decl = SetDecl(HAIRPIN_SET, (addr, addr), comment="endpoint . endpoint: hairpin")
    hairpin = Rule(
        (
            {"match": {"op": "in", "left": {"ct": {"key": "status"}}, "right": "dnat"}},
            {
                "match": {
                    "op": "==",
                    "left": {
                        "concat": [
                            {"payload": {"protocol": ip, "field": "saddr"}},
                            {"payload": {"protocol": ip, "field": "daddr"}},
                        ]
                    },
                    "right": "@" + HAIRPIN_SET,
                }
            },
            expr.mark_set(config.masquerade_mark),
        ),
        "hairpin: the client is the endpoint it was sent to",
    )
    chains = tuple(
        Chain(c.name, (hairpin, *c.rules), c.hook) if c.name == sk.POSTROUTING else c
        for c in fragment.chains
    )
    return dataclasses.replace(fragment, chains=chains, sets=(*fragment.sets, decl))


# --- (d) one shared set for loadBalancerSourceRanges ------------------------------------

FW_VIPS = "firewall-vips"
FW_ALLOW = "firewall-allow"


class _HDict(dict):  # type: ignore[type-arg]
    """A hashable JSON object (an interval inside a set-element key)."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(json.dumps(self, sort_keys=True))


def _hashable(value: Any) -> Any:
    if isinstance(value, dict):
        return _HDict({k: _hashable(v) for k, v in value.items()})
    return value


def _fwset_fragment(fragment: Any) -> Any:
    """KUBE-FW chain + per-service interval set -> elements of two shared
    sets (no chain, no per-service set, no goto: nothing to validate)."""
    from nftproxy.core.rules import skeleton as sk
    from nftproxy.core.rules.fragment import Element

    fw_sets = {d.name: d for d in fragment.sets if d.name.startswith("KUBE-FW-")}
    if not fw_sets:
        return fragment
    ranges = [_hashable(e) for d in fw_sets.values() for e in d.elements]
    elements = []
    for e in fragment.elements:
        if e.set_name != sk.FIREWALL_IPS:
            elements.append(e)
            continue
        elements.append(Element(FW_VIPS, e.key, None, e.comment))
        elements += [Element(FW_ALLOW, (*e.key, r), None, e.comment) for r in ranges]
    return dataclasses.replace(
        fragment,
        chains=tuple(c for c in fragment.chains if not c.name.startswith("KUBE-FW-")),
        sets=tuple(d for d in fragment.sets if d.name not in fw_sets),
        elements=tuple(elements),
    )


def _fwset_skeleton(fragment: Any) -> Any:
    from nftproxy.core.rules import expr
    from nftproxy.core.rules import skeleton as sk
    from nftproxy.core.rules.fragment import Chain, Rule, SetDecl

    ip = fragment.family.nft_family
    addr = sk.addr_type(fragment.family)
    key = expr.concat_daddr_proto_dport(fragment.family)
    with_src = {"concat": [*key["concat"], {"payload": {"protocol": ip, "field": "saddr"}}]}
    rule = Rule(
        (
            {"match": {"op": "==", "left": key, "right": "@" + FW_VIPS}},
            {"match": {"op": "!=", "left": with_src, "right": "@" + FW_ALLOW}},
            expr.drop(),
        ),
        "loadBalancerSourceRanges",
    )
    sets = (
        SetDecl(FW_VIPS, (addr, "inet_proto", "inet_service"), comment="LB VIPs with ranges"),
        SetDecl(
            FW_ALLOW,
            (addr, "inet_proto", "inet_service", addr),
            flags=("interval",),
            comment="LB VIP . allowed source range",
        ),
    )
    chains = tuple(
        Chain(c.name, (rule,), c.hook) if c.name == sk.FIREWALL_CHECK else c
        for c in fragment.chains
    )
    return dataclasses.replace(fragment, chains=chains, sets=(*fragment.sets, *sets))


@contextlib.contextmanager
def patched(*, inline: str | None, fwset: bool) -> Iterator[None]:
    """Patch the render step's renderers (in this process) with the levers."""
    import nftproxy.core.render as px

    orig_port, orig_skel = px.render_service_port, px.render_skeleton
    exact = inline == "exact"

    def render_service_port(port: Any, endpoints: Any, ctx: Any) -> Any:
        rendered = orig_port(port, endpoints, ctx)
        frag = rendered.fragment
        if inline is not None:
            frag = _inline_fragment(frag, exact=exact, family=ctx.family)
        if fwset:
            frag = _fwset_fragment(frag)
        return dataclasses.replace(rendered, fragment=frag)

    def render_skeleton(family: Any, config: Any, node: Any, cidrs: Any = ()) -> Any:
        frag = orig_skel(family, config, node, cidrs)
        if exact:
            frag = _hairpin_skeleton(frag, config)
        if fwset:
            frag = _fwset_skeleton(frag)
        return frag

    px.render_service_port = render_service_port  # type: ignore[assignment]
    px.render_skeleton = render_skeleton  # type: ignore[assignment]
    try:
        yield
    finally:
        px.render_service_port, px.render_skeleton = orig_port, orig_skel  # type: ignore[assignment]


# --- (b) shards ---------------------------------------------------------------------


@dataclasses.dataclass
class FacadeReport:
    """A SyncReport-like sum over the shards of one facade sync."""

    full: bool
    ops: int
    render_seconds: float
    commit_seconds: float
    total_seconds: float
    shards_committed: int
    reports: list[Any]


def _service_key(obj: dict[str, Any]) -> str:
    meta = obj["metadata"]
    name = (
        meta.get("labels", {}).get("kubernetes.io/service-name")
        if obj.get("kind") == "EndpointSlice"
        else meta["name"]
    )
    return f"{meta.get('namespace', '')}/{name}"


class _Collector:
    """What a shard's Proxier sees as its backend: commits are collected, to
    be sent by the facade as ONE transaction with the other shards'."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.pending: list[Any] = []
        self.fresh = False

    def commit(self, commands: Any, *, fresh: bool = False) -> None:
        self.pending += commands
        self.fresh = self.fresh or fresh

    def list_table_objects(self, family: str, table: str) -> Any:
        return self.backend.list_table_objects(family, table)

    def accepts_typeof(self) -> bool:
        return bool(self.backend.accepts_typeof())


class Facade:
    """K Proxiers behind the Proxier's event API. K=1 is the product as it is
    (the Proxier commits and runs the hooks itself). For K>1 every shard's
    commands of one sync go to the kernel as ONE transaction, as a sharded
    product would send them; hooks run after that commit. (A refused
    transaction would leave the shards' recorded state ahead of the kernel:
    acceptable for a benchmark, not for the product.)"""

    def __init__(
        self,
        backend: Any,
        shards: int = 1,
        *,
        config: Any = None,
        hooks: Sequence[Callable[..., None]] = (),
        split_full: bool = False,
        gc_freeze: bool = False,
    ) -> None:
        base = config or bl.bench_config()
        self.backend = backend
        self.hooks = list(hooks)
        self.split_full = split_full
        self.gc_freeze = gc_freeze
        self.collectors = [_Collector(backend) for _ in range(shards)] if shards > 1 else []
        self.proxiers = [
            bl.make_proxier(
                self.collectors[k] if self.collectors else backend,
                dataclasses.replace(base, table_name=base.table_name + (str(k) if k else "")),
                () if self.collectors else hooks,
            )
            for k in range(shards)
        ]

    def _pick(self, prev: Any, cur: Any) -> Any:
        obj = cur if cur is not None else prev
        k = zlib.crc32(_service_key(obj).encode()) % len(self.proxiers)
        return self.proxiers[k]

    def on_service(self, prev: Any, cur: Any) -> None:
        self._pick(prev, cur).on_service(prev, cur)

    def on_endpoint_slice(self, prev: Any, cur: Any) -> None:
        self._pick(prev, cur).on_endpoint_slice(prev, cur)

    def on_node(self, node: Any) -> None:
        for p in self.proxiers:
            p.on_node(node)

    def on_synced(self, kind: str) -> None:
        for p in self.proxiers:
            p.on_synced(kind)

    def set_change_callback(self, fn: Callable[[], None]) -> None:
        for p in self.proxiers:
            p.set_change_callback(fn)

    def sync(self) -> FacadeReport:
        t0 = time.perf_counter()
        reports = [p.sync() for p in self.proxiers]
        commit_s = sum(r.commit_seconds for r in reports)
        render_s = sum(r.render_seconds for r in reports)
        full = any(r.full for r in reports)
        if self.collectors:
            batches = [(c.pending, c.fresh) for c in self.collectors]
            for c in self.collectors:
                c.pending, c.fresh = [], False
            if not (full and self.split_full):  # one transaction for all shards
                batches = [([x for b, _ in batches for x in b], any(f for _, f in batches))]
            render_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            for commands, fresh in batches:
                self.backend.commit(commands, fresh=fresh)
            commit_s = time.perf_counter() - t1
            for report in reports:
                for hook in self.hooks:
                    hook(report)
        if full and self.gc_freeze:
            gc.freeze()
        return FacadeReport(
            full=full,
            ops=sum(r.ops for r in reports),
            render_seconds=render_s,
            commit_seconds=commit_s,
            total_seconds=time.perf_counter() - t0,
            shards_committed=sum(1 for r in reports if r.ops),
            reports=reports,
        )

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.proxiers:
            for k, v in bl.chain_count(p).items():
                out[k] = out.get(k, 0) + v
        return out


VARIANTS = ("baseline", "inline", "inline-loose", "fwset", "shard16", "inline+fwset+shard16")


@dataclasses.dataclass(frozen=True)
class Levers:
    inline: str | None = None  # "exact" / "loose"
    fwset: bool = False
    shards: int = 1
    split_full: bool = False
    gc_freeze: bool = False


def _parse(variant: str) -> Levers:
    """The levers of a variant name such as "inline+fwset+shard16+gcfreeze"."""
    kw: dict[str, Any] = {}
    for part in variant.split("+"):
        if part == "baseline":
            continue
        if part == "inline":
            kw["inline"] = "exact"
        elif part == "inline-loose":
            kw["inline"] = "loose"
        elif part == "fwset":
            kw["fwset"] = True
        elif part == "split":
            kw["split_full"] = True
        elif part == "gcfreeze":
            kw["gc_freeze"] = True
        elif part.startswith("shard"):
            kw["shards"] = int(part[len("shard") :])
        else:
            raise ValueError(f"unknown variant part {part!r} in {variant!r}")
    return Levers(**kw)


@contextlib.contextmanager
def lever(variant: str) -> Iterator[int]:
    """Install the variant's renderer patch for the body; yields the shard count."""
    lv = _parse(variant)
    with patched(inline=lv.inline, fwset=lv.fwset):
        yield lv.shards


def build(
    variant: str,
    backend: Any,
    *,
    config: Any = None,
    hooks: Sequence[Callable[..., None]] = (),
) -> Facade:
    """A facade for `variant` (call inside `with lever(variant)`)."""
    lv = _parse(variant)
    return Facade(
        backend,
        lv.shards,
        config=config,
        hooks=hooks,
        split_full=lv.split_full,
        gc_freeze=lv.gc_freeze,
    )


# --- traffic check of the prototypes -------------------------------------------------


def verify(variant: str, count: int) -> dict[str, Any]:
    """Hairpin, affinity and masquerade behaviour of `variant`, by traffic."""
    from k8s import endpoint_slice, node, service  # tests/k8s.py

    from nftproxy.cluster.events import KIND_ENDPOINT_SLICES, KIND_SERVICES
    from nftproxy.kernel.libnftables import NftBackend
    from nftproxy.tools.sandbox import topology as tp

    spec = tp.Spec(pods=tp.default_pods(local=2, remote=0), udp_ports=(), sctp_ports=())
    config = bl.bench_config(cluster_cidrs=tp.CLUSTER_CIDRS[:1], node_ips=(tp.NODE_IPV4,))
    with tp.build(spec) as topo, NftBackend(netns=topo.node) as backend, lever(variant):
        facade = build(variant, backend, config=config)
        facade.on_node(node(tp.NODE_NAME, [tp.NODE_IPV4], pod_cidrs=["10.244.0.0/24"]))
        eps = [(p.ipv4, tp.NODE_NAME) for p in topo.pods.values()]
        ports = (("http", 8080, "TCP"),)
        lb = {
            "type": "LoadBalancer",
            "node_ports": [30080],
            "lb_ips": ["192.168.60.10"],
            "source_ranges": [f"{tp.CLIENT_IPV4[0]}/32"],
        }
        for name, vip, kw in (
            ("plain", "10.96.0.10", {}),
            ("sticky", "10.96.0.11", {"affinity_timeout": 60}),
            ("fw", "10.96.0.12", lb),
        ):
            facade.on_service(None, service(name, vip, ports=(("http", 80, "TCP"),), **kw))
            facade.on_endpoint_slice(None, endpoint_slice(name, eps, ports=ports))
        facade.on_synced(KIND_SERVICES)
        facade.on_synced(KIND_ENDPOINT_SLICES)
        facade.sync()
        pod1 = topo.pods["local1"]
        # hairpin: pod1 -> its own service; kube-proxy masquerades only when
        # pod1 is sent to itself (it then sees the gateway), never otherwise
        hp = topo.probe("local1", "tcp", "10.96.0.10", 80, count=count)
        self_peers = {a.peer for a in hp if a.pod == "local1"}
        other_peers = {a.peer for a in hp if a.pod == "local2"}
        exact = self_peers == {pod1.gateway_ipv4} and other_peers == {pod1.ipv4}
        # off-cluster client: masqueraded (its address is not in the cluster CIDR)
        cl = topo.probe("client", "tcp", "10.96.0.10", 80, count=count)
        client_masq = {a.peer for a in cl} == {pod1.gateway_ipv4}
        spread = len({a.pod for a in cl}) == 2
        st = topo.probe("client", "tcp", "10.96.0.11", 80, count=count)
        sticky = len({a.pod for a in st}) == 1 and all(a.ok for a in st)
        allowed = topo.probe("client", "tcp", "192.168.60.10", 80, count=3, src=tp.CLIENT_IPV4[0])
        denied = topo.probe(
            "client", "tcp", "192.168.60.10", 80, count=2, src=tp.CLIENT_IPV4[1], timeout=0.5
        )
        ranges_ok = all(a.ok for a in allowed) and all(a.error == "timeout" for a in denied)
        from nftproxy.core.model import IPFamily

        chains = [c for p in facade.proxiers for c in p.table_state(IPFamily.IPV4).chains]
        return {
            "sep_chains": sum(1 for c in chains if c.startswith(SEP_PREFIX)),
            "fw_chains": sum(1 for c in chains if c.startswith("KUBE-FW-")),
            "hairpin_self_peers": sorted(p or "" for p in self_peers),
            "hairpin_other_peers": sorted(p or "" for p in other_peers),
            "hairpin_exact": exact,
            "client_masqueraded": client_masq,
            "spread_over_endpoints": spread,
            "affinity_sticks": sticky,
            "source_ranges_enforced": ranges_ok,
            "errors": sum(1 for a in (*hp, *cl, *st, *allowed) if not a.ok),
        }


def main() -> int:
    ap = argparse.ArgumentParser(description="traffic check of the lever prototypes")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--variants", default="baseline,inline,inline-loose,fwset,inline+fwset+shard4")
    args = ap.parse_args()
    bl.require_root()
    count = 20 if args.quick else 60
    bl.emit(BENCH, "machine", **bl.machine_info())
    for variant in args.variants.split(","):
        bl.progress(f"verify {variant}")
        bl.emit(
            BENCH, f"verify/{variant}", variant=variant, attempts=count, **verify(variant, count)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
