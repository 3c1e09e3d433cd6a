"""Metrics: kube-proxy's names and nftproxy's own, fed from SyncReports and
scraped over HTTP.

Aspects: every name is exported (in its own registry, never the global
one); a sync feeds the duration histograms (full or partial), the ops
histogram, the last-sync timestamp, the change counters and the
no-local-endpoints gauges; network programming latency observes trigger
times, except those before the agent started; failures, skipped syncs,
health answers, pending changes, table sizes and conntrack cleanups are
counted; /metrics is served, and beside it kube-proxy's /proxyMode,
/healthz (the health address's answer) and /configz (the effective
configuration, Go-style durations); other paths are 404.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from nftproxy.agent.report import FamilySync, SyncReport
from nftproxy.core.config import ConntrackConfig, ProxyConfig
from nftproxy.core.model import IPFamily, NamespacedName, NodeInfo
from nftproxy.core.tracker import StateSnapshot, UpdateResult
from nftproxy.serving.configz import configz_body, go_duration
from nftproxy.serving.health import HealthServer, ProxyHealth
from nftproxy.serving.metrics import SYNC_BUCKETS, Metrics

NOW = 1_700_000_000.0
WEB = NamespacedName("ns", "web")


class FakeClock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def report(
    *, full: bool = False, ops: int = 10, total: float = 0.003,
    trigger_times: tuple[float, ...] = (),
    service_changes: tuple[int, int] = (1, 1), endpoint_changes: tuple[int, int] = (2, 1),
    no_local: tuple[int, int] = (0, 0), skipped: str = "",
) -> SyncReport:
    families = []
    for i, family in enumerate((IPFamily.IPV4, IPFamily.IPV6)):
        update = UpdateResult(
            trigger_times={WEB: trigger_times} if i == 0 and trigger_times else {},
            service_changes=service_changes[i],
            endpoint_changes=endpoint_changes[i],
        )
        families.append(
            FamilySync(family, update, StateSnapshot(family), no_local[0], no_local[1])
        )
    return SyncReport(
        full=full, ops=ops, families=tuple(families), render_seconds=0.001,
        commit_seconds=0.002, total_seconds=total, skipped=skipped,
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def metrics(clock: FakeClock) -> Metrics:
    return Metrics(CollectorRegistry(), clock=clock)


def value(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


KUBE_PROXY_NAMES = [
    "kubeproxy_sync_proxy_rules_duration_seconds",
    "kubeproxy_sync_full_proxy_rules_duration_seconds",
    "kubeproxy_sync_partial_proxy_rules_duration_seconds",
    "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
    "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
    "kubeproxy_network_programming_duration_seconds",
    "kubeproxy_sync_proxy_rules_service_changes_pending",
    "kubeproxy_sync_proxy_rules_service_changes_total",
    "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
    "kubeproxy_sync_proxy_rules_endpoint_changes_total",
    "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
    "kubeproxy_sync_proxy_rules_nftables_sync_failures_total",
    "kubeproxy_proxy_healthz_total",
    "kubeproxy_proxy_livez_total",
    "kubeproxy_conntrack_reconciler_sync_duration_seconds",
    "kubeproxy_conntrack_reconciler_deleted_entries_total",
]
NFTPROXY_NAMES = [
    "nftproxy_sync_transaction_ops",
    "nftproxy_sync_render_duration_seconds",
    "nftproxy_sync_commit_duration_seconds",
    "nftproxy_programmed_chains",
    "nftproxy_programmed_rules",
    "nftproxy_programmed_sets",
    "nftproxy_programmed_elements",
    "nftproxy_sync_skipped_total",
]


@pytest.fixture
def served(metrics: Metrics) -> Iterator[str]:
    metrics.serve("127.0.0.1:0")
    host, port = metrics.address
    yield f"http://{host}:{port}"
    metrics.stop()


def scrape(base: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items()))
            samples[key] = s.value
    return samples


def test_every_name_is_exported_over_http(metrics: Metrics, served: str) -> None:
    metrics.record_sync(report())
    metrics.record_response("healthz", 200)
    metrics.record_response("livez", 503)
    metrics.record_table("IPv4", chains=1, rules=2, sets=3, elements=4)
    metrics.record_failure()
    metrics.record_queued()
    metrics.record_pending(services=0, endpoints=0)
    metrics.record_conntrack(0.01, deleted=1)
    metrics.record_sync(report(skipped="waiting"))
    samples = scrape(served)
    names = {key.split(",")[0] for key in samples}
    for name in KUBE_PROXY_NAMES + NFTPROXY_NAMES:
        stem = name.removesuffix("_total")
        assert any(n == name or n.startswith(stem + "_") for n in names), name


def test_other_paths_are_404(served: str) -> None:
    # without a ProxyHealth and a ProxyConfig, /healthz and /configz are not served
    for path in ("/healthz", "/configz", "/debug/pprof/", "/proxymode"):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{served}{path}", timeout=5)
        assert err.value.code == 404, path


def fetch(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


@pytest.fixture
def health(clock: FakeClock) -> ProxyHealth:
    return ProxyHealth(timeout=60.0, clock=clock, monotonic=clock)


CONFIG = ProxyConfig(
    node_name="node-a",
    node_ips=("192.0.2.7",),
    cluster_cidrs=("10.244.0.0/16", "fd00:10:244::/56"),
    nodeport_addresses=("primary",),
    masquerade_bit=12,
    min_sync_period=0.5,
    metrics_bind_address="127.0.0.1:0",
    allow_service_external_ips=False,
    conntrack=ConntrackConfig(tcp_be_liberal=True, udp_timeout=30),
)


@pytest.fixture
def served_all(metrics: Metrics, health: ProxyHealth) -> Iterator[str]:
    metrics.serve("127.0.0.1:0", health=health, config=CONFIG)
    host, port = metrics.address
    yield f"http://{host}:{port}"
    metrics.stop()


def test_proxy_mode_answers_nftables_as_kube_proxy(served: str) -> None:
    code, headers, body = fetch(f"{served}/proxyMode")
    assert (code, body) == (200, b"nftables")
    assert headers["Content-Type"] == "text/plain; charset=utf-8"
    assert headers["X-Content-Type-Options"] == "nosniff"


def test_healthz_on_the_metrics_address_answers_as_the_health_address(
    metrics: Metrics, health: ProxyHealth, clock: FakeClock, served_all: str
) -> None:
    health_server = HealthServer(health, "127.0.0.1:0")
    health_server.start()
    try:
        host, port = health_server.address
        on_health = f"http://{host}:{port}/healthz"
        seen = []
        for step in ("no node", "eligible", "stale change"):
            if step == "eligible":
                health.set_node(NodeInfo("node-a"))
            if step == "stale change":
                health.queued()
                clock.now += 61.0
            ours = fetch(f"{served_all}/healthz")
            theirs = fetch(on_health)
            assert (ours[0], ours[2]) == (theirs[0], theirs[2]), step
            assert ours[1]["Content-Type"] == theirs[1]["Content-Type"] == "application/json"
            seen.append((ours[0], json.loads(ours[2])["healthy"]))
        assert seen == [(503, True), (200, True), (503, False)]
    finally:
        health_server.stop()
    # answers on the metrics address are not kube-proxy's healthz counts
    assert value(metrics, "kubeproxy_proxy_healthz_total", code="200") is None


def test_configz_prints_the_effective_configuration_as_kube_proxy(served_all: str) -> None:
    code, headers, body = fetch(f"{served_all}/configz")
    assert code == 200
    assert headers["Content-Type"] == "application/json"
    doc = json.loads(body)
    assert list(doc) == ["kubeproxy.config.k8s.io"]
    config = doc["kubeproxy.config.k8s.io"]
    assert config["Mode"] == "nftables"
    assert config["HostnameOverride"] == "node-a"
    assert config["BindAddress"] == "192.0.2.7"
    assert config["MetricsBindAddress"] == "127.0.0.1:0"
    assert config["HealthzBindAddress"] == "0.0.0.0:10256"
    assert config["NFTables"] == {"MasqueradeBit": 12}
    assert config["DetectLocalMode"] == "ClusterCIDR"
    assert config["DetectLocal"]["ClusterCIDRs"] == ["10.244.0.0/16", "fd00:10:244::/56"]
    assert config["NodePortAddresses"] == ["primary"]
    assert config["FeatureGates"] == {
        "AllowServiceExternalIPs": False, "PreferSameTrafficDistribution": True,
        "KubeProxyNFTablesLocalhostNodePorts": False,
    }
    assert (config["SyncPeriod"], config["MinSyncPeriod"], config["ConfigSyncPeriod"]) == (
        "30s", "500ms", "15m0s",
    )
    assert config["Linux"] == {
        "Conntrack": {
            "MaxPerCore": 32768, "Min": 131072, "TCPEstablishedTimeout": "24h0m0s",
            "TCPCloseWaitTimeout": "1h0m0s", "TCPBeLiberal": True, "UDPTimeout": "30s",
            "UDPStreamTimeout": "0s",
        },
        "MasqueradeAll": False,
    }


def test_configz_of_the_defaults_leaves_unset_lists_null() -> None:
    config = configz_body(ProxyConfig())["kubeproxy.config.k8s.io"]
    assert config["NodePortAddresses"] is None
    assert config["DetectLocal"]["ClusterCIDRs"] is None
    assert config["BindAddress"] == "0.0.0.0"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"), (1, "1s"), (1.5, "1.5s"), (0.25, "250ms"), (0.0000015, "1.5µs"),
        (30, "30s"), (60, "1m0s"), (90.5, "1m30.5s"), (900, "15m0s"), (3600, "1h0m0s"),
        (86400, "24h0m0s"), (3661, "1h1m1s"), (-2, "-2s"),
    ],
)
def test_durations_print_as_go_does(seconds: float, text: str) -> None:
    assert go_duration(seconds) == text


def test_metrics_use_their_own_registry() -> None:
    m = Metrics()
    assert m.registry is not REGISTRY
    assert REGISTRY.get_sample_value("kubeproxy_sync_proxy_rules_nftables_sync_failures_total") \
        is None


def test_sync_duration_buckets_are_kube_proxys() -> None:
    assert len(SYNC_BUCKETS) == 15
    assert SYNC_BUCKETS[0] == 0.001
    assert SYNC_BUCKETS[-1] == pytest.approx(16.384)


def test_a_partial_sync(metrics: Metrics, clock: FakeClock) -> None:
    metrics.record_sync(report(ops=10, total=0.003, no_local=(2, 1)))
    assert value(metrics, "kubeproxy_sync_proxy_rules_duration_seconds_count") == 1
    assert value(metrics, "kubeproxy_sync_proxy_rules_duration_seconds_sum") == pytest.approx(0.003)
    assert value(metrics, "kubeproxy_sync_proxy_rules_duration_seconds_bucket", le="0.004") == 1
    assert value(metrics, "kubeproxy_sync_proxy_rules_duration_seconds_bucket", le="0.002") == 0
    assert value(metrics, "kubeproxy_sync_partial_proxy_rules_duration_seconds_count") == 1
    assert value(metrics, "kubeproxy_sync_full_proxy_rules_duration_seconds_count") == 0
    assert value(metrics, "kubeproxy_sync_proxy_rules_last_timestamp_seconds") == NOW
    assert value(metrics, "nftproxy_sync_transaction_ops_sum") == 10
    # a dual-stack service is one change in each family; slices are per family
    assert value(metrics, "kubeproxy_sync_proxy_rules_service_changes_total") == 1
    assert value(metrics, "kubeproxy_sync_proxy_rules_endpoint_changes_total") == 3
    # both families' service ports with no local endpoints
    policy = "kubeproxy_sync_proxy_rules_no_local_endpoints_total"
    assert value(metrics, policy, traffic_policy="internal") == 4
    assert value(metrics, policy, traffic_policy="external") == 2


def test_a_full_sync(metrics: Metrics) -> None:
    metrics.record_sync(report(full=True))
    assert value(metrics, "kubeproxy_sync_full_proxy_rules_duration_seconds_count") == 1
    assert value(metrics, "kubeproxy_sync_partial_proxy_rules_duration_seconds_count") == 0


def test_network_programming_ignores_trigger_times_before_the_start(
    metrics: Metrics, clock: FakeClock
) -> None:
    metrics.mark_started()
    clock.now += 10
    metrics.record_sync(report(trigger_times=(NOW - 5, NOW + 2, NOW + 9.5)))
    name = "kubeproxy_network_programming_duration_seconds"
    assert value(metrics, f"{name}_count") == 2
    assert value(metrics, f"{name}_sum") == pytest.approx(8.0 + 0.5)
    assert value(metrics, f"{name}_bucket", le="0.5") == 1


def test_failures_skips_and_health_answers_are_counted(metrics: Metrics) -> None:
    metrics.record_failure()
    metrics.record_failure()
    metrics.record_sync(report(skipped="waiting for the initial list"))
    metrics.record_response("healthz", 503)
    metrics.record_response("healthz", 200)
    metrics.record_response("livez", 200)
    assert value(metrics, "kubeproxy_sync_proxy_rules_nftables_sync_failures_total") == 2
    assert value(metrics, "nftproxy_sync_skipped_total") == 1
    assert value(metrics, "kubeproxy_sync_proxy_rules_duration_seconds_count") == 0
    assert value(metrics, "kubeproxy_proxy_healthz_total", code="503") == 1
    assert value(metrics, "kubeproxy_proxy_healthz_total", code="200") == 1
    assert value(metrics, "kubeproxy_proxy_livez_total", code="200") == 1


def test_queued_timestamp_and_pending_changes(metrics: Metrics, clock: FakeClock) -> None:
    metrics.record_queued()
    assert value(metrics, "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds") == NOW
    metrics.record_pending(services=3, endpoints=5)
    assert value(metrics, "kubeproxy_sync_proxy_rules_service_changes_pending") == 3
    assert value(metrics, "kubeproxy_sync_proxy_rules_endpoint_changes_pending") == 5
    pending = [7, 11]
    metrics.pending_from(lambda: (pending[0], pending[1]))
    assert value(metrics, "kubeproxy_sync_proxy_rules_service_changes_pending") == 7
    pending[1] = 0
    assert value(metrics, "kubeproxy_sync_proxy_rules_endpoint_changes_pending") == 0


def test_table_sizes_and_conntrack(metrics: Metrics) -> None:
    metrics.record_table("IPv6", chains=5, rules=20, sets=4, elements=9)
    assert value(metrics, "nftproxy_programmed_rules", ip_family="IPv6") == 20
    assert value(metrics, "nftproxy_programmed_elements", ip_family="IPv6") == 9
    metrics.record_conntrack(0.02, deleted=3)
    metrics.record_conntrack(0.01, deleted=0)
    assert value(metrics, "kubeproxy_conntrack_reconciler_deleted_entries_total") == 3
    assert value(metrics, "kubeproxy_conntrack_reconciler_sync_duration_seconds_count") == 2


def test_scraped_values_match(metrics: Metrics, served: str) -> None:
    metrics.record_sync(report(ops=42))
    metrics.record_failure()
    samples = scrape(served)
    assert samples["nftproxy_sync_transaction_ops_sum"] == 42
    assert samples["kubeproxy_sync_proxy_rules_nftables_sync_failures_total"] == 1
    assert samples["kubeproxy_sync_proxy_rules_last_timestamp_seconds"] == NOW
