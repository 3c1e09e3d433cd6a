"""Metrics: kube-proxy's names and nftproxy's own, fed from SyncReports and
scraped over HTTP.

Aspects: every name is exported (in its own registry, never the global
one); a sync feeds the duration histograms (full or partial), the ops
histogram, the last-sync timestamp, the change counters and the
no-local-endpoints gauges; network programming latency observes trigger
times, except those before the agent started; failures, skipped syncs,
health answers, pending changes, table sizes and conntrack cleanups are
counted; /metrics is served, other paths are 404.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from nftproxy.agent.report import FamilySync, SyncReport
from nftproxy.core.model import IPFamily, NamespacedName
from nftproxy.core.tracker import StateSnapshot, UpdateResult
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
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{served}/healthz", timeout=5)
    assert err.value.code == 404


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
