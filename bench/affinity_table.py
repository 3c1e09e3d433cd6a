"""ClientIP-affinity ports in a table of their own: what a partial sync would gain (experiment).

Layer: bench tooling. One job: measure the one structural lever left for
adding a service at 10,000 x 10 (bench/RESULTS.md, fifteenth pass: ~8 of
its ~11 ms commit are the kernel re-validating the chains of the 500
ClientIP-affinity ports, because the commit adds a goto element and the
kernel validates the whole table that holds it; validation is per table).

Two variants, each loaded into a throwaway namespace by the real Proxier
(the benchlib mix, 1 service in 20 with ClientIP affinity), then R cycles of
add / change / delete through the same Proxier (partial syncs, as
bench/partial_sync.py; `change` picks a port without affinity):

- `product`: the table as the product writes it;
- `afftable`: after the first full sync, one transaction moves every port
  whose chains use the `affinity` set to a second table
  `ip nftproxy-affinity`: its chains, the `affinity` set, a KUBE-MARK-MASQ
  chain, `service-ips` / `service-nodeports` verdict maps holding the
  moved ports' gotos, and nat base chains at priority -99 (after the main
  table's -100; nat base chains of one hook run in priority order until one
  NATs the connection). The main table keeps an `accept` element for each
  moved key, so the main table's claims still see the key and its nat chain
  ends there; the rest of the ruleset (filter checks, source ranges,
  no-endpoint maps, hairpin, masquerade) stays in the main table.

Also, per variant: `goto_main`, one `service-ips` element -> a shared
chooser added (and removed) in the main table; in `afftable`, `goto_aff`,
the same to a moved KUBE-SVC chain in the affinity table (what adding an
affinity port would then pay).

With `--traffic`, a sandbox node (tools/sandbox) first checks the
`afftable` shape by traffic: a ClientIP-affinity ClusterIP and NodePort
served from the second table stick per client, a plain service in the main
table still spreads, and a pod reaching its own affinity service through
the second table is masqueraded (hairpin in the main table).

    python bench/affinity_table.py [--size 10000x10] [--reps 25] [--traffic]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import benchlib as bl

BENCH = "affinity_table"
MAIN = "nftproxy"
AFF = "nftproxy-affinity"


# --- the move ------------------------------------------------------------------------------


def _affinity_owners(fragments: Mapping[Any, Any]) -> dict[Any, Any]:
    """The ports whose chains use the shared affinity set."""
    return {
        owner: f
        for owner, f in fragments.items()
        if not isinstance(owner, str)
        and any("@affinity" in json.dumps(r.expr) for c in f.chains for r in c.rules)
    }


def _aff_skeleton(skeleton: Any) -> tuple[list[Any], list[Any]]:
    """The second table's own sets and chains, from the product's skeleton."""
    from nftproxy.core.rules import expr
    from nftproxy.core.rules import skeleton as sk
    from nftproxy.core.rules.fragment import BaseHook, Chain, Rule

    wanted = (sk.AFFINITY, sk.SERVICE_IPS, sk.SERVICE_NODEPORTS)
    sets = [s for s in skeleton.sets if s.name in wanted]
    chains = {c.name: c for c in skeleton.chains}
    nodeport_rule = chains[sk.SERVICES].rules[-1]  # "<node port address> goto KUBE-NODEPORTS"
    nodeport_match = tuple(e for e in nodeport_rule.expr if "goto" not in e)
    services = Chain(
        sk.SERVICES,
        (
            Rule((expr.vmap(expr.concat_daddr_proto_dport(skeleton.family), sk.SERVICE_IPS),)),
            Rule((*nodeport_match, expr.vmap(expr.concat_proto_dport(), sk.SERVICE_NODEPORTS))),
        ),
    )
    base = [
        Chain(name, (Rule((expr.jump(sk.SERVICES),)),), BaseHook("nat", hook, -99))
        for name, hook in (("nat-prerouting", "prerouting"), ("nat-output", "output"))
    ]
    return sets, [chains[sk.MARK_MASQ], services, *base]


def move_affinity(backend: Any, proxier: Any) -> dict[str, Any]:
    """One transaction: every affinity port's chains and dispatch gotos into
    the affinity table; `accept` for their keys in the main table."""
    from nftproxy.core.model import IPFamily
    from nftproxy.core.nft.ops import Table
    from nftproxy.core.nft.plan import SKELETON
    from nftproxy.core.rules.fragment import Element, Verdict

    fragments = proxier._render(proxier._snapshot(force_full=True))[IPFamily.IPV4].desired()
    owners = _affinity_owners(fragments)
    typeof = backend.accepts_typeof()
    main, aff = Table("ip", MAIN, typeof), Table("ip", AFF, typeof)
    sets, own_chains = _aff_skeleton(fragments[SKELETON])
    moved_chains = [c for f in owners.values() for c in f.chains]
    names = {c.name for c in moved_chains}
    moved = [
        e
        for f in owners.values()
        for e in f.elements
        if isinstance(e.value, Verdict) and e.value.target in names
    ]
    backend.declare([aff.declare_text(s) for s in sets if aff.declares_in_text(s)])
    cmds: list[Any] = [aff.add_table()]
    cmds += [aff.add_set(s) for s in sets if not aff.declares_in_text(s)]
    cmds += [aff.add_chain(c) for c in [*own_chains, *moved_chains]]
    for c in [*own_chains, *moved_chains]:
        cmds += aff.add_rules(c)
    by_set: dict[str, list[Any]] = {}
    for e in moved:
        by_set.setdefault(e.set_name, []).append(e)
    for name, elems in by_set.items():
        cmds += aff.add_elements(name, elems)
        cmds += main.delete_elements(name, elems)
        cmds += main.add_elements(
            name, [Element(name, e.key, Verdict("accept"), e.comment) for e in elems]
        )
    cmds += [main.flush_chain(c.name) for c in moved_chains]
    cmds += [main.delete_chain(c.name) for c in moved_chains]
    backend.commit(cmds)
    return {
        "moved_ports": len(owners),
        "moved_chains": len(moved_chains),
        "moved_rules": sum(len(c.rules) for c in moved_chains),
        "moved_elements": {k: len(v) for k, v in by_set.items()},
        "some_chain": sorted(c.name for c in moved_chains if c.name.startswith("KUBE-SVC-"))[0],
    }


# --- the cycle -----------------------------------------------------------------------------


def _goto_p50(backend: Any, table: str, target: str, reps: int) -> float:
    key = {"concat": ["10.254.0.1", "tcp", 9]}
    elem = {"family": "ip", "table": table, "name": "service-ips"}
    add = [{"add": {"element": {**elem, "elem": [[key, {"goto": {"target": target}}]]}}}]
    delete = [{"delete": {"element": {**elem, "elem": [key]}}}]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        backend.commit(add)
        times.append(time.perf_counter() - t0)
        backend.commit(delete)
    return bl.summary(times, 1000)["p50"]


def _cycles(proxier: Any, shape: bl.ClusterShape, avoid: set[int], reps: int) -> dict[str, Any]:
    """add (a plain ClusterIP of E endpoints) / change (an endpoint of a port
    without affinity) / delete, R times; per step the sync's p50/p99."""
    rng = random.Random(1)
    added = bl.ClusterShape(shape.services, shape.endpoints, mix=False)
    generation: dict[int, int] = {}
    walls: dict[str, list[float]] = {"add": [], "change": [], "delete": []}
    ops: dict[str, int] = {}

    def step(kind: str) -> None:
        t0 = time.perf_counter()
        r = proxier.sync()
        walls[kind].append(time.perf_counter() - t0)
        ops[kind] = r.ops

    for rep in range(reps + 2):
        name = f"bench-add-{rep}"
        svc = bl.service_obj(shape.services + rep, added, name=name)
        eps = bl.slice_obj(shape.services + rep, added, name=name)
        proxier.on_service(None, svc)
        proxier.on_endpoint_slice(None, eps)
        step("add")
        i = rng.choice([k for k in range(shape.services) if k not in avoid][:2000])
        j = bl.changed_endpoint(shape)
        g = generation.get(i, 0)
        old = bl.slice_obj(i, shape, generations={j: g} if g else None)
        generation[i] = g + 1
        proxier.on_endpoint_slice(old, bl.slice_obj(i, shape, generations={j: g + 1}))
        step("change")
        proxier.on_service(svc, None)
        proxier.on_endpoint_slice(eps, None)
        step("delete")
    return {
        k: {**bl.summary(v[2:], 1000), "ops": ops[k]} for k, v in walls.items()
    }  # the first two cycles warm up


def _affinity_indices(shape: bl.ClusterShape) -> set[int]:
    return {
        i
        for i in range(shape.services)
        if bl.service_obj(i, shape)["spec"].get("sessionAffinity") == "ClientIP"
    }


def run_variant(variant: str, shape: bl.ClusterShape, reps: int) -> dict[str, Any]:
    from nftproxy.kernel.libnftables import NftBackend

    services, slices = bl.make_cluster(shape)
    with bl.bench_netns("afft") as ns, NftBackend(netns=ns) as backend:
        proxier = bl.make_proxier(backend)
        bl.feed(proxier, services, slices)
        del services, slices
        proxier.sync()
        moved: dict[str, Any] = {}
        if variant == "afftable":
            t0 = time.perf_counter()
            moved = move_affinity(backend, proxier)
            moved["move_s"] = round(time.perf_counter() - t0, 2)
        bl.wait_quiet()
        noise = bl.Noise()
        steps = _cycles(proxier, shape, _affinity_indices(shape), reps)
        target = "dispatch-tcp-" + proxier.table_state(_ipv4()).generation + "-10"
        steps["goto_main"] = {"p50": _goto_p50(backend, MAIN, target, reps)}
        if moved:
            steps["goto_aff"] = {"p50": _goto_p50(backend, AFF, moved["some_chain"], reps)}
        return {"steps": steps, "moved": moved, "foreign_cpu": noise.foreign()}


def _ipv4() -> Any:
    from nftproxy.core.model import IPFamily

    return IPFamily.IPV4


# --- traffic -------------------------------------------------------------------------------


def check_traffic() -> dict[str, Any]:
    """The afftable shape by traffic on a sandbox node (IPv4)."""
    from affinity_table_traffic import run

    return run(move_affinity)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="10000x10")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds of both variants")
    ap.add_argument("--traffic", action="store_true", help="check the afftable shape by traffic")
    args = ap.parse_args(argv)
    bl.require_root()
    lib = bl.machine_info().get("libnftables1", "?")
    if args.traffic:
        bl.emit(BENCH, "traffic", libnftables=lib, **check_traffic())
    shape = bl.parse_shape(args.size)
    for rnd in range(args.rounds):
        for variant in ("product", "afftable"):
            out = run_variant(variant, shape, args.reps)
            bl.emit(BENCH, f"{variant}/{shape.label}", round=rnd, libnftables=lib, **out)
            s = out["steps"]
            bl.progress(
                f"{lib} {variant:8} {shape.label} add p50 {s['add']['p50']:.1f} p99 "
                f"{s['add']['p99']:.1f} | change {s['change']['p50']:.1f} | delete "
                f"{s['delete']['p50']:.1f} | goto main {s['goto_main']['p50']:.2f}"
                + (f" aff {s['goto_aff']['p50']:.2f}" if "goto_aff" in s else "")
                + f" ms {out['moved']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
