"""`nftproxy dump` reads what is programmed, with no nftproxy process running.

Aspects: per service port its VIPs, node port, policies, affinity, source
ranges and endpoints with their KUBE-SEP chain and cascade probability;
--service filters; --json is machine-readable; a missing table is a clear
message; `cleanup` deletes only nftproxy's tables.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import kernel

from nftproxy.kernel import netns as nsutil
from nftproxy.tools.dump import parse_table, render_text

SAMPLE = str(Path(__file__).resolve().parent.parent / "nftproxy" / "examples" / "cluster.yaml")
NFTPROXY = [sys.executable, "-m", "nftproxy"]


def _run(ns: str, *args: str) -> subprocess.CompletedProcess[str]:
    return nsutil.exec_in(ns, [*NFTPROXY, *args], check=False)


def _programmed(ns: str) -> None:
    proc = _run(ns, "sync", "--once", "--source", SAMPLE)
    assert proc.returncode == 0, proc.stderr


def test_dump_shows_each_service_port(netns: str) -> None:
    _programmed(netns)
    proc = _run(netns, "dump", "--json")
    assert proc.returncode == 0, proc.stderr
    views = {v["family"]: v for v in json.loads(proc.stdout)}
    services = {s["service"]: s for s in views["ip"]["services"]}

    web = services["demo/web:http"]
    assert web["vips"] == ["10.96.0.10:80"]
    # one endpoint of web is serving+terminating: only the two ready ones serve
    assert sorted(e["address"] for e in web["endpoints"]) == [
        "10.244.0.11:8080",
        "10.244.1.13:8080",
    ]
    assert [e["probability"] for e in web["endpoints"]] == [0.5, 0.5]
    assert all(e["chain"].startswith("KUBE-SEP-") for e in web["endpoints"])

    sticky = services["demo/sticky:http"]
    assert sticky["affinity_timeout"] == 600
    assert [e["probability"] for e in sticky["endpoints"]] == [0.3333] * 3

    local = services["demo/web-local:http"]
    assert local["policies"]["externalTrafficPolicy"] == "Local"
    assert local["node_port"] == 30081
    assert local["source_ranges"] == ["192.168.50.2"]
    assert [e["address"] for e in local["local_endpoints"]] == ["10.244.0.11:8080"]

    empty = services["demo/empty:http"]
    assert empty["no_endpoints"] == ["10.96.0.99:80 -> goto KUBE-REJECT"]
    assert empty["endpoints"] == []

    assert {s["service"] for s in views["ip6"]["services"]} >= {"demo/web:http"}


def test_dump_filters_by_service_and_prints_text(netns: str) -> None:
    _programmed(netns)
    proc = _run(netns, "dump", "--service", "demo/sticky")
    assert proc.returncode == 0, proc.stderr
    assert "demo/sticky:http" in proc.stdout
    assert "demo/web:http" not in proc.stdout
    assert "sessionAffinity: ClientIP, timeout 600s" in proc.stdout
    assert "33.33%" in proc.stdout


def test_dump_without_a_table_says_so(netns: str) -> None:
    proc = _run(netns, "dump")
    assert proc.returncode == 1
    assert "no table named 'nftproxy'" in proc.stderr


def test_cleanup_deletes_only_our_tables(netns: str) -> None:
    kernel.nft(netns, "add", "table", "ip", "other")
    _programmed(netns)
    proc = _run(netns, "cleanup")
    assert proc.returncode == 0, proc.stderr
    tables = kernel.nft(netns, "list", "tables")
    assert tables.split() == ["table", "ip", "other"]


def test_render_text_of_a_listing_without_services() -> None:
    doc = {
        "nftables": [
            {"table": {"family": "ip", "name": "t"}},
            {"chain": {"family": "ip", "table": "t", "name": "KUBE-SERVICES"}},
        ]
    }
    view = parse_table(doc, family="ip", table="t")
    assert view.services == [] and view.chains == 1
    assert render_text(view).startswith("table ip t: 1 chains, 0 rules")
