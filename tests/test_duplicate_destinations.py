"""Two Services claiming one destination (tracker issue 36, case 5).

Aspects:
- the winner is the planner's (the service port whose name sorts first:
  core/nft/claims.py): the programmed `service-ips` / `service-nodeports`
  element names it;
- every loser is reported once, through the Intake's one stream, naming
  both service ports, the destination and the field; not again on an
  unchanged re-delivery (informer resync) or another Service's event; again
  when the conflict goes away and comes back;
- in the agent that stream is a WARNING, nftproxy_invalid_fields_total
  and the `on_invalid_field` callback (where `run` posts the Event).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from nftproxy.agent.agent import Agent
from nftproxy.agent.intake import Intake, InvalidField
from nftproxy.core.config import ProxyConfig
from nftproxy.core.convert import EndpointSliceInfo
from nftproxy.core.model import NamespacedName, NodeInfo, ServiceInfo
from nftproxy.core.nft.jsontext import command_json
from nftproxy.kernel.fake import FakeBackend
from nftproxy.tools.dry_run import files_input


def service(
    namespace: str,
    name: str,
    ip: str,
    *,
    port: int = 80,
    node_port: int = 0,
    external_ips: tuple[str, ...] = (),
) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": "http", "port": port, "protocol": "TCP"}
    spec: dict[str, Any] = {"clusterIP": ip, "ports": [entry]}
    if node_port:
        spec["type"] = "NodePort"
        entry["nodePort"] = node_port
    if external_ips:
        spec["externalIPs"] = list(external_ips)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{namespace}-{name}"},
        "spec": spec,
    }


class Target:
    """A ProxierEvents that keeps nothing."""

    def on_service(
        self, name: NamespacedName, previous: ServiceInfo | None, current: ServiceInfo | None
    ) -> None:
        pass

    def on_endpoint_slice(self, key: NamespacedName, current: EndpointSliceInfo | None) -> None:
        pass

    def on_node(self, node: NodeInfo | None) -> None:
        pass

    def on_service_cidrs(self, cidrs: tuple[str, ...]) -> None:
        pass

    def on_synced(self, kind: str) -> None:
        pass


def intake() -> tuple[Intake, list[InvalidField]]:
    reports: list[InvalidField] = []
    return Intake(Target(), node_name="n1", report=reports.append), reports


A = service("a", "web", "10.96.0.10")
B = service("b", "web", "10.96.0.10")


def test_a_second_claim_of_a_cluster_ip_and_port_is_reported_once() -> None:
    events, reports = intake()
    events.on_service(None, A)
    events.on_service(None, B)
    (report,) = reports
    assert (report.namespace, report.name, report.uid) == ("b", "web", "uid-b-web")
    assert report.problem.field == "spec.clusterIP"
    text = str(report)
    assert "Service b/web" in text and "10.96.0.10:80/TCP" in text and "a/web:http" in text
    assert "b/web:http" in text
    events.on_service(B, B)  # an informer resync
    events.on_service(A, A)
    events.on_service(None, service("c", "other", "10.96.0.11"))
    assert len(reports) == 1


def test_the_loser_is_the_one_that_sorts_later_whoever_came_first() -> None:
    events, reports = intake()
    events.on_service(None, B)
    events.on_service(None, A)
    (report,) = reports
    assert (report.namespace, report.name) == ("b", "web")
    assert report.uid == ""  # the Event is about b, this event's object was a


def test_a_conflict_that_ends_and_comes_back_is_reported_again() -> None:
    events, reports = intake()
    events.on_service(None, A)
    events.on_service(None, B)
    moved = service("b", "web", "10.96.0.12")
    events.on_service(B, moved)
    assert len(reports) == 1
    events.on_service(moved, B)
    assert len(reports) == 2
    events.on_service(A, None)  # the winner leaves: nobody loses any more
    events.on_service(None, A)
    assert len(reports) == 3


@pytest.mark.parametrize(
    ("first", "second", "destination", "field"),
    [
        (
            service("a", "web", "10.96.0.10", node_port=30080),
            service("b", "web", "10.96.0.11", node_port=30080),
            "nodePort 30080/TCP (IPv4)",
            "spec.ports.nodePort",
        ),
        (
            service("a", "web", "10.96.0.10"),
            service("b", "web", "10.96.0.11", external_ips=("10.96.0.10",)),
            "10.96.0.10:80/TCP",
            "spec.externalIPs",
        ),
    ],
)
def test_node_ports_and_external_ips_are_destinations_too(
    first: dict[str, Any], second: dict[str, Any], destination: str, field: str
) -> None:
    events, reports = intake()
    events.on_service(None, first)
    events.on_service(None, second)
    (report,) = reports
    assert destination in str(report) and report.problem.field == field


def test_another_port_or_protocol_is_no_conflict() -> None:
    events, reports = intake()
    events.on_service(None, A)
    events.on_service(None, service("b", "web", "10.96.0.10", port=81))
    assert reports == []


def _element_comment(commands: Any, sets: tuple[str, ...], key: list[Any]) -> str:
    """The comment of the element `key` in one of `sets` (IPv4): its owner."""
    for command in map(command_json, commands):
        element = command.get("add", {}).get("element")
        if not element or element["name"] not in sets or element["family"] != "ip":
            continue
        for item in element["elem"]:
            elem = item[0]["elem"] if isinstance(item, list) else item["elem"]
            if elem["val"]["concat"] == key:
                return str(elem["comment"])
    raise AssertionError(f"no {sets} element {key}")


def test_the_reported_winner_is_the_programmed_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "c.yaml"
    both = (service("b", "web", "10.96.0.10", node_port=30080),
            service("a", "web", "10.96.0.10", node_port=30080))
    path.write_text(yaml.safe_dump_all(both))
    log = logging.getLogger("test.duplicates")
    with caplog.at_level(logging.WARNING, logger="test.duplicates"):
        proxier, _ = files_input([str(path)], ProxyConfig(), FakeBackend(), log=log)
    commands = proxier.plan_full().commands
    ips, nodeports = ("service-ips", "no-endpoint-services"), (
        "service-nodeports", "no-endpoint-nodeports")
    assert _element_comment(commands, ips, ["10.96.0.10", "tcp", 80]).startswith("a/web:http")
    assert _element_comment(commands, nodeports, ["tcp", 30080]).startswith("a/web:http")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2  # the cluster IP and the node port, each once
    assert all("Service b/web" in m and "which wins" in m for m in messages)


def test_the_agent_logs_counts_and_calls_back_once(caplog: pytest.LogCaptureFixture) -> None:
    heard: list[InvalidField] = []
    registry = CollectorRegistry()
    agent = Agent(
        ProxyConfig(node_name="n1", healthz_bind_address="", metrics_bind_address=""),
        backend=FakeBackend(),
        source_factory=lambda handler: pytest.fail("not started"),
        registry=registry,
        on_invalid_field=heard.append,
    )
    with caplog.at_level(logging.WARNING, logger="nftproxy.agent.agent"):
        agent.events.on_service(None, A)
        agent.events.on_service(None, B)
        agent.events.on_service(B, B)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "b/web" in record.getMessage() and "a/web:http" in record.getMessage()
    assert "10.96.0.10:80/TCP" in record.getMessage()
    sample = registry.get_sample_value("nftproxy_invalid_fields_total", {"kind": "Service"})
    assert sample == 1.0
    assert [(i.namespace, i.name, i.problem.kind) for i in heard] == [("b", "web", "Service")]
