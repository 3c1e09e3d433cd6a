"""The Grafana dashboard (deploy/grafana/nftproxy.json) against a real scrape.

A running agent -- the real Agent, its KubeSource watching the fake API
server (tests/fakeapi.py, the real protocol), FakeBackend and FakeConntrack
for the kernel, /metrics and /healthz on loopback -- is scraped over HTTP
after it synced a cluster holding a UDP service (conntrack cleanup) and a
Service with an invalid port (the invalid-field counter), and after its
health endpoints answered once.

Aspects: every metric name any dashboard query references is in that
scrape (histograms through their _bucket/_count samples); the dashboard has
the panels an operator needs (sync duration and rate, programming latency,
rules/elements, partial vs full, commit failures, conntrack cleanup,
invalid objects, API watch health); it is well-formed Grafana JSON (unique
ids, non-overlapping grid, every query on the $datasource variable and
filtered by $instance); docs/metrics.md names every metric the agent
exports.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fakeapi import FakeApiServer
from k8s import endpoint_slice, node, service
from prometheus_client.parser import text_string_to_metric_families

from nftproxy.agent.agent import Agent, Source
from nftproxy.cluster.events import ClusterEvents
from nftproxy.cluster.kube import KubeSource
from nftproxy.core.config import ProxyConfig
from nftproxy.kernel.fake import FakeBackend
from nftproxy.kernel.fake_conntrack import FakeConntrack

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "nftproxy.json"
METRICS_DOC = ROOT / "docs" / "metrics.md"
NODE = "node-a"
METRIC_NAME = re.compile(r"\b((?:kubeproxy|nftproxy|process)_[a-z0-9_]+)\b")


def get(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())
    except urllib.error.HTTPError as err:  # a 503 from /healthz is an answer too
        return str(err.read().decode())


@pytest.fixture(scope="module")
def scrape() -> Iterator[str]:
    """/metrics of an agent that synced, cleaned conntrack and answered probes."""
    config = ProxyConfig(
        node_name=NODE,
        cluster_cidrs=("10.244.0.0/16",),
        healthz_bind_address="127.0.0.1:0",
        metrics_bind_address="127.0.0.1:0",
        min_sync_period=0.0,
        sync_period=30.0,
    )
    with FakeApiServer() as api:
        api.create(node(NODE, ["192.168.50.1"]))
        api.create(service("dns", "10.96.0.10", ports=(("dns", 53, "UDP"),)))
        api.create(endpoint_slice("dns", [("10.244.0.11", NODE)], ports=(("dns", 53, "UDP"),)))
        api.create(service("bad", "10.96.0.11", ports=(("http", 70000, "TCP"), ("ok", 80, "TCP"))))
        client = api.api_client()

        def source_factory(handler: ClusterEvents) -> Source:
            return KubeSource(client, handler, node_name=NODE,
                              backoff_initial=0.05, backoff_max=0.2)

        agent = Agent(config, backend=FakeBackend(), source_factory=source_factory,
                      conntrack=FakeConntrack())
        try:
            agent.start()
            assert agent.synced.wait(30), "the agent did not sync"
            assert agent.healthz is not None
            host, port = agent.healthz.address
            health = f"http://{host}:{port}"
            get(f"{health}/healthz")
            get(f"{health}/livez")
            host, port = agent.metrics.address
            url = f"http://{host}:{port}/metrics"
            deadline = time.monotonic() + 10
            text = get(url)
            while "nftproxy_api_synced" not in text and time.monotonic() < deadline:
                time.sleep(0.05)
                text = get(url)
            yield text
        finally:
            agent.stop()


def dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def queries() -> list[str]:
    return [t["expr"] for p in panels() for t in p["targets"]]


def exported_names(text: str) -> set[str]:
    """Every sample name, and the names of labelled counters and gauges that
    have no child yet (declared: HELP and TYPE, no sample until an event)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names |= {s.name for s in family.samples}
        if not family.samples and family.type in ("counter", "gauge"):
            names.add(family.name + ("_total" if family.type == "counter" else ""))
    return names


def test_every_metric_the_dashboard_queries_is_exported(scrape: str) -> None:
    referenced = {name for expr in queries() for name in METRIC_NAME.findall(expr)}
    assert len(referenced) >= 20
    missing = sorted(referenced - exported_names(scrape))
    assert missing == [], f"queried by the dashboard but not exported: {missing}"


def test_the_scrape_has_the_api_watch_metrics_per_resource(scrape: str) -> None:
    synced = {
        s.labels["resource"]: s.value
        for f in text_string_to_metric_families(scrape)
        for s in f.samples
        if s.name == "nftproxy_api_synced"
    }
    assert synced.get("services") == 1.0 and synced.get("endpointslices") == 1.0, synced


@pytest.mark.parametrize(
    "needed",
    [
        "kubeproxy_sync_proxy_rules_duration_seconds_bucket",  # sync duration
        "kubeproxy_sync_partial_proxy_rules_duration_seconds_count",  # rate, partial vs full
        "kubeproxy_sync_full_proxy_rules_duration_seconds_count",
        "kubeproxy_network_programming_duration_seconds_bucket",
        "nftproxy_programmed_rules",
        "nftproxy_programmed_elements",
        "kubeproxy_sync_proxy_rules_nftables_sync_failures_total",
        "kubeproxy_conntrack_reconciler_deleted_entries_total",
        "nftproxy_invalid_fields_total",
        "nftproxy_api_synced",  # API watch health
        "nftproxy_api_errors_total",
    ],
)
def test_the_dashboard_shows_what_an_operator_needs(needed: str) -> None:
    assert any(needed in expr for expr in queries()), needed


def test_the_dashboard_is_well_formed_grafana_json() -> None:
    doc = dashboard()
    assert doc["uid"] == "nftproxy" and doc["schemaVersion"] >= 36
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["datasource"]["uid"] == "${datasource}"
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in doc["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        xs, ys = range(g["x"], g["x"] + g["w"]), range(g["y"], g["y"] + g["h"])
        area = {(x, y) for x in xs for y in ys}
        assert not area & cells, f"panel {p['title']!r} overlaps another"
        cells |= area
    for p in panels():
        assert p["title"] and p["description"] and p["targets"]
        for target in p["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            assert 'instance=~"$instance"' in target["expr"], target["expr"]


def test_metrics_doc_names_every_exported_metric(scrape: str) -> None:
    doc = METRICS_DOC.read_text()
    exported = {  # counters' families drop "_total"; "_created" are prometheus_client's
        f.name for f in text_string_to_metric_families(scrape)
        if f.name.startswith(("kubeproxy_", "nftproxy_")) and not f.name.endswith("_created")
    }
    assert len(exported) >= 25
    missing = sorted(name for name in exported if f"`{name}" not in doc)
    assert missing == [], f"exported but not in docs/metrics.md: {missing}"
