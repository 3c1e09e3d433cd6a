"""What one small commit costs in the product's own table, by kind.

Layer: bench tooling. One job: split a partial sync's commit cost into the
libnftables cache tax and the kernel's table validation. The kernel
re-validates a table's whole chain graph (every base chain, every rule,
every element of a verdict map they reach) when a transaction adds a
rule with a verdict/NAT expression or a goto/jump element; a transaction
of plain set elements (or data-map elements) is not validated. Loads the
product's table (10,000 x 10 by default) in a throwaway namespace, then
times, R times each, transactions that add and remove again:

- `plain_elem`: one element of `hairpin-endpoints` (a plain set);
- `goto_elem`:  one `service-ips` element -> a chain of the main table
                (KUBE-PROBE-SVC, 11 dnat rules, made for the probe: since
                ruleset v9 the ports with chains of their own are in the
                affinity table);
- `chain_rule`: one new chain with one dnat rule (and its deletion);
- `chain_map_rule`: one new chain with the chooser's rule (its last: the
                endpoints-map pick, ruleset v3+);
- `rewrite`:    flush one existing KUBE-SVC chain and add its rules again
                (what "change one endpoint" of an affinity port sends);
- `shared_elem`: one `service-ips` element -> the shared chooser
                dispatch-tcp-10 (ruleset v7);
- `vip_elems`:  its 10 `vip-endpoints-tcp` elements;
- `add_service`: both, with a hairpin element: what adding a ClusterIP
                service of 10 endpoints sends (v7-v9), but its cluster-ips
                element;
- `continue_elem`: one `service-ips` element `continue` (ruleset v10);
- `bits_service`: what v10 sends instead: the vip-endpoints and hairpin
                elements, a `continue` element and four plain elements
                (the pick tree's membership and bits; probe sets here);
- `goto_to_continue`: a `service-ips` goto element (a full sync's) deleted
                and the same key added as `continue`, in one transaction:
                what a partial sync's first change of a shared
                destination sends beside its plain elements (eighteenth
                pass: deleting a goto element is not validated).

    python bench/probes/validation_probe.py [--size 10000x10] [--reps 15] [--no-affinity]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: benchlib
import benchlib as bl

BENCH = "validation_probe"


def _timed(backend: Any, commands: list[dict[str, Any]]) -> float:
    t0 = time.perf_counter()
    bl.raw(backend, commands)
    return time.perf_counter() - t0


def _cases(table: dict[str, str], svc_chain: str, rules: list[Any]) -> dict[str, Any]:
    elem = {
        **table,
        "name": "hairpin-endpoints",
        "elem": [{"concat": ["10.255.0.1", "10.255.0.1"]}],
    }
    key = {"concat": ["10.254.0.1", "tcp", 9]}
    goto = {**table, "name": "service-ips", "elem": [[key, {"goto": {"target": svc_chain}}]]}
    probe = {**table, "name": "KUBE-PROBE"}
    rule = {
        **table,
        "chain": "KUBE-PROBE",
        "expr": [
            {"match": {"op": "==", "left": {"meta": {"key": "l4proto"}}, "right": "tcp"}},
            {"dnat": {"addr": "10.255.0.1", "port": 80}},
        ],
    }
    chain = {**table, "name": svc_chain}
    pick = {**rules[-1], "chain": "KUBE-PROBE"}
    shared = {**goto, "elem": [[key, {"goto": {"target": "dispatch-tcp-10"}}]]}
    targets = [[{"concat": ["10.254.0.1", 9, i]}, {"concat": [f"10.253.0.{i + 1}", 80]}]
               for i in range(10)]
    picked = {**table, "name": "vip-endpoints-tcp", "elem": targets}
    new_service = [{"add": {"element": e}} for e in (picked, elem, shared)]
    cont = {**goto, "elem": [[key, {"continue": None}]]}
    bits = [{**table, "name": f"probe-bits-{i}", "elem": [key]} for i in range(4)]
    bits_service = [{"add": {"element": e}} for e in (picked, elem, cont, *bits)]
    return {
        "plain_elem": ([{"add": {"element": elem}}], [{"delete": {"element": elem}}]),
        "goto_elem": (
            [{"add": {"element": goto}}],
            [{"delete": {"element": {**goto, "elem": [key]}}}],
        ),
        "chain_rule": (
            [{"add": {"chain": probe}}, {"add": {"rule": rule}}],
            [{"flush": {"chain": probe}}, {"delete": {"chain": probe}}],
        ),
        "chain_map_rule": (
            [{"add": {"chain": probe}}, {"add": {"rule": pick}}],
            [{"flush": {"chain": probe}}, {"delete": {"chain": probe}}],
        ),
        "shared_elem": (
            [{"add": {"element": shared}}],
            [{"delete": {"element": {**shared, "elem": [key]}}}],
        ),
        "vip_elems": (
            [{"add": {"element": picked}}],
            [{"delete": {"element": {**picked, "elem": [t[0] for t in targets]}}}],
        ),
        "add_service": (
            new_service,
            [{"delete": c["add"]} for c in reversed(new_service)],
        ),
        "continue_elem": (
            [{"add": {"element": cont}}],
            [{"delete": {"element": {**cont, "elem": [key]}}}],
        ),
        "bits_service": (
            bits_service,
            [{"delete": c["add"]} for c in reversed(bits_service)],
        ),
        "goto_to_continue": (
            [{"delete": {"element": {**shared, "elem": [key]}}}, {"add": {"element": cont}}],
            [{"delete": {"element": {**cont, "elem": [key]}}}, {"add": {"element": shared}}],
        ),
        "rewrite": (
            [{"flush": {"chain": chain}}, *({"add": {"rule": r}} for r in rules)],
            None,
        ),
    }


_PRESENT_BEFORE = {"goto_to_continue"}
"""Cases whose `do` changes an element that is there: the last command of
their `undo` (which adds it back) runs once first."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="10000x10")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--no-affinity", action="store_true", help="the mix without affinity")
    args = ap.parse_args()
    bl.require_root()
    from nftproxy.kernel.libnftables import NftBackend

    n, e = (int(x) for x in args.size.split("x"))
    shape = bl.ClusterShape(n, e, affinity=not args.no_affinity)
    services, slices = bl.make_cluster(shape)
    with bl.bench_netns("valid") as ns, NftBackend(netns=ns) as backend:
        proxier = bl.make_proxier(backend)
        bl.feed(proxier, services, slices)
        proxier.sync()
        table = {"family": "ip", "table": "nftproxy"}
        # a chain of the main table a goto element can name (since ruleset v9
        # the ports with chains of their own are in the affinity table)
        svc_chain = "KUBE-PROBE-SVC"
        rules = [
            {**table, "chain": svc_chain, "expr": [
                {"match": {"op": "==", "left": {"meta": {"key": "l4proto"}}, "right": "tcp"}},
                {"dnat": {"addr": f"10.252.0.{i + 1}", "port": 80}},
            ]}
            for i in range(11)
        ]
        bl.raw(backend, [
            {"add": {"chain": {**table, "name": svc_chain}}},
            *({"add": {"rule": r}} for r in rules),
        ])
        bl.raw(backend, [
            {"add": {"set": {**table, "name": f"probe-bits-{i}",
                             "type": ["ipv4_addr", "inet_proto", "inet_service"]}}}
            for i in range(7)
        ])
        lib = bl.machine_info().get("libnftables1", "?")
        bl.progress(f"{shape.label}: loaded; probing in {svc_chain} ({len(rules)} rules)")
        for case, (do, undo) in _cases(table, svc_chain, rules).items():
            if case in _PRESENT_BEFORE:
                bl.raw(backend, undo[-1:])
            times = []
            for _ in range(args.reps):
                times.append(_timed(backend, do))
                if undo:
                    bl.raw(backend, undo)
            s = bl.summary(times, 1000)
            bl.emit(BENCH, f"{shape.label}/{case}", commit_ms=s, libnftables=lib)
            bl.progress(
                f"{lib} {shape.label} {case:11} p50 {s['p50']:.1f} ms p90 {s['p90']:.1f} ms"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
