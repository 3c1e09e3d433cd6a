"""The scenarios' driver without VMs: every node a network namespace with
its own nftproxy Agent, all in this process.

Layer: vmtests (test tooling). One job: run `scenarios` on
nftproxy.tools.sandbox.cluster's namespace cluster (a LAN switch namespace, one
namespace per node with its pods behind it, a client). The API server
(apiserver.LanApiServer, the real list/watch protocol) listens on the
client's LAN address inside the client namespace, as the runner's does in
the client VM; every node's agent is the real `Agent` -- KubeSource against
that server over the LAN, `NftBackend(netns=<node>)` (its own tables in its
own namespace), conntrack cleanup in the node's namespace, health servers --
configured as `nftproxy run` would configure it for that node.

Where the health servers bind: sockets belong to the network namespace of
the thread that creates them, and a new thread starts in the namespace of
the thread that created it. `Agent.start()` therefore runs on a thread that
first entered the node's namespace (`netns.run_in(node_ns, agent.start)`):
every thread the agent starts -- the sync runner, whose post-sync hook binds
the healthCheckNodePort servers (health.ServiceHealthServers, listening on
"::" dual-stack); the /healthz server; their request threads; the KubeSource
informers, which reach the API server over the LAN -- lives in the node's
namespace. So each node serves :10256 and its health-check node ports on
its own LAN address, and two agents in one process never share a socket
namespace. NftBackend and Conntrack enter the namespace themselves
(`netns=`); nothing here binds or programs anything in the caller's namespace.

Restarting an agent is `Agent.stop()` (rules stay, as after SIGTERM) and a
new Agent with fresh backend, source and state: its first sync is a full
sync from a fresh list, as after a process restart.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

from kubernetes import client as k8s_client
from prometheus_client import CollectorRegistry

from nftproxy.agent.agent import Agent, Source
from nftproxy.cluster.events import ClusterEvents
from nftproxy.cluster.kube import KubeSource
from nftproxy.core.config import ProxyConfig
from nftproxy.kernel import netns
from nftproxy.kernel.conntrack import Conntrack
from nftproxy.kernel.libnftables import NftBackend
from nftproxy.tools.dump import parse_table
from nftproxy.tools.sandbox import cluster as _cluster
from nftproxy.tools.sandbox.cluster import API_PORT, CLUSTER_CIDR, Cluster, ClusterPlan, HttpAnswer
from nftproxy.tools.sandbox.probe import Attempt, Continuous
from vmtests import scenarios
from vmtests.apiserver import LanApiServer

__all__ = ["NetnsDriver", "running"]

_log = logging.getLogger("vmtests.netns")


class _LogTail(logging.Handler):
    """The last records of one agent's loggers, for failure messages."""

    def __init__(self, size: int = 60) -> None:
        super().__init__(logging.INFO)
        self.size = size
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")
        del self.lines[: -self.size]


class NetnsDriver:
    """scenarios.Driver on a namespace cluster; agents are started by `running`."""

    slow = 1.0

    def __init__(
        self,
        cluster: Cluster,
        api: LanApiServer,
        *,
        min_sync_period: float = 0.1,
        sync_period: float = 10.0,
    ) -> None:
        self.cluster = cluster
        self.plan: ClusterPlan = cluster.plan
        self.api = api
        self.min_sync_period = min_sync_period
        self.sync_period = sync_period
        self.agents: dict[str, Agent] = {}
        self.starts: dict[str, int] = {n.name: 0 for n in self.plan.nodes}
        self._clients: dict[str, Any] = {}
        self._readers: dict[str, NftBackend] = {}
        self._tail = _LogTail()
        self._logger = logging.getLogger("nftproxy")
        self._level = self._logger.level
        self._logger.addHandler(self._tail)
        if self._logger.getEffectiveLevel() > logging.INFO:
            self._logger.setLevel(logging.INFO)  # restored by close()

    # -- agents -------------------------------------------------------------------------

    def config(self, node: str) -> ProxyConfig:
        """What `nftproxy run --node-name N --node-ip IP --cluster-cidr ...` gives."""
        return ProxyConfig(
            node_name=node,
            node_ips=(self.plan.node(node).lan_ipv4,),
            cluster_cidrs=(CLUSTER_CIDR,),
            min_sync_period=self.min_sync_period,
            sync_period=self.sync_period,
            healthz_bind_address=f"0.0.0.0:{scenarios.HEALTHZ_PORT}",
            metrics_bind_address="",
        )

    def start_agent(self, node: str) -> None:
        if node in self.agents:
            raise RuntimeError(f"the agent of {node} is running")
        ns = self.cluster.nodes[node]
        # the API server is on the cluster's LAN: never through an environment proxy
        client: Any = k8s_client.ApiClient(
            configuration=k8s_client.Configuration(host=self.api.url, no_proxy="*")
        )

        def source_factory(handler: ClusterEvents) -> Source:
            return KubeSource(client, handler, node_name=node, backoff_initial=0.1, backoff_max=1.0)

        agent = Agent(
            self.config(node),
            backend=NftBackend(netns=ns),
            source_factory=source_factory,
            registry=CollectorRegistry(),
            conntrack=Conntrack(netns=ns),
            log=logging.getLogger(f"nftproxy.agent.agent.{node}"),
        )
        try:
            netns.run_in(ns, agent.start)  # see the module docstring
        except BaseException:
            agent.stop()
            client.close()
            raise
        self.agents[node] = agent
        self._clients[node] = client
        self.starts[node] += 1

    def stop_agent(self, node: str) -> None:
        agent = self.agents.pop(node)
        agent.stop()
        self._clients.pop(node).close()

    def close(self) -> None:
        for node in list(self.agents):
            self.stop_agent(node)
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        self._logger.removeHandler(self._tail)
        self._logger.setLevel(self._level)

    # -- observing ------------------------------------------------------------------------

    def programmed(self, node: str) -> list[dict[str, Any]]:
        reader = self._readers.get(node)
        if reader is None:
            reader = self._readers[node] = NftBackend(netns=self.cluster.nodes[node])
            reader.start()
        table = self.config(node).table_name
        out = []
        for family in ("ip", "ip6"):
            doc = reader.list_table(family, table)
            if doc is not None:
                out.append(parse_table(doc, family=family, table=table).to_json())
        return out

    def agent_log(self, node: str) -> str:
        # the agents share module loggers: only the agent's own lines name it
        return "\n".join(self._tail.lines)

    def agent_starts(self, node: str) -> int:
        return self.starts[node]

    def probe(
        self,
        who: str,
        proto: str,
        targets: Sequence[tuple[str, int]],
        *,
        count: int = 1,
        timeout: float = 1.0,
    ) -> list[Attempt]:
        return self.cluster.probe_many(who, proto, targets, count=count, timeout=timeout)

    def http_get(self, addr: str, port: int, path: str = "/") -> HttpAnswer:
        return self.cluster.http_get("client", f"http://{addr}:{port}{path}", timeout=2.0)

    def continuous(
        self, proto: str, targets: Sequence[tuple[str, int]], *, timeout: float, interval: float
    ) -> Continuous:
        return self.cluster.continuous("client", proto, targets, timeout=timeout, interval=interval)


@contextlib.contextmanager
def running(plan: ClusterPlan | None = None) -> Iterator[NetnsDriver]:
    """Build the namespace cluster, start the API server in the client's
    namespace with the base objects, and one agent per node; take it all
    down afterwards (agents, API server, namespaces), however it ends."""
    with _cluster.build(plan) as built:
        api = LanApiServer(built.plan.client_ipv4[0], API_PORT)
        netns.run_in(built.client, api.start)  # its socket lives in the client namespace
        try:
            for obj in scenarios.base_objects(built.plan):
                api.apply(obj)
            driver = NetnsDriver(built, api)
            try:
                for node in built.plan.nodes:
                    driver.start_agent(node.name)
                yield driver
            finally:
                driver.close()
        finally:
            api.stop()
