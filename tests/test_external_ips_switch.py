"""The AllowServiceExternalIPs switch (KEP-5707), proven with packets.

The agent runs as `nftproxy run --source FILE` wires it: the configuration
comes from the CLI's own parser and loader (`--allow-service-external-ips`),
the Agent is the real one, its NftBackend programs the sandbox's node
namespace (nftproxy.tools.sandbox.topology: node, two pods, a client) from a
watched file holding one dual-stack Service with externalIPs.

Aspects, each for IPv4 and IPv6:
- on (the default): the client's connections to the external IPs are DNATed
  to the pods;
- off: they are left alone (no pod answers; the node has no rule for them),
  while the same Service's ClusterIPs still answer; the Service is reported
  once through the agent's invalid-field stream (one log line, one count of
  nftproxy_invalid_fields_total), not again when the file is edited.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kernel
import pytest
import yaml
from k8s import endpoint_slice, node, service

from nftproxy.agent.agent import Agent
from nftproxy.agent.intake import InvalidField
from nftproxy.core.nft.listing import list_family
from nftproxy.kernel.libnftables import NftBackend
from nftproxy.tools import cli
from nftproxy.tools.sandbox.addresses import NODE_IPV4, NODE_IPV6, Spec
from nftproxy.tools.sandbox.probe import Attempt, answered_by
from nftproxy.tools.sandbox.topology import (
    CLUSTER_CIDRS,
    NODE_NAME,
    Topology,
    TopologyError,
    build,
    default_pods,
)

pytestmark = pytest.mark.kernel

TABLE = "nftproxy"
CLUSTER_IPS = {4: "10.96.0.40", 6: "fd00:96::40"}
EXTERNAL_IPS = {4: "192.168.60.40", 6: "fd00:60::40"}
FAMILIES = [pytest.param(4, id="ipv4"), pytest.param(6, id="ipv6")]
RunAgent = Callable[[list[str]], tuple[Agent, list[InvalidField], Path]]


@pytest.fixture(scope="module")
def topo() -> Iterator[Topology]:
    kernel.require_root()
    with contextlib.ExitStack() as stack:
        try:
            yield stack.enter_context(build(Spec(default_pods(local=1, remote=1))))
        except (TopologyError, OSError, subprocess.SubprocessError) as exc:
            pytest.fail(f"cannot build the dataplane sandbox: {exc}", pytrace=False)


def cluster_objects(topo: Topology, *, ports: int = 1) -> list[dict[str, Any]]:
    pods = [topo.pods["local1"], topo.pods["remote1"]]
    service_ports = (("tcp", 80, "TCP"), ("tcp2", 81, "TCP"))[:ports]
    svc = service("ext", [CLUSTER_IPS[4], CLUSTER_IPS[6]],
                  ports=service_ports, external_ips=[EXTERNAL_IPS[4], EXTERNAL_IPS[6]])
    slices = [
        endpoint_slice("ext", [(p.ip(f), p.node_name) for p in pods], ports=(("tcp", 8080, "TCP"),),
                       family=f"IPv{f}", name=f"ext-v{f}")
        for f in (4, 6)
    ]
    return [node(NODE_NAME, [NODE_IPV4, NODE_IPV6]), svc, *slices]


@pytest.fixture
def run_agent(topo: Topology, tmp_path: Path) -> Iterator[RunAgent]:
    """Start the agent with `nftproxy run` flags; stop it and empty the table after."""
    agents: list[Agent] = []

    def start(flags: list[str]) -> tuple[Agent, list[InvalidField], Path]:
        path = tmp_path / "cluster.yaml"
        path.write_text(yaml.safe_dump_all(cluster_objects(topo)))
        args = cli.build_parser().parse_args([
            "run", "--source", str(path), "--node-name", NODE_NAME,
            "--cluster-cidr", ",".join(CLUSTER_CIDRS), "--table-name", TABLE,
            "--healthz-bind-address=", "--metrics-bind-address=", "--min-sync-period=0s",
            *flags,
        ])
        config, source_factory, _ = cli._file_source(
            args.source, cli._load_config(args), allow_empty=args.allow_empty
        )
        invalid: list[InvalidField] = []
        agent = Agent(config, backend=NftBackend(netns=topo.node),
                      source_factory=source_factory, on_invalid_field=invalid.append)
        agents.append(agent)
        agent.start()
        assert agent.synced.wait(20), "the agent did not sync"
        return agent, invalid, path

    topo.flush_conntrack()
    yield start
    for agent in agents:
        agent.stop()
    with NftBackend(netns=topo.node) as backend:
        backend.delete_tables(TABLE)


def probe(topo: Topology, family: int, address: str, *, timeout: float) -> list[Attempt]:
    return topo.probe("client", "tcp", address, 80, count=6, timeout=timeout)


def sample(agent: Agent, name: str, **labels: str) -> float:
    return agent.metrics.registry.get_sample_value(name, labels) or 0.0


def table_text(agent: Agent) -> str:
    return str([list_family(agent.backend.list_table, f, TABLE) for f in ("ip", "ip6")])


@pytest.mark.parametrize("flags", [[], ["--allow-service-external-ips"]], ids=["default", "on"])
@pytest.mark.parametrize("family", FAMILIES)
def test_external_ips_are_forwarded_when_allowed(
    topo: Topology, run_agent: RunAgent, flags: list[str], family: int
) -> None:
    agent, invalid, _ = run_agent(flags)
    attempts = probe(topo, family, EXTERNAL_IPS[family], timeout=2.0)
    assert all(a.ok for a in attempts), attempts
    assert set(answered_by(attempts)) <= {"local1", "remote1"}
    assert EXTERNAL_IPS[family] in table_text(agent)
    assert invalid == []


@pytest.mark.parametrize("family", FAMILIES)
def test_external_ips_are_left_alone_when_not_allowed_and_reported_once(
    topo: Topology, run_agent: RunAgent, family: int
) -> None:
    agent, invalid, path = run_agent(["--allow-service-external-ips=false"])
    attempts = probe(topo, family, EXTERNAL_IPS[family], timeout=0.5)
    assert not any(a.ok for a in attempts), attempts
    assert answered_by(attempts) == {}
    assert EXTERNAL_IPS[family] not in table_text(agent)
    served = probe(topo, family, CLUSTER_IPS[family], timeout=2.0)  # the rest still works
    assert all(a.ok for a in served), served

    # an edit of the Service (one more port) is not reported again
    changes = "kubeproxy_sync_proxy_rules_service_changes_total"
    before = sample(agent, changes)
    path.write_text(yaml.safe_dump_all(cluster_objects(topo, ports=2)))
    deadline = time.monotonic() + 20
    while sample(agent, changes) == before:
        assert time.monotonic() < deadline, "the edit was not synced"
        time.sleep(0.05)
    assert [(i.namespace, i.name, i.problem.field) for i in invalid] == [
        ("ns", "ext", "spec.externalIPs")
    ]
    assert "AllowServiceExternalIPs is off" in invalid[0].problem.message
    assert sample(agent, "nftproxy_invalid_fields_total", kind="Service") == 1
