"""Agent: the real wiring (Proxier, Runner, health, metrics, file source)
over FakeBackend; and the conntrack sysctls through a fake filesystem.

Aspects: start syncs the files into the table; an edit of a file changes
the rules; /healthz, /metrics (with /proxyMode, /healthz and /configz
beside it) and the healthCheckNodePort server answer;
a refused commit is counted and retried, and never ends the agent; stop()
(what SIGTERM does) leaves the tables in place; sysctls are raised like
kube-proxy's, never lowered, and unwritable files are warnings.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s import endpoint_slice, node, service

from nftproxy.agent.agent import Agent
from nftproxy.agent.intake import InvalidField
from nftproxy.cluster.events import KIND_ENDPOINT_SLICES, KIND_SERVICES, ClusterEvents
from nftproxy.cluster.file import FileSource, WatchedFiles
from nftproxy.core.config import ConntrackConfig, ProxyConfig
from nftproxy.core.nft.errors import NftRejected
from nftproxy.kernel.fake import FakeBackend
from nftproxy.kernel.sysctl import CONNTRACK_MAX, HASHSIZE, NETFILTER, apply_conntrack, plan

NODE = "node-a"
TABLE = "nftproxy"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


def write_cluster(path: Path, objects: Sequence[Mapping[str, Any]]) -> None:
    path.write_text(yaml.safe_dump_all(list(objects)))


def listing(backend: FakeBackend) -> str:
    return json.dumps(backend.list_table("ip", TABLE))


class FailingOnce(FakeBackend):
    """Refuses the first non-empty commit."""

    def __init__(self) -> None:
        super().__init__()
        self.refused = 0

    def commit(self, commands: Sequence[Mapping[str, Any]], *, fresh: bool = False) -> None:
        if commands and not self.refused:
            self.refused += 1
            raise NftRejected("Operation not supported", 0, commands[0])
        super().commit(commands, fresh=fresh)


@pytest.fixture
def cluster(tmp_path: Path) -> tuple[Path, int, list[dict[str, Any]]]:
    hc_port = free_port()
    objects = [
        node(NODE, ["192.168.50.1"]),
        service("web", "10.96.0.10"),
        endpoint_slice("web", [("10.244.0.11", NODE)]),
        service("lb", "10.96.0.30", type="LoadBalancer", node_ports=[30081], etp="Local",
                lb_ips=["192.168.60.10"], health_check_node_port=hc_port),
        endpoint_slice("lb", [("10.244.0.12", NODE), ("10.244.1.13", "node-b")]),
    ]
    path = tmp_path / "cluster.yaml"
    write_cluster(path, objects)
    return path, hc_port, objects


def make_agent(
    path: Path,
    backend: FakeBackend,
    *,
    metrics_address: str = "127.0.0.1:0",
    min_sync_period: float = 0.0,
    **kwargs: Any,
) -> Agent:
    config = ProxyConfig(
        node_name=NODE,
        table_name=TABLE,
        cluster_cidrs=("10.244.0.0/16",),
        healthz_bind_address="127.0.0.1:0",
        metrics_bind_address=metrics_address,
        min_sync_period=min_sync_period,
        sync_period=30.0,
    )

    def source_factory(handler: ClusterEvents) -> WatchedFiles:
        return WatchedFiles(FileSource([path], handler, node_name=NODE, poll_interval=0.01))

    return Agent(config, backend=backend, source_factory=source_factory,
                 service_health_host="127.0.0.1", **kwargs)


@pytest.fixture
def running(
    cluster: tuple[Path, int, list[dict[str, Any]]],
) -> Iterator[tuple[Agent, FakeBackend]]:
    backend = FakeBackend()
    agent = make_agent(cluster[0], backend)
    agent.start()
    try:
        assert agent.synced.wait(5)
        yield agent, backend
    finally:
        agent.stop()


def test_start_syncs_the_files_into_the_table(running: tuple[Agent, FakeBackend]) -> None:
    _, backend = running
    text = listing(backend)
    assert "ns/web" in text and "ns/lb" in text


class TricklingSource:
    """Delivers a list the way the API informers do: object by object, on
    its own thread, a little apart, then the two lists' on_synced."""

    def __init__(self, handler: ClusterEvents, objects: Sequence[Mapping[str, Any]]) -> None:
        self.handler, self.objects = handler, objects
        self.thread = threading.Thread(target=self._deliver, daemon=True)

    def _deliver(self) -> None:
        for obj in self.objects:
            if obj["kind"] == "Node":
                self.handler.on_node(dict(obj))
            elif obj["kind"] == "Service":
                self.handler.on_service(None, dict(obj))
            else:
                self.handler.on_endpoint_slice(None, dict(obj))
            time.sleep(0.05)
        self.handler.on_synced(KIND_SERVICES)
        self.handler.on_synced(KIND_ENDPOINT_SLICES)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.thread.join()


def test_events_before_the_lists_are_in_do_not_delay_the_first_sync(
    cluster: tuple[Path, int, list[dict[str, Any]]],
) -> None:
    """Were each event of the initial list to ask for a sync, the skipped
    syncs would spend the runner's burst and the first real sync would wait
    minSyncPeriod (as upstream: no sync is asked for before the lists)."""
    config = ProxyConfig(node_name=NODE, table_name=TABLE, healthz_bind_address="",
                         metrics_bind_address="", min_sync_period=10.0, sync_period=30.0)
    agent = Agent(config, backend=FakeBackend(),
                  source_factory=lambda h: TricklingSource(h, cluster[2]))
    agent.start()
    try:
        assert agent.synced.wait(5), "the first sync waited for minSyncPeriod"
        # (the runner counts a run once the sync returned, after its hooks)
        wait_for(lambda: agent.runner.runs >= 1, timeout=2.0)
        assert agent.runner.runs == 1
    finally:
        agent.stop()


def test_an_edit_of_the_file_changes_the_rules(
    running: tuple[Agent, FakeBackend], cluster: tuple[Path, int, list[dict[str, Any]]]
) -> None:
    _, backend = running
    path, _, objects = cluster
    assert "ns/api" not in listing(backend)
    write_cluster(path, [*objects, service("api", "10.96.0.50"),
                         endpoint_slice("api", [("10.244.0.20", NODE)])])
    wait_for(lambda: "ns/api" in listing(backend))
    write_cluster(path, objects)
    wait_for(lambda: "ns/api" not in listing(backend))


def test_healthz_metrics_and_the_service_health_server_answer(
    running: tuple[Agent, FakeBackend], cluster: tuple[Path, int, list[dict[str, Any]]]
) -> None:
    agent, _ = running
    assert agent.healthz is not None
    host, port = agent.healthz.address
    code, body = get(f"http://{host}:{port}/healthz")
    assert code == 200, body
    assert json.loads(body)["nodeEligible"] is True
    assert get(f"http://{host}:{port}/livez")[0] == 200

    code, body = get(f"http://127.0.0.1:{cluster[1]}/")
    assert code == 200
    assert json.loads(body) == {
        "service": {"namespace": "ns", "name": "lb"},
        "localEndpoints": 1,
        "serviceProxyHealthy": True,
    }

    host, port = agent.metrics.address
    code, body = get(f"http://{host}:{port}/metrics")
    text = body.decode()
    assert code == 200
    assert "kubeproxy_sync_full_proxy_rules_duration_seconds_count 1.0" in text
    assert 'kubeproxy_proxy_healthz_total{code="200"} 1.0' in text
    assert 'nftproxy_programmed_chains{ip_family="IPv4"}' in text
    assert "kubeproxy_sync_proxy_rules_service_changes_pending 0.0" in text

    # kube-proxy's other paths on the metrics address, wired to this agent
    assert get(f"http://{host}:{port}/proxyMode") == (200, b"nftables")
    code, body = get(f"http://{host}:{port}/healthz")
    assert code == 200 and json.loads(body)["nodeEligible"] is True
    code, body = get(f"http://{host}:{port}/configz")
    assert code == 200
    configz = json.loads(body)["kubeproxy.config.k8s.io"]
    assert configz["HostnameOverride"] == agent.config.node_name
    assert configz["MetricsBindAddress"] == agent.config.metrics_bind_address


def test_the_health_server_closes_when_the_service_goes(
    running: tuple[Agent, FakeBackend], cluster: tuple[Path, int, list[dict[str, Any]]]
) -> None:
    agent, _ = running
    path, hc_port, objects = cluster
    write_cluster(path, [o for o in objects if o["metadata"]["name"] != "lb"
                         and o["metadata"].get("labels", {}).get(
                             "kubernetes.io/service-name") != "lb"])
    wait_for(lambda: not agent.service_health.serving())
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{hc_port}/", timeout=2)


def test_stop_leaves_the_tables(cluster: tuple[Path, int, list[dict[str, Any]]]) -> None:
    backend = FakeBackend()
    agent = make_agent(cluster[0], backend)
    agent.start()
    assert agent.synced.wait(5)
    before = listing(backend)
    agent.stop()
    assert agent.runner.stopped
    backend.start()  # stop() closed it; look at what it holds
    assert listing(backend) == before
    assert "ns/web" in before


def test_run_returns_when_the_stop_event_is_set(
    cluster: tuple[Path, int, list[dict[str, Any]]],
) -> None:
    backend = FakeBackend()
    agent = make_agent(cluster[0], backend)
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,))
    thread.start()
    assert agent.synced.wait(5)
    stop.set()
    thread.join(5)
    assert not thread.is_alive()


def test_a_refused_commit_is_counted_and_retried(
    cluster: tuple[Path, int, list[dict[str, Any]]], caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="nftproxy.agent.agent")
    backend = FailingOnce()
    agent = make_agent(cluster[0], backend)
    agent.runner.retry_interval = 0.01
    agent.start()
    try:
        assert agent.synced.wait(5)
        failures = agent.metrics.registry.get_sample_value(
            "kubeproxy_sync_proxy_rules_nftables_sync_failures_total")
        assert failures == 1
        assert backend.refused == 1
        assert "ns/web" in listing(backend)
        assert any(r.getMessage().startswith("sync failed") for r in caplog.records)
    finally:
        agent.stop()


def test_a_service_whose_only_port_is_invalid_is_reported_and_the_rest_programmed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="nftproxy.agent.agent")
    path = tmp_path / "cluster.yaml"
    write_cluster(path, [
        node(NODE, ["192.168.50.1"]),
        service("bad", "10.96.0.66", ports=[("http", 70000, "TCP")]),
        service("web", "10.96.0.10"),
        endpoint_slice("web", [("10.244.0.11", NODE)]),
    ])
    backend = FakeBackend()
    reported: list[InvalidField] = []
    agent = make_agent(path, backend, on_invalid_field=reported.append)
    agent.start()
    try:
        assert agent.synced.wait(5)
        warnings = [r.getMessage() for r in caplog.records if "invalid field" in r.getMessage()]
        assert warnings == [
            "skipped invalid field: Service ns/bad: spec.ports[0].port: "
            "70000 is out of range 1..65535"
        ]
        assert [str(r) for r in reported] == [warnings[0].removeprefix("skipped invalid field: ")]
        count = agent.metrics.registry.get_sample_value(
            "nftproxy_invalid_fields_total", {"kind": "Service"})
        assert count == 1
        assert "10.96.0.10" in listing(backend)
        assert "10.96.0.66" not in listing(backend)
    finally:
        agent.stop()


def test_a_taken_metrics_port_is_logged_not_fatal(
    cluster: tuple[Path, int, list[dict[str, Any]]], caplog: pytest.LogCaptureFixture,
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        agent = make_agent(cluster[0], FakeBackend(), metrics_address=address)
        agent.start()
        try:
            assert agent.synced.wait(5)
            assert any("cannot serve metrics" in r.getMessage() for r in caplog.records)
        finally:
            agent.stop()


# ---- sysctls ------------------------------------------------------------------------


class FakeFS:
    def __init__(self, values: dict[str, str], read_only: bool = False) -> None:
        self.values = values
        self.read_only = read_only
        self.writes: list[tuple[str, str]] = []

    def read(self, path: str) -> str:
        if path not in self.values:
            raise FileNotFoundError(2, "No such file or directory", path)
        return self.values[path] + "\n"

    def write(self, path: str, value: str) -> None:
        if self.read_only:
            raise OSError(30, "Read-only file system", path)
        self.writes.append((path, value))
        self.values[path] = value


def sysctls(**overrides: str) -> dict[str, str]:
    values = {
        CONNTRACK_MAX: "65536",
        HASHSIZE: "16384",
        f"{NETFILTER}/nf_conntrack_tcp_timeout_established": "432000",
        f"{NETFILTER}/nf_conntrack_tcp_timeout_close_wait": "60",
        f"{NETFILTER}/nf_conntrack_tcp_be_liberal": "0",
        f"{NETFILTER}/nf_conntrack_udp_timeout": "30",
        f"{NETFILTER}/nf_conntrack_udp_timeout_stream": "120",
    }
    values.update(overrides)
    return values


def test_sysctls_are_set_like_kube_proxy() -> None:
    fs = FakeFS(sysctls())
    apply_conntrack(ConntrackConfig(), fs, cpus=8)
    assert dict(fs.writes) == {
        CONNTRACK_MAX: "262144",  # 32768 x 8 > min 131072
        HASHSIZE: "65536",
        f"{NETFILTER}/nf_conntrack_tcp_timeout_established": "86400",
        f"{NETFILTER}/nf_conntrack_tcp_timeout_close_wait": "3600",
    }


def test_conntrack_max_is_never_lowered_and_min_applies() -> None:
    fs = FakeFS(sysctls(**{CONNTRACK_MAX: "1000000", HASHSIZE: "250000"}))
    apply_conntrack(ConntrackConfig(), fs, cpus=1)
    assert CONNTRACK_MAX not in dict(fs.writes)
    assert plan(ConntrackConfig(), cpus=1)[0].value == 131072  # min wins over 32768 x 1


def test_max_per_core_zero_leaves_conntrack_max_alone() -> None:
    fs = FakeFS(sysctls())
    apply_conntrack(ConntrackConfig(max_per_core=0), fs, cpus=8)
    assert CONNTRACK_MAX not in dict(fs.writes)
    assert HASHSIZE not in dict(fs.writes)


def test_optional_settings_when_asked() -> None:
    fs = FakeFS(sysctls())
    config = ConntrackConfig(max_per_core=0, tcp_established_timeout=0, tcp_close_wait_timeout=0,
                             tcp_be_liberal=True, udp_timeout=60, udp_stream_timeout=180)
    apply_conntrack(config, fs, cpus=8)
    assert dict(fs.writes) == {
        f"{NETFILTER}/nf_conntrack_tcp_be_liberal": "1",
        f"{NETFILTER}/nf_conntrack_udp_timeout": "60",
        f"{NETFILTER}/nf_conntrack_udp_timeout_stream": "180",
    }


def test_read_only_or_missing_files_are_warnings(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="nftproxy.kernel.sysctl")
    values = sysctls()
    del values[HASHSIZE]
    fs = FakeFS(values, read_only=True)
    assert apply_conntrack(ConntrackConfig(), fs, cpus=8) == []
    messages = [r.getMessage() for r in caplog.records]
    assert "cannot read sysctl; leaving it" in messages
    assert "cannot set sysctl (read-only /proc or /sys?)" in messages


def test_the_agent_applies_sysctls_at_start(
    cluster: tuple[Path, int, list[dict[str, Any]]],
) -> None:
    fs = FakeFS(sysctls())
    agent = make_agent(cluster[0], FakeBackend(), sysctl_fs=fs)
    agent.start()
    try:
        assert (f"{NETFILTER}/nf_conntrack_tcp_timeout_close_wait", "3600") in fs.writes
    finally:
        agent.stop()
