"""Structural levers on the REAL Proxier, and a traffic check (bench only).

Layer: bench tooling. One job: let the other scripts run the real Proxier,
planner and backend with one of these structures around it, so a lever is
measured exactly as the product would pay for it if it were applied.

The inline DNAT in the KUBE-SVC/KUBE-SVL cascade with exact hairpin (the
`hairpin-endpoints` set) and loadBalancerSourceRanges through the shared
`firewall-vips` / `firewall-allow` sets, prototyped here before, are the
product now: ruleset v2 (issue 12). The levers left are:

- `baseline`     the product as it is.
- `shardK`       services spread over K self-contained tables (`nftproxy`,
                 `nftproxy1`, ... by crc32 of namespace/name), each with its
                 own nat base chains, dispatch maps, shared sets and
                 KUBE-MARK-MASQ, so a commit validates only the shards it
                 touches. Prototyped as K Proxier instances sharing one
                 NftBackend (one libnftables context); a sync of the facade
                 syncs every shard and sends all their commands as ONE
                 transaction. Each shard carries a full copy of the skeleton,
                 ip and ip6 (the product would keep filter/postrouting in one
                 common table): the per-table costs measured here are an
                 upper bound.
- `+split`       with shards: a FULL sync commits shard by shard (K
                 transactions, each atomic and self-contained) instead of one:
                 libnftables' peak memory follows the largest transaction.
- `+gcfreeze`    gc.freeze() after every full sync: the long-lived state
                 (~660k tracked objects at 10,000 x 10) leaves the cyclic
                 GC's generations, so no later collection walks it (a full
                 collection takes 0.3-0.4 s at that size).

Variant names join them with `+`, e.g. `shard16+split+gcfreeze`.

(c) the 1.0.6 cache-free "block" forms (rules inside `add chain X { ... }`,
elements inside `add map ... { elements = ... }`) exist only in nft's text
syntax: JSON has no rules inside a chain object. They cannot be used while
the product sends JSON; partial_sync.py measures the chain-dump tax they (or
libnftables >= 1.1.1) would remove.

`python bench/probes/levers.py [--quick] [--variants baseline,shard4]` checks each
variant by traffic in a sandbox (exact hairpin, masquerade of off-cluster
clients, spread, affinity, source ranges; no KUBE-SEP / KUBE-FW chains) and
prints one result line per variant.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: benchlib
import benchlib as bl

BENCH = "levers"
DEFAULT_VARIANTS = "baseline,shard4"

__all__ = ["Facade", "Levers", "build", "lever", "verify"]


# --- shards --------------------------------------------------------------------------


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

    def encoded(self, commands: Any) -> Any:
        return commands  # the facade encodes the shards' commands as one transaction

    def list_table_objects(self, family: str, table: str) -> Any:
        return self.backend.list_table_objects(family, table)


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


@dataclasses.dataclass(frozen=True)
class Levers:
    """What a variant name asks for (see the module docstring)."""

    shards: int = 1
    split_full: bool = False
    gc_freeze: bool = False


def lever(variant: str) -> Levers:
    """The levers of a variant name such as "shard16+split+gcfreeze"."""
    kw: dict[str, Any] = {}
    for part in variant.split("+"):
        if part == "baseline":
            continue
        if part == "split":
            kw["split_full"] = True
        elif part == "gcfreeze":
            kw["gc_freeze"] = True
        elif part.startswith("shard") and part[len("shard") :].isdigit():
            kw["shards"] = int(part[len("shard") :])
        else:
            raise ValueError(f"unknown variant part {part!r} in {variant!r}")
    return Levers(**kw)


def build(
    variant: str,
    backend: Any,
    *,
    config: Any = None,
    hooks: Sequence[Callable[..., None]] = (),
) -> Facade:
    """A facade for `variant` over `backend`."""
    lv = lever(variant)
    return Facade(
        backend,
        lv.shards,
        config=config,
        hooks=hooks,
        split_full=lv.split_full,
        gc_freeze=lv.gc_freeze,
    )


# --- traffic check ----------------------------------------------------------------------


def verify(variant: str, count: int) -> dict[str, Any]:
    """Hairpin, masquerade, spread, affinity and source ranges of `variant`,
    by traffic; and the v1 chains that must be gone (KUBE-SEP-*, KUBE-FW-*)."""
    from k8s import endpoint_slice, node, service  # tests/k8s.py

    from nftproxy.cluster.events import KIND_ENDPOINT_SLICES, KIND_SERVICES
    from nftproxy.core.model import IPFamily
    from nftproxy.kernel.libnftables import NftBackend
    from nftproxy.tools.sandbox import topology as tp

    spec = tp.Spec(pods=tp.default_pods(local=2, remote=0), udp_ports=(), sctp_ports=())
    config = bl.bench_config(cluster_cidrs=tp.CLUSTER_CIDRS[:1], node_ips=(tp.NODE_IPV4,))
    with tp.build(spec) as topo, NftBackend(netns=topo.node) as backend:
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
        chains = [c for p in facade.proxiers for c in p.table_state(IPFamily.IPV4).chains]
        return {
            "sep_chains": sum(1 for c in chains if c.startswith("KUBE-SEP-")),
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
    ap = argparse.ArgumentParser(description="traffic check of the product under each lever")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    args = ap.parse_args()
    bl.require_root()
    count = 20 if args.quick else 60
    variants = args.variants.split(",")
    for variant in variants:
        lever(variant)  # an unknown name fails before any sandbox is built
    bl.emit(BENCH, "machine", **bl.machine_info())
    for variant in variants:
        bl.progress(f"verify {variant}")
        bl.emit(
            BENCH, f"verify/{variant}", variant=variant, attempts=count, **verify(variant, count)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
