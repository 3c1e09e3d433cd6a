"""An API server reachable only through the `kubernetes` Service's ClusterIP.

Aspects: the decision (`cluster_ip_route`: the client's server is the
address the kubelet gives as KUBERNETES_PORT); a real agent whose API
server does not answer through that ClusterIP before its first lists logs
ONE ERROR naming the ConfigMap keys, no retry WARNING, keeps retrying, and
its /healthz names the cause until the server answers; the same outage
through any other address is the usual WARNING and no /healthz problem.
The API server is a FakeApiServer on 127.0.0.1, stopped to refuse
connections; KUBERNETES_PORT is given to KubeSource as its environment.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fakeapi import FakeApiServer
from faults import wait_until
from k8s import node

from nftproxy.agent.agent import Agent, Source
from nftproxy.cluster.events import ClusterEvents
from nftproxy.cluster.kube import KubeSource, cluster_ip_route
from nftproxy.core.config import ProxyConfig
from nftproxy.kernel.fake import FakeBackend

NODE = "node-a"
LOGGER = "test.api-via-cluster-ip"


@pytest.mark.parametrize(
    ("host", "kubernetes_port", "route"),
    [
        ("https://10.96.0.1:443", "tcp://10.96.0.1:443", "10.96.0.1:443"),
        ("https://10.96.0.1", "tcp://10.96.0.1:443", "10.96.0.1:443"),
        ("https://[fd00:10:96::1]:443", "tcp://[fd00:10:96::1]:443", "[fd00:10:96::1]:443"),
        # the ConfigMap's kubernetes-service-host/-port: another address or port
        ("https://192.0.2.10:6443", "tcp://10.96.0.1:443", ""),
        ("https://10.96.0.1:6443", "tcp://10.96.0.1:443", ""),
        # a name is never the ClusterIP; outside a pod there is no KUBERNETES_PORT
        ("https://api.example:443", "tcp://10.96.0.1:443", ""),
        ("https://10.96.0.1:443", "", ""),
    ],
)
def test_the_route_is_the_kubernetes_service_only_when_the_addresses_match(
    host: str, kubernetes_port: str, route: str
) -> None:
    environ = {"KUBERNETES_PORT": kubernetes_port} if kubernetes_port else {}
    assert cluster_ip_route(host, environ) == route


def healthz(agent: Agent) -> tuple[int, dict[str, Any]]:
    assert agent.healthz is not None
    host, port = agent.healthz.address
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.guard = threading.Lock()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        with self.guard:
            self.records.append(record)

    def at(self, level: int) -> list[str]:
        with self.guard:
            return [r.getMessage() for r in self.records if r.levelno == level]


@pytest.fixture
def records() -> Iterator[Records]:
    log = logging.getLogger(LOGGER)
    handler = Records()
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    yield handler
    log.removeHandler(handler)


Outage = tuple[Agent, FakeApiServer, KubeSource]


@pytest.fixture
def outage(records: Records) -> Iterator[Callable[[str], Outage]]:
    """outage(KUBERNETES_PORT's address or "" for the API server's own) ->
    a started agent whose API server refuses every connection."""
    running: list[tuple[Agent, FakeApiServer]] = []

    def run(kubernetes_port: str) -> Outage:
        api = FakeApiServer()
        api.start()
        api.create(node(NODE, ["192.168.50.1"]))
        client = api.api_client()
        address = api.url.split("//", 1)[1]
        api.stop()  # every connection refused, as a ClusterIP without rules
        environ = {"KUBERNETES_PORT": f"tcp://{kubernetes_port or address}"}
        sources: list[KubeSource] = []

        def source_factory(handler: ClusterEvents) -> Source:
            sources.append(KubeSource(client, handler, node_name=NODE, environ=environ,
                                      logger=logging.getLogger(LOGGER)))
            return sources[0]

        config = ProxyConfig(node_name=NODE, healthz_bind_address="127.0.0.1:0",
                             metrics_bind_address="", sync_period=0.05, min_sync_period=0.0)
        agent = Agent(config, backend=FakeBackend(), source_factory=source_factory)
        running.append((agent, api))
        agent.start()
        return agent, api, sources[0]

    yield run
    for agent, api in running:
        agent.stop()
        api.stop()


def errors_per_resource(source: KubeSource) -> dict[str, int]:
    return {name: stats.errors for name, stats in source.stats.items()}


def test_no_answer_through_the_cluster_ip_is_one_error_and_a_healthz_problem(
    outage: Callable[[str], Outage], records: Records
) -> None:
    agent, api, source = outage("")
    wait_until(lambda: all(n >= 3 for n in errors_per_resource(source).values()),
               timeout=15.0, what="three refused attempts per informer")
    code, body = healthz(agent)
    assert code == 503
    assert "kubernetes-service-host" in body["problem"]
    assert "kubernetes-service-port" in body["problem"]
    assert "kubernetes Service's ClusterIP" in body["problem"]

    errors = records.at(logging.ERROR)
    assert len(errors) == 1, errors
    assert "`kubernetes-service-host` and `kubernetes-service-port`" in errors[0]
    assert api.url.split("//", 1)[1] in errors[0]  # the ClusterIP it tried
    assert records.at(logging.WARNING) == []  # not a WARNING per informer, forever

    # still retrying: the server answers, the lists complete, the problem is gone
    api.start()
    assert agent.synced.wait(15), "the agent did not sync once the server answered"
    wait_until(lambda: "problem" not in healthz(agent)[1], 15.0, "/healthz without a problem")
    assert len(records.at(logging.ERROR)) == 1
    assert any("answers again" in m for m in records.at(logging.INFO))


def test_no_answer_through_another_address_is_the_usual_warning(
    outage: Callable[[str], Outage], records: Records
) -> None:
    agent, _, source = outage("10.96.0.1:443")
    wait_until(lambda: all(n >= 3 for n in errors_per_resource(source).values()),
               timeout=15.0, what="three refused attempts per informer")
    assert records.at(logging.ERROR) == []
    assert len(records.at(logging.WARNING)) == len(source.stats)  # one per informer
    assert "problem" not in healthz(agent)[1]
