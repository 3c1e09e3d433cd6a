"""Where the kernel's validation of one shared-element add goes (experiment).

Layer: bench tooling. One job: load the product's table (10,000 x 10 by
default) in a throwaway namespace, time the add (and removal) of one
`service-ips` element -> dispatch-tcp-10, then change the table step by
step and time it again after each step:

1. `inline_mark`: every shared chooser's `jump KUBE-MARK-MASQ` becomes the
   mark it sets, inline (no jump to follow);
2. `no_affinity_ports`: every map element that goes to an affinity port's
   chain (or to a chain that jumps to one) is deleted (a no-op since
   ruleset v9: those chains are the affinity table's, which this commit does
   not make the kernel validate; the fifteenth pass measured it before);
3. `no_chain_ports`: every `service-ips` / `service-nodeports` /
   `firewall-ips` element that goes to a port's own chain (affinity,
   > 64 endpoints; eTP=Local before ruleset v8) is deleted, so those
   chains are unreachable;
4. `few_elements`: all but 100 of the remaining `service-ips` elements are
   deleted.

    python bench/probes/validation_split.py [--size 10000x10] [--reps 25]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: benchlib
import benchlib as bl

BENCH = "validation_split"
T = {"family": "ip", "table": "nftproxy"}


def _p50(backend: Any, reps: int) -> float:
    key = {"concat": ["10.254.0.1", "tcp", 9]}
    elem = {**T, "name": "service-ips", "elem": [[key, {"goto": {"target": "dispatch-tcp-10"}}]]}
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        bl.raw(backend, [{"add": {"element": elem}}])
        times.append(time.perf_counter() - t0)
        bl.raw(backend, [{"delete": {"element": {**elem, "elem": [key]}}}])
    return bl.summary(times, 1000)["p50"]


def _listed(backend: Any, kind: str, name: str) -> list[Any]:
    out = backend.run_json({"list": {kind: {**T, "name": name}}})
    return [o for o in out["nftables"] if "rule" in o or kind in o]


def _table_rules(backend: Any) -> list[Any]:
    """Every rule of the ip table, listed once (1.0.6 dumps its whole cache
    for each list command: one per chain took minutes at 10k x 10)."""
    out = backend.run_json({"list": {"table": {"family": "ip", "name": "nftproxy"}}})
    return [o["rule"] for o in out["nftables"] if "rule" in o]


def _inline_mark(backend: Any) -> None:
    mark = {
        "mangle": {
            "key": {"meta": {"key": "mark"}},
            "value": {"|": [{"meta": {"key": "mark"}}, 0x4000]},
        }
    }
    by_chain: dict[str, list[Any]] = {}
    for r in _table_rules(backend):
        name = r["chain"]
        if name.startswith("dispatch-") and "nodeport" not in name:
            by_chain.setdefault(name, []).append(r)
    cmds = []
    for name, rules in by_chain.items():
        cmds.append({"flush": {"chain": {**T, "name": name}}})
        for r in rules:
            expr = [
                mark if e.get("jump", {}).get("target") == "KUBE-MARK-MASQ" else e
                for e in r["expr"]
            ]
            cmds.append({"add": {"rule": {**T, "chain": name, "expr": expr}}})
    bl.raw(backend, cmds)


def _map_elements(backend: Any, name: str) -> list[Any]:
    out = _listed(backend, "map", name)
    return next(o["map"] for o in out if "map" in o).get("elem", [])


def _affinity_chains(backend: Any) -> set[str]:
    """Chains whose rules use the affinity set, and the chains that jump to them."""
    rules = _table_rules(backend)
    found = {r["chain"] for r in rules if "@affinity" in str(r["expr"])}
    found |= {
        r["chain"]
        for r in rules
        if any(
            str(e.get(k, {}).get("target")) in found
            for e in r["expr"]
            for k in ("jump", "goto")
            if isinstance(e, dict)
        )
    }
    return found


def _delete_affinity_gotos(backend: Any) -> None:
    _delete_gotos(backend, _affinity_chains(backend).__contains__)


def _delete_chain_gotos(backend: Any) -> None:
    from nftproxy.core.rules.skeleton import chain_generation

    _delete_gotos(backend, lambda target: chain_generation(target) is None)


def _delete_gotos(backend: Any, doomed: Any) -> None:
    from nftproxy.core.nft.errors import NftNotFound

    for name in ("service-ips", "service-nodeports", "firewall-ips"):
        try:
            elements = _map_elements(backend, name)
        except NftNotFound:  # not a map of this ruleset
            continue
        own = [e[0] for e in elements if doomed(str(e[1].get("goto", {}).get("target", "")))]
        if own:
            bl.raw(backend, [{"delete": {"element": {**T, "name": name, "elem": own}}}])


def _few_elements(backend: Any) -> None:
    keys = [e[0] for e in _map_elements(backend, "service-ips")][100:]
    bl.raw(backend, [{"delete": {"element": {**T, "name": "service-ips", "elem": keys}}}])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="10000x10")
    ap.add_argument("--reps", type=int, default=25)
    args = ap.parse_args()
    bl.require_root()
    from nftproxy.kernel.libnftables import NftBackend

    shape = bl.parse_shape(args.size)
    services, slices = bl.make_cluster(shape)
    with bl.bench_netns("vsplit") as ns, NftBackend(netns=ns) as backend:
        proxier = bl.make_proxier(backend)
        bl.feed(proxier, services, slices)
        proxier.sync()
        lib = bl.machine_info().get("libnftables1", "?")
        steps = [
            ("product", None),
            ("inline_mark", _inline_mark),
            ("no_affinity_ports", _delete_affinity_gotos),
            ("no_chain_ports", _delete_chain_gotos),
            ("few_elements", _few_elements),
        ]
        for case, change in steps:
            if change is not None:
                change(backend)
            p50 = _p50(backend, args.reps)
            bl.emit(BENCH, f"{shape.label}/{case}", shared_elem_p50_ms=p50, libnftables=lib)
            bl.progress(f"{lib} {shape.label} {case:15} shared_elem p50 {p50:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
