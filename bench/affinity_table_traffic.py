"""The `afftable` shape of bench/affinity_table.py, checked by traffic (experiment).

Layer: bench tooling. One job: on a sandbox node (tools/sandbox; the
dataplane suite's harness, tests/test_dataplane.py), program a ClientIP
ClusterIP, a ClientIP NodePort and a plain ClusterIP (IPv4, TCP) with the
real Proxier, move the affinity ports to their own table with `move`, and
check: each of 20 clients sticks to one endpoint of each affinity port and
they spread over the endpoints; the plain service still spreads; a pod that
its own affinity service (one endpoint: itself) sends back to itself
is masqueraded (the main
table's hairpin); the affinity table holds the ports' chains and the main
table only an `accept` for their keys.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import benchlib  # noqa: F401  (puts tests/ on sys.path)
from test_dataplane import (
    AFFINITY_V4,
    NODE_PORTS,
    Cluster,
    Net,
    slices,
    svc,
)

from nftproxy.kernel.libnftables import NftBackend
from nftproxy.tools.sandbox.probe import Attempt
from nftproxy.tools.sandbox.topology import Spec, build, default_pods


def _sticky(attempts: Sequence[Attempt]) -> dict[str | None, str]:
    by_src: dict[str | None, Counter[str]] = {}
    for a in attempts:
        assert a.ok, f"failed: {a}"
        by_src.setdefault(a.src, Counter())[a.pod or "?"] += 1
    for src, counts in by_src.items():
        assert len(counts) == 1, f"source {src} not sticky: {counts}"
    return {src: next(iter(c)) for src, c in by_src.items()}


def run(move: Callable[[Any, Any], dict[str, Any]]) -> dict[str, Any]:
    net = Net(4)
    spec = Spec(default_pods(local=3, remote=0), client_ipv4=("192.168.50.2", *AFFINITY_V4))
    with contextlib.ExitStack() as stack:
        topo = stack.enter_context(build(spec))
        backend = stack.enter_context(NftBackend(netns=topo.node))
        pods = [topo.pods[p] for p in ("local1", "local2", "local3")]
        cluster = Cluster(backend)
        cluster.apply(
            svc("sticky", 50, families=(4,), affinity_timeout=600),
            slices("sticky", pods, families=(4,)),
            svc(
                "sticky-np",
                52,
                families=(4,),
                affinity_timeout=600,
                type="NodePort",
                node_ports=[NODE_PORTS["tcp"], NODE_PORTS["udp"]],
            ),
            slices("sticky-np", pods, families=(4,)),
            svc("sticky-self", 53, families=(4,), affinity_timeout=600),
            slices("sticky-self", pods[:1], families=(4,)),
            svc("plain", 51, families=(4,)),
            slices("plain", pods, families=(4,)),
        ).sync()
        moved = move(backend, cluster.proxier)
        aff = {"family": "ip", "name": "nftproxy-affinity"}
        listed = backend.run_json({"list": {"table": aff}})
        aff_chains = sorted(o["chain"]["name"] for o in listed["nftables"] if "chain" in o)
        out: dict[str, Any] = {"moved": moved, "affinity_table_chains": aff_chains}
        targets = (("clusterip", (net.vip(50), 80)), ("nodeport", (net.node_ip, NODE_PORTS["tcp"])))
        for name, target in targets:
            tries = topo.probe("client", "tcp", target[0], target[1], count=3, src=AFFINITY_V4)
            choice = _sticky(tries)
            spread = Counter(choice.values())
            assert len(spread) >= 2, f"{name}: 20 clients on one endpoint: {spread}"
            out[f"{name}_sticky_clients"] = len(choice)
            out[f"{name}_spread"] = dict(spread)
        plain = topo.probe("client", "tcp", net.vip(51), 80, count=60, src="192.168.50.2")
        assert all(a.ok for a in plain), plain
        out["plain_spread"] = dict(Counter(a.pod for a in plain))
        assert len(out["plain_spread"]) == 3, out["plain_spread"]
        hairpin = topo.probe("local1", "tcp", net.vip(53), 80, count=5)
        assert all(a.ok and a.pod == "local1" for a in hairpin), hairpin
        own = {a.peer for a in hairpin}
        out["hairpin_peers"] = sorted(str(p) for p in own)
        assert own == {topo.pods["local1"].gateway(4)}, f"hairpin not masqueraded: {own}"
        return out
