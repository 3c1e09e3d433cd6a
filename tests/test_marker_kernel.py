"""The kube-proxy marker on the real kernel: peers see an nftables proxy, and
kube-proxy's own tables and commands are never in its way.

Aspects, each in a namespace of its own:
- Calico Felix's `nftablesMode: Auto` rule, applied as calico#11629 states
  it (knftables' List("chains") of `ip kube-proxy`, then of `ip6
  kube-proxy`: `nft --json list chains <family>`, the chains whose table is
  `kube-proxy`; one or more means nftables) answers nftables on a node
  `nftproxy sync` programmed, iptables with `--kube-proxy-marker=false`,
  and iptables again after `nftproxy cleanup`;
- a kube-proxy table (its comment, base chains, chains, a map) is the same
  byte for byte after `sync` and `cleanup`, which say so;
- the agent, started next to kube-proxy's tables, leaves them; after
  `kube-proxy --cleanup` deleted them it writes its marker at the next
  full sync (the drift check), and again after the marker itself was
  deleted, and its own marker commits are never counted as drift;
- nftproxy -> kube-proxy: `kube-proxy --cleanup` over the marker succeeds;
  so does kube-proxy's first sync (its transaction as knftables writes it),
  after which `nftproxy cleanup` takes the marker chain alone and leaves
  kube-proxy's chains, which `kube-proxy --cleanup` then deletes;
- deploy/cleanup-kube-proxy.sh keeps the marker, and deletes a marker table
  kube-proxy has written into.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import kernel
from prometheus_client import CollectorRegistry

from nftproxy.agent.agent import Agent
from nftproxy.cluster.events import ClusterEvents
from nftproxy.cluster.file import FileSource, WatchedFiles
from nftproxy.core.config import ProxyConfig
from nftproxy.core.nft.marker import KUBE_PROXY_COMMENT, MARKER_CHAIN
from nftproxy.core.nft.ownership import TABLE_MARK
from nftproxy.kernel import netns as nsutil
from nftproxy.kernel.libnftables import NftBackend

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = str(ROOT / "nftproxy" / "examples" / "cluster.yaml")
CLEANUP_SCRIPT = ROOT / "deploy" / "cleanup-kube-proxy.sh"
NFTPROXY = [sys.executable, "-m", "nftproxy"]
FAMILIES = ("ip", "ip6")


def felix_auto(ns: str) -> str:
    """What Felix's nftablesMode Auto picks on this node (calico#11629,
    KubeProxyNftablesEnabledFn): IPv4 first, then IPv6."""
    for family in FAMILIES:
        doc = json.loads(kernel.nft(ns, "--json", "list", "chains", family))
        chains = [o["chain"]["name"] for o in doc["nftables"]
                  if "chain" in o and o["chain"]["table"] == "kube-proxy"]
        if len(chains) > 0:
            return "nftables"
    return "iptables"


def nftproxy(ns: str, *args: str) -> str:
    """`nftproxy args...` in `ns`, which must succeed; its stderr."""
    proc = nsutil.exec_in(ns, [*NFTPROXY, *args], check=False, timeout=60)
    assert proc.returncode == 0, proc.stderr
    err: str = proc.stderr
    return err


def tables(ns: str) -> list[str]:
    return [line.removeprefix("table ") for line in kernel.nft(ns, "list", "tables").splitlines()]


def kube_proxy_start(family: str) -> str:
    """kube-proxy's first sync (trimmed), as knftables writes it."""
    ip, addr = ("ip", "ipv4_addr") if family == "ip" else ("ip6", "ipv6_addr")
    t = f"{family} kube-proxy"
    lines = [f'add table {t} {{ comment "{KUBE_PROXY_COMMENT}" ; }}']
    base = {"filter-prerouting": "type filter hook prerouting priority -110",
            "nat-prerouting": "type nat hook prerouting priority -100",
            "nat-output": "type nat hook output priority -100"}
    for name in base:  # once at start: every base chain re-created
        lines += [f"add chain {t} {name}", f"delete chain {t} {name}"]
    for name, spec in base.items():
        lines += [f"add chain {t} {name} {{ {spec} ; }}", f"flush chain {t} {name}"]
    for name in ("services", "mark-for-masquerade", "masquerading"):
        lines += [f"add chain {t} {name}", f"flush chain {t} {name}"]
    lines += [
        f"add rule {t} nat-prerouting jump services",
        f"add rule {t} nat-output jump services",
        f'add set {t} cluster-ips {{ type {addr} ; comment "Active ClusterIPs" ; }}',
        f"add map {t} service-ips {{ type {addr} . inet_proto . inet_service : verdict ; "
        'comment "ClusterIP, ExternalIP and LoadBalancer IP traffic" ; }',
        f"flush set {t} cluster-ips",
        f"flush map {t} service-ips",
        f"add rule {t} services {ip} daddr . meta l4proto . th dport vmap @service-ips",
        f"add rule {t} mark-for-masquerade mark set mark or 0x4000",
    ]
    return "\n".join(lines) + "\n"


def kube_proxy_cleanup(ns: str) -> None:
    """`kube-proxy --cleanup`'s nftables part (CleanupLeftovers): delete
    `ip kube-proxy`, then `ip6 kube-proxy`, each in its own transaction."""
    for family in FAMILIES:
        kernel.nft(ns, "delete", "table", family, "kube-proxy")


def marker_chains(ns: str, family: str) -> list[str]:
    doc = json.loads(kernel.nft(ns, "--json", "list", "chains", family))
    return sorted(o["chain"]["name"] for o in doc["nftables"]
                  if "chain" in o and o["chain"]["table"] == "kube-proxy")


def test_felix_auto_answers_nftables_on_an_nftproxy_node(netns: str) -> None:
    assert felix_auto(netns) == "iptables", "an empty node: no kube-proxy table"
    nftproxy(netns, "sync", "--source", SAMPLE, "--kube-proxy-marker=false")
    assert "ip nftproxy" in tables(netns)
    assert felix_auto(netns) == "iptables", "the marker turned off: nftproxy's own tables only"

    nftproxy(netns, "sync", "--source", SAMPLE)
    assert felix_auto(netns) == "nftables"
    for family in FAMILIES:
        listing = kernel.nft(netns, "list", "table", family, "kube-proxy")
        assert f'comment "{TABLE_MARK}"' in listing
        doc = json.loads(kernel.nft(netns, "--json", "list", "table", family, "kube-proxy"))
        objects = [next(iter(o)) for o in doc["nftables"] if "metainfo" not in o]
        assert objects == ["table", "chain"], "one chain: no rule, set or map"
        chain = doc["nftables"][-1]["chain"]
        assert chain["name"] == MARKER_CHAIN and "hook" not in chain

    err = nftproxy(netns, "cleanup")
    assert "deleted table ip kube-proxy (nftproxy's marker)" in err
    assert felix_auto(netns) == "iptables"
    assert tables(netns) == []


def test_a_kube_proxy_table_is_never_touched(netns: str) -> None:
    for family in FAMILIES:
        kernel.nft(netns, "-f", "-", stdin=kube_proxy_start(family))
    before = {f: kernel.nft(netns, "list", "table", f, "kube-proxy") for f in FAMILIES}
    assert all(f'comment "{KUBE_PROXY_COMMENT}"' in text for text in before.values())

    err = nftproxy(netns, "sync", "--source", SAMPLE)
    assert err.count("left untouched") == 2, err
    err = nftproxy(netns, "cleanup")
    assert "left table ip kube-proxy: not nftproxy's" in err
    assert {f: kernel.nft(netns, "list", "table", f, "kube-proxy") for f in FAMILIES} == before
    assert sorted(tables(netns)) == ["ip kube-proxy", "ip6 kube-proxy"]


@contextmanager
def agent(ns: str) -> Iterator[Agent]:
    """`nftproxy run` in `ns`, as the CLI wires it, with a 1 s syncPeriod
    (drift checked each second)."""

    def source_factory(handler: ClusterEvents) -> WatchedFiles:
        return WatchedFiles(FileSource([SAMPLE], handler, node_name="demo-node",
                                       poll_interval=0.05))

    config = ProxyConfig(node_name="demo-node", sync_period=1.0, min_sync_period=0.1,
                         healthz_bind_address="", metrics_bind_address="")
    backend = NftBackend(netns=ns)
    built = Agent(config, backend=backend, marker=backend, source_factory=source_factory,
                  registry=CollectorRegistry())
    try:
        built.start()
        assert built.synced.wait(30), "the agent never synced"
        yield built
    finally:
        built.stop()


def repairs(built: Agent) -> float:
    value = built.metrics.registry.get_sample_value(
        "nftproxy_drift_repairs_total", {"reason": "foreign_commit"})
    return 0.0 if value is None else value


def wait_for(check: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f}s"
        time.sleep(0.05)


def test_the_agent_takes_kube_proxys_place_only_once_it_is_gone(netns: str) -> None:
    """kube-proxy -> nftproxy, then the marker deleted under the agent."""
    for family in FAMILIES:
        kernel.nft(netns, "-f", "-", stdin=kube_proxy_start(family))
    before = {f: kernel.nft(netns, "list", "table", f, "kube-proxy") for f in FAMILIES}
    with agent(netns) as running:
        assert {f: kernel.nft(netns, "list", "table", f, "kube-proxy") for f in FAMILIES} \
            == before
        kube_proxy_cleanup(netns)
        assert felix_auto(netns) == "iptables"
        wait_for(lambda: felix_auto(netns) == "nftables", "the marker after kube-proxy's cleanup")
        wait_for(lambda: all(marker_chains(netns, f) == [MARKER_CHAIN] for f in FAMILIES),
                 "both families' marker")
        settled = repairs(running)
        time.sleep(2.5)  # two more drift checks: the marker's own commit is not drift
        assert repairs(running) == settled

        kernel.nft(netns, "delete", "table", "ip6", "kube-proxy")
        wait_for(lambda: marker_chains(netns, "ip6") == [MARKER_CHAIN], "the marker again")
        assert repairs(running) == settled + 1


def test_kube_proxy_starts_and_cleans_up_over_the_marker(netns: str) -> None:
    """nftproxy -> kube-proxy, both orders of its commands."""
    nftproxy(netns, "sync", "--source", SAMPLE)
    kube_proxy_cleanup(netns)  # `kube-proxy --cleanup` over the marker alone
    assert felix_auto(netns) == "iptables"

    nftproxy(netns, "sync", "--source", SAMPLE)
    for family in FAMILIES:  # kube-proxy starts over the marker
        kernel.nft(netns, "-f", "-", stdin=kube_proxy_start(family))
        assert marker_chains(netns, family) == sorted([
            MARKER_CHAIN, "filter-prerouting", "mark-for-masquerade", "masquerading",
            "nat-output", "nat-prerouting", "services"])
    err = nftproxy(netns, "cleanup")
    assert "kept table ip kube-proxy: kube-proxy's rules are in it now" in err
    for family in FAMILIES:
        assert MARKER_CHAIN not in marker_chains(netns, family)
        assert "services" in marker_chains(netns, family)
        assert "cluster-ips" in kernel.nft(netns, "list", "table", family, "kube-proxy")
    assert sorted(tables(netns)) == ["ip kube-proxy", "ip6 kube-proxy"]
    kube_proxy_cleanup(netns)
    assert tables(netns) == []


def test_the_cleanup_script_keeps_the_marker(netns: str) -> None:
    nftproxy(netns, "sync", "--source", SAMPLE)
    kernel.nft(netns, "-f", "-", stdin=kube_proxy_start("ip6"))  # ip6: kube-proxy wrote in
    out = nsutil.exec_in(netns, ["bash", str(CLEANUP_SCRIPT)]).stdout
    assert "# table ip kube-proxy is nftproxy's marker: kept" in out
    assert "nft delete table ip6 kube-proxy" in out
    assert marker_chains(netns, "ip") == [MARKER_CHAIN]
    assert "ip6 kube-proxy" not in tables(netns)
