"""deploy/components/alerts: every alert, evaluated over scrapes of a real agent.

Prometheus cannot run here, so a tiny evaluator implements exactly the
PromQL shapes the PrometheusRule uses -- `rate|increase(m[d]) > t`,
`histogram_quantile(q, sum by (instance, le) (rate(m_bucket[d]))) > t`,
`time() - m > t`, `up{job=...} == 0`, `absent(up{job=...})` -- and fails on
any other shape. Its input is two scrapes of /metrics, over HTTP, from an
agent with the real Metrics, Intake and Runner (FakeApiServer source,
FakeBackend kernel): one after a good first sync, one after commits were
refused and an invalid Service arrived. Aspects: every metric an alert
names is exported with the type and labels the expression needs; the
failing-sync and invalid-object alerts fire over the second window and not
over a quiet one; the latency and staleness alerts stay quiet on the real
values and fire once the same series cross their thresholds; `up`'s job
selector is the job label prometheus-operator gives the PodMonitor's
targets (`<namespace>/<name>`).
"""

from __future__ import annotations

import math
import re
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from fakeapi import FakeApiServer
from faults import wait_until
from k8s import endpoint_slice, node, service
from prometheus_client.parser import text_string_to_metric_families

from nftproxy.agent.agent import Agent, Source
from nftproxy.cluster.events import ClusterEvents
from nftproxy.cluster.kube import KubeSource
from nftproxy.core.config import ProxyConfig
from nftproxy.core.nft.errors import NftRejected
from nftproxy.kernel.fake import FakeBackend

ROOT = Path(__file__).resolve().parents[1]
RULE = ROOT / "deploy" / "components" / "alerts" / "prometheusrule.yaml"
PODMONITOR = ROOT / "deploy" / "components" / "metrics" / "podmonitor.yaml"
NODE = "node-a"
ALERTS = {
    "NftproxyDown", "NftproxyAbsent", "NftproxySyncFailing", "NftproxySyncLatencyHigh",
    "NftproxySyncStale", "NftproxyInvalidObjects",
}


def alerts() -> dict[str, str]:
    doc = yaml.safe_load(RULE.read_text())
    assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["kind"] == "PrometheusRule"
    rules = [r for group in doc["spec"]["groups"] for r in group["rules"]]
    return {r["alert"]: " ".join(r["expr"].split()) for r in rules}


# ---- scrapes and the evaluator --------------------------------------------------------


Labels = frozenset[tuple[str, str]]


@dataclass(frozen=True)
class Scrape:
    at: float
    types: Mapping[str, str]  # family name -> counter, gauge, histogram, ...
    samples: Mapping[str, Mapping[Labels, float]]  # sample name -> labels -> value

    def series(self, name: str) -> Mapping[Labels, float]:
        return self.samples.get(name, {})


def parse(text: str, at: float) -> Scrape:
    types: dict[str, str] = {}
    samples: dict[str, dict[Labels, float]] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            samples.setdefault(s.name, {})[frozenset(s.labels.items())] = s.value
    return Scrape(at, types, samples)


_RANGE = {"m": 60.0, "h": 3600.0}
_INCREASE = re.compile(r"(rate|increase)\((\w+)\[(\d+)([mh])\]\) > ([\d.]+)")
_QUANTILE = re.compile(
    r"histogram_quantile\(([\d.]+), sum by \(instance, le\) "
    r"\(rate\((\w+)_bucket\[(\d+)m\]\)\)\) > ([\d.]+)")
_AGE = re.compile(r"time\(\) - (\w+) > ([\d.]+)")
_UP = re.compile(r'up\{job="([^"]+)"\} == 0')
_ABSENT = re.compile(r'absent\(up\{job="([^"]+)"\}\)')


def metric_names(expr: str) -> list[tuple[str, str]]:
    """(metric, sample name) an expression reads (`up` is Prometheus' own)."""
    for pattern, group, suffix in ((_INCREASE, 2, ""), (_QUANTILE, 2, "_bucket"), (_AGE, 1, "")):
        if match := pattern.fullmatch(expr):
            return [(match[group], match[group] + suffix)]
    assert _UP.fullmatch(expr) or _ABSENT.fullmatch(expr), f"not a shape this test knows: {expr}"
    return []


def fires(expr: str, before: Scrape, after: Scrape, *, now: float | None = None) -> bool:
    """Whether `expr` returns a series at `after` (the range ends there and
    starts at `before`: the windows of the rule cover the gap between them)."""
    if match := _INCREASE.fullmatch(expr):
        func, name, threshold = match[1], match[2], float(match[5])
        window = int(match[3]) * _RANGE[match[4]]
        assert after.at - before.at <= window
        old = before.series(name)
        for labels, value in after.series(name).items():
            growth = value - old.get(labels, math.nan)  # a new series has no increase
            rate = growth / (after.at - before.at)
            if (rate if func == "rate" else rate * window) > threshold:
                return True
        return False
    if match := _QUANTILE.fullmatch(expr):
        q, name, threshold = float(match[1]), match[2], float(match[4])
        old = before.series(f"{name}_bucket")
        buckets = sorted(
            (float(dict(labels)["le"]), value - old.get(labels, 0.0))
            for labels, value in after.series(f"{name}_bucket").items()
        )
        return histogram_quantile(q, buckets) > threshold
    if match := _AGE.fullmatch(expr):
        name, threshold = match[1], float(match[2])
        clock = after.at if now is None else now
        return any(clock - v > threshold for v in after.series(name).values())
    raise AssertionError(f"not a shape this test evaluates over a scrape: {expr}")


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile over (le, cumulative count) buckets:
    NaN without observations, linear inside the bucket, the highest finite
    bound when the rank falls into +Inf."""
    total = buckets[-1][1]
    assert math.isinf(buckets[-1][0])
    if total <= 0:
        return math.nan
    rank = q * total
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def test_the_evaluator_computes_prometheus_quantiles() -> None:
    buckets = [(0.1, 0.0), (1.0, 50.0), (10.0, 100.0), (math.inf, 100.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(1.0)
    assert histogram_quantile(0.99, buckets) == pytest.approx(9.82)
    assert histogram_quantile(0.99, [(1.0, 0.0), (math.inf, 5.0)]) == 1.0
    assert math.isnan(histogram_quantile(0.99, [(1.0, 0.0), (math.inf, 0.0)]))


# ---- a real agent --------------------------------------------------------------------


class Refusing(FakeBackend):
    """Refuses every non-empty commit while `refuse` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.refuse = threading.Event()

    def commit(self, commands: Sequence[Mapping[str, Any]], *, fresh: bool = False) -> None:
        if commands and self.refuse.is_set():
            raise NftRejected("Operation not supported", 0, commands[0])
        super().commit(commands, fresh=fresh)


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


@dataclass(frozen=True)
class Scrapes:
    good: Scrape  # after the first sync
    quiet: Scrape  # later, nothing happened in between
    bad: Scrape  # later, refused commits and an invalid Service in between


@pytest.fixture(scope="module")
def scrapes() -> Iterator[Scrapes]:
    config = ProxyConfig(
        node_name=NODE, cluster_cidrs=("10.244.0.0/16",), healthz_bind_address="127.0.0.1:0",
        metrics_bind_address="127.0.0.1:0", min_sync_period=0.0, sync_period=30.0,
    )
    backend = Refusing()
    with FakeApiServer() as api:
        api.create(node(NODE, ["192.168.50.1"]))
        api.create(service("dns", "10.96.0.10", ports=(("dns", 53, "UDP"),)))
        api.create(endpoint_slice("dns", [("10.244.0.11", NODE)], ports=(("dns", 53, "UDP"),)))
        client = api.api_client()

        def source_factory(handler: ClusterEvents) -> Source:
            return KubeSource(client, handler, node_name=NODE,
                              backoff_initial=0.05, backoff_max=0.2)

        agent = Agent(config, backend=backend, source_factory=source_factory)
        agent.runner.retry_interval = 0.01
        try:
            agent.start()
            assert agent.synced.wait(30), "the agent did not sync"
            host, port = agent.metrics.address
            url = f"http://{host}:{port}/metrics"

            def scrape() -> Scrape:
                return parse(get(url), time.time())

            good = scrape()
            time.sleep(0.05)
            quiet = scrape()
            backend.refuse.set()
            api.create(service("web", "10.96.0.20"))
            failures = "kubeproxy_sync_proxy_rules_nftables_sync_failures_total"
            wait_until(lambda: (agent.metrics.registry.get_sample_value(failures) or 0) >= 2,
                       timeout=15.0, what="two refused commits")
            api.create(service("bad", "10.96.0.11",
                               ports=(("http", 70000, "TCP"), ("ok", 80, "TCP"))))
            backend.refuse.clear()
            invalid = "nftproxy_invalid_fields_total"
            wait_until(lambda: (agent.metrics.registry.get_sample_value(
                invalid, {"kind": "Service"}) or 0) >= 1, 15.0, "the invalid Service counted")
            wait_until(lambda: "ns/web" in str(backend.list_table("ip", config.table_name)),
                       timeout=15.0, what="a successful sync after the refusals")
            yield Scrapes(good, quiet, scrape())
        finally:
            agent.stop()


# ---- the rule ------------------------------------------------------------------------


def test_the_rule_has_the_alerts_a_kube_proxy_operator_expects() -> None:
    assert set(alerts()) == ALERTS


TYPES = {
    "kubeproxy_sync_proxy_rules_nftables_sync_failures_total": "counter",
    "kubeproxy_sync_proxy_rules_duration_seconds": "histogram",
    "kubeproxy_sync_proxy_rules_last_timestamp_seconds": "gauge",
    "nftproxy_invalid_fields_total": "counter",
}


@pytest.mark.parametrize("alert", sorted(ALERTS))
def test_every_metric_an_alert_reads_is_exported_with_its_type(
    alert: str, scrapes: Scrapes
) -> None:
    for name, sample in metric_names(alerts()[alert]):
        family = name.removesuffix("_total") if TYPES[name] == "counter" else name
        assert scrapes.good.types.get(family) == TYPES[name], name
        assert scrapes.good.series(sample), f"{sample}: no series in a real scrape"


def test_labels_the_alerts_use_are_there(scrapes: Scrapes) -> None:
    kinds = {dict(labels)["kind"] for labels in
             scrapes.good.series("nftproxy_invalid_fields_total")}
    assert "Service" in kinds  # {{ $labels.kind }}, and a series at 0 before the first
    les = {dict(labels)["le"] for labels in
           scrapes.good.series("kubeproxy_sync_proxy_rules_duration_seconds_bucket")}
    assert "+Inf" in les and len(les) == 16


def test_failing_syncs_and_invalid_objects_fire_only_when_they_happen(scrapes: Scrapes) -> None:
    for name in ("NftproxySyncFailing", "NftproxyInvalidObjects"):
        expr = alerts()[name]
        assert not fires(expr, scrapes.good, scrapes.quiet), name
        assert fires(expr, scrapes.quiet, scrapes.bad), name


def test_latency_is_quiet_on_real_syncs_and_fires_above_the_threshold(scrapes: Scrapes) -> None:
    expr = alerts()["NftproxySyncLatencyHigh"]
    assert not fires(expr, scrapes.good, scrapes.bad)
    # the same series, every sync since `good` as slow as the top bucket
    name = "kubeproxy_sync_proxy_rules_duration_seconds_bucket"
    old = scrapes.good.series(name)
    syncs = max(scrapes.bad.series(name).values()) - max(old.values())
    assert syncs > 0, "no sync observed between the scrapes"
    slow = {labels: value + (syncs if dict(labels)["le"] == "+Inf" else 0.0)
            for labels, value in old.items()}
    later = replace(scrapes.bad, samples={**scrapes.bad.samples, name: slow})
    assert fires(expr, scrapes.good, later)


def test_staleness_is_quiet_after_a_sync_and_fires_once_it_is_old(scrapes: Scrapes) -> None:
    expr = alerts()["NftproxySyncStale"]
    assert not fires(expr, scrapes.good, scrapes.bad)
    assert fires(expr, scrapes.good, scrapes.bad, now=scrapes.bad.at + 301)


def test_up_selects_the_podmonitors_job() -> None:
    monitor = yaml.safe_load(PODMONITOR.read_text())
    job = f"{monitor['metadata']['namespace']}/{monitor['metadata']['name']}"
    assert "jobLabel" not in monitor["spec"]  # else the job label comes from a pod label
    for name in ("NftproxyDown", "NftproxyAbsent"):
        match = _UP.fullmatch(alerts()[name]) or _ABSENT.fullmatch(alerts()[name])
        assert match is not None and match[1] == job, name
