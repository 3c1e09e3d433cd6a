"""End to end: `nftproxy run` (the real CLI process) against an API server,
inside the sandbox's node namespace, proven by traffic.

The fake API server (tests/fakeapi.py, the real protocol) listens on the
node namespace's loopback; the agent is `python -m nftproxy run --kubeconfig`
started with `ip netns exec <node>`. Aspects: rules appear once the lists are
synced and real connections spread over the endpoints; an EndpointSlice
change in the API reaches the kernel; /healthz and /metrics answer; SIGTERM
stops the agent and leaves the rules in place.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import kernel
import pytest
from fakeapi import FakeApiServer
from k8s import endpoint_slice, node, service

from nftproxy.kernel import netns
from nftproxy.tools.sandbox.probe import answered_by
from nftproxy.tools.sandbox.topology import (
    NODE_IPV4,
    NODE_NAME,
    Spec,
    Topology,
    build,
    default_pods,
)

CLUSTER_IP = "10.96.0.10"
HEALTHZ = "127.0.0.1:10256"
METRICS = "127.0.0.1:10249"


@pytest.fixture(scope="module")
def topo() -> Iterator[Topology]:
    kernel.require_root()
    with build(Spec(pods=default_pods(local=2, remote=1))) as t:
        yield t


@pytest.fixture
def api(topo: Topology) -> Iterator[FakeApiServer]:
    server = FakeApiServer()
    netns.run_in(topo.node, server.start)  # its socket lives in the node namespace
    try:
        yield server
    finally:
        server.stop()


def _kubeconfig(path: Path, url: str) -> Path:
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "fake",
                "clusters": [{"name": "fake", "cluster": {"server": url}}],
                "users": [{"name": "fake", "user": {}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
            }
        )
    )
    return path


def _http_get(topo: Topology, address: str, path: str) -> tuple[int, str]:
    def get() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://{address}{path}", timeout=2) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    return netns.run_in(topo.node, get)


def _eventually(check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.2)


def _answers(topo: Topology, count: int) -> Counter[str]:
    attempts = topo.probe("client", "tcp", CLUSTER_IP, 80, count=count, timeout=0.5)
    return Counter(answered_by(attempts))


def test_nftproxy_run_programs_what_the_api_says(
    topo: Topology, api: FakeApiServer, tmp_path: Path
) -> None:
    pods = [topo.pods["local1"], topo.pods["local2"], topo.pods["remote1"]]
    api.create(node(NODE_NAME, [NODE_IPV4]))
    api.create(service("web", CLUSTER_IP, ports=[("http", 80, "TCP")]))
    slice_ = endpoint_slice(
        "web", [(p.ipv4, p.node_name) for p in pods], ports=[("http", 8080, "TCP")], family="IPv4"
    )
    api.create(slice_)
    argv = [
        sys.executable,
        "-m",
        "nftproxy",
        "run",
        "--kubeconfig",
        str(_kubeconfig(tmp_path / "kubeconfig", api.url)),
        "--node-name",
        NODE_NAME,
        "--cluster-cidr",
        "10.244.0.0/16",
        "--healthz-bind-address",
        HEALTHZ,
        "--metrics-bind-address",
        METRICS,
        "--min-sync-period",
        "100ms",
    ]
    agent = subprocess.Popen(
        ["ip", "netns", "exec", topo.node, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _eventually(lambda: len(_answers(topo, 3)) > 0)
        spread = _answers(topo, 150)
        assert set(spread) == {p.name for p in pods}, spread

        api.update(
            endpoint_slice(
                "web",
                [(pods[0].ipv4, pods[0].node_name)],
                ports=[("http", 8080, "TCP")],
                family="IPv4",
            )
        )
        _eventually(lambda: set(_answers(topo, 20)) == {pods[0].name})

        status, body = _http_get(topo, HEALTHZ, "/healthz")
        assert status == 200, body
        assert "lastUpdated" in json.loads(body)
        status, metrics = _http_get(topo, METRICS, "/metrics")
        assert status == 200
        assert "kubeproxy_sync_proxy_rules_duration_seconds_count" in metrics
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            out, _ = agent.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            agent.kill()
            out, _ = agent.communicate()
    assert agent.returncode == 0, out
    tables = kernel.nft(topo.node, "list", "tables")
    assert "table ip nftproxy" in tables, "SIGTERM must leave the rules in place"
    assert set(_answers(topo, 10)) == {pods[0].name}, "traffic keeps flowing after the agent stops"
    for family in ("ip", "ip6"):
        for table in ("nftproxy", "nftproxy-affinity"):
            kernel.nft(topo.node, "delete", "table", family, table)
