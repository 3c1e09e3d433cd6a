"""A small multi-node cluster: nodes on one LAN, pods behind each node, a client.

Layer: edge (test, bench and VM tooling; like `topology`, it imports netns
and the sandbox only, never the proxier). One job: wire the network of a
`ClusterPlan` -- in network namespaces on one machine (`build`), or the pods
of one real node of a VM cluster (`wire_node` on the node's own namespace,
named with `attached`) -- and hand back names, addresses and helpers that
act in it (probes, HTTP GETs). nftproxy itself is not started here: the
callers (vmtests/) run one agent per node.

    client (lan0) --+
    node-a (lan0) --+-- br0 in the "lan" namespace (the LAN switch)
    node-b (lan0) --+
      node N: vpI ==veth== eth0 of pod I (10.244.N.1I/32, default via 10.244.N.1)

The address plan (`plan()`), the same in the VMs (vmtests/Vagrantfile,
vmtests/qemu):

- LAN 192.168.56.0/24 (VirtualBox's host-only default);
- node N (1, 2, ...): 192.168.56.(10+N), pod CIDR 10.244.N.0/24, its
  gateway 10.244.N.1 on every pod veth;
- pod I of node N: 10.244.N.(10+I)/32, named after the node (node-a's pods
  are a1, a2, ...);
- the client: 192.168.56.20 and .21; the API server listens on the first
  (port 6443);
- routes: every node reaches the other nodes' pod CIDRs via their LAN
  addresses, so pod-to-pod and DNATed traffic crosses nodes unmasqueraded,
  and has a default route via the client (node-originated ClusterIP
  traffic needs a route before it is DNATed).

Nodes forward (ip_forward, rp_filter 0, no ICMP rate limit), exactly as
topology's node. Pods run `nftproxy.tools.sandbox.backends` (TCP 8080, UDP 5353)
and answer `<pod> peer=<ip>:<port>`, so a probe sees which pod answered
and whether the node masqueraded (peer = a node address) or not (peer = the
client's or the source pod's own address).

Namespaces are `nftpx-<role>-<pid>-<hex>` (as topology's), so the test
session's leak check recognises them; `build` removes all of them on any
exit. Only addresses inside these namespaces are used.

Known limits: IPv4 only; pods are wired by /32 veths (no bridge).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from nftproxy.kernel import netns
from nftproxy.tools.sandbox import probe as _probe
from nftproxy.tools.sandbox.addresses import Pod, Spec
from nftproxy.tools.sandbox.topology import (
    COMMON_SYSCTLS,
    NODE_SYSCTLS,
    Namespaces,
    TopologyError,
    ip_batch,
    new_namespace,
    start_backend,
    stop_process,
    sysctls,
    wait_ready,
)

__all__ = [
    "API_PORT",
    "CLIENT_IPV4",
    "CLUSTER_CIDR",
    "LAN_CIDR",
    "LAN_DEV",
    "SERVICE_CIDR",
    "Cluster",
    "ClusterPlan",
    "HttpAnswer",
    "NodePlan",
    "PodPlan",
    "attached",
    "build",
    "fetch",
    "plan",
    "start_backends",
    "wire_node",
]

LAN_CIDR = "192.168.56.0/24"
_LAN_PREFIX = "192.168.56."
_LAN_LEN = 24
LAN_DEV = "lan0"
"""The LAN interface of every namespace in `build` (a VM has its own name)."""
CLIENT_IPV4 = ("192.168.56.20", "192.168.56.21")
API_PORT = 6443
"""Where the runner's API server listens, on CLIENT_IPV4[0]."""
CLUSTER_CIDR = "10.244.0.0/16"
SERVICE_CIDR = "10.96.0.0/16"
_SWITCH = "br0"
_SUBPROCESS_TIMEOUT = 20.0


@dataclass(frozen=True, slots=True)
class PodPlan:
    name: str
    node: str
    ipv4: str
    interface: str
    """The node-side veth."""


@dataclass(frozen=True, slots=True)
class NodePlan:
    name: str
    index: int
    lan_ipv4: str
    pod_cidr: str
    gateway_ipv4: str
    """The node's address on every pod veth (what a masqueraded pod peer shows
    for node-local traffic)."""
    pods: tuple[PodPlan, ...]


@dataclass(frozen=True, slots=True)
class ClusterPlan:
    nodes: tuple[NodePlan, ...]
    client_ipv4: tuple[str, ...] = CLIENT_IPV4
    tcp_ports: tuple[int, ...] = (8080,)
    udp_ports: tuple[int, ...] = (5353,)

    def node(self, name: str) -> NodePlan:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(f"no node {name!r} in this plan")

    @property
    def pods(self) -> dict[str, PodPlan]:
        return {p.name: p for n in self.nodes for p in n.pods}

    @property
    def api_url(self) -> str:
        return f"http://{self.client_ipv4[0]}:{API_PORT}"


def plan(nodes: Sequence[str] = ("node-a", "node-b"), pods_per_node: int = 2) -> ClusterPlan:
    """Node N (from 1) is 192.168.56.(10+N) with pods 10.244.N.11.., named
    after the node's last dash-separated part (node-a: a1, a2, ...)."""
    out = []
    for n, name in enumerate(nodes, start=1):
        short = name.rsplit("-", 1)[-1]
        pods = tuple(
            PodPlan(f"{short}{i}", name, f"10.244.{n}.{10 + i}", f"vp{i - 1}")
            for i in range(1, pods_per_node + 1)
        )
        out.append(
            NodePlan(name, n, f"{_LAN_PREFIX}{10 + n}", f"10.244.{n}.0/24", f"10.244.{n}.1", pods)
        )
    if len({p.name for n in out for p in n.pods}) != len(out) * pods_per_node:
        raise ValueError(f"node names must end in distinct parts: {list(nodes)}")
    return ClusterPlan(tuple(out))


# --- wiring (shared by the namespace cluster and a VM node) ----------------------------


def node_commands(
    cluster: ClusterPlan, node: NodePlan, pods: Sequence[Pod], lan_dev: str | None
) -> list[str]:
    """`ip -batch` lines for one node: its LAN address (when `lan_dev` is
    given; a VM's is configured already), routes to the other nodes' pod
    CIDRs, and one /32 veth per pod."""
    cmds: list[str] = []
    if lan_dev is not None:
        cmds += [
            f"addr add {node.lan_ipv4}/{_LAN_LEN} dev {lan_dev}",
            f"link set {lan_dev} up",
            f"route add default via {cluster.client_ipv4[0]} dev {lan_dev}",
        ]
    for other in cluster.nodes:
        if other.name != node.name:
            cmds.append(f"route replace {other.pod_cidr} via {other.lan_ipv4}")
    for pod in pods:
        cmds += [
            f"link add {pod.interface} type veth peer name eth0 netns {pod.netns}",
            f"addr add {pod.gateway_ipv4}/32 dev {pod.interface}",
            f"link set {pod.interface} up",
            f"route add {pod.ipv4}/32 dev {pod.interface}",
        ]
    return cmds


def pod_commands(pod: Pod) -> list[str]:
    return [
        f"addr add {pod.ipv4}/32 dev eth0",
        "link set eth0 up",
        f"route add {pod.gateway_ipv4}/32 dev eth0 scope link",
        f"route add default via {pod.gateway_ipv4} dev eth0",
    ]


def wire_node(
    stack: contextlib.ExitStack,
    cluster: ClusterPlan,
    node: NodePlan,
    node_ns: str,
    *,
    token: str,
    lan_dev: str | None,
) -> dict[str, Pod]:
    """Create `node`'s pod namespaces (deleted by `stack`) and wire them to
    the namespace `node_ns` (a node namespace, or a VM's own, see `attached`);
    set the node's forwarding sysctls and routes. Returns the pods by name."""
    sysctls(node_ns, NODE_SYSCTLS)
    pods: dict[str, Pod] = {}
    for p in node.pods:
        ns = new_namespace(stack, p.name, token)
        sysctls(ns, COMMON_SYSCTLS)
        pods[p.name] = Pod(p.name, ns, p.ipv4, None, node.name, p.interface, node.gateway_ipv4, "")
    ip_batch(node_ns, node_commands(cluster, node, list(pods.values()), lan_dev))
    for pod in pods.values():
        ip_batch(pod.netns, pod_commands(pod))
    return pods


def start_backends(stack: contextlib.ExitStack, pods: Sequence[Pod], cluster: ClusterPlan) -> None:
    """Start every pod's backend (stopped by `stack`) and wait until all are bound."""
    spec = Spec(pods=(), tcp_ports=cluster.tcp_ports, udp_ports=cluster.udp_ports, sctp_ports=())
    procs = {}
    for pod in pods:
        proc = start_backend(pod, spec, sctp=False)
        stack.callback(stop_process, proc)
        procs[pod.name] = proc
    wait_ready(procs)


@contextlib.contextmanager
def attached(name: str) -> Iterator[str]:
    """Give the caller's own network namespace the name `name` (`ip netns
    attach`) for the body, so netns-named helpers (probes, NftBackend,
    wire_node) work on a VM's real network. Removing the name afterwards
    leaves the namespace itself alone."""
    proc = subprocess.run(
        ["ip", "netns", "attach", name, str(os.getpid())],
        capture_output=True,
        text=True,
        check=False,
        timeout=_SUBPROCESS_TIMEOUT,
    )
    if proc.returncode != 0:
        raise TopologyError(f"ip netns attach {name}: {proc.stderr.strip()}")
    try:
        yield name
    finally:
        if netns.exists(name):
            netns.delete(name)


# --- HTTP from inside a namespace ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HttpAnswer:
    """A GET's outcome: the status and body, or an error kind (as probes'
    `timeout`, `refused`, ...) with status None."""

    status: int | None
    body: str = ""
    error: str | None = None

    def json(self) -> dict[str, object]:
        doc = json.loads(self.body)
        if not isinstance(doc, dict):
            raise ValueError(f"not a JSON object: {self.body[:80]!r}")
        return doc


def fetch(url: str, timeout: float = 2.0) -> HttpAnswer:
    """GET `url` from the calling thread's namespace, without any proxy."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as resp:
            return HttpAnswer(resp.status, resp.read().decode(errors="replace"))
    except urllib.error.HTTPError as exc:
        return HttpAnswer(exc.code, exc.read().decode(errors="replace"))
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, BaseException):
            return HttpAnswer(None, error=_probe._error_kind(reason))
        return HttpAnswer(None, error=str(reason))
    except OSError as exc:
        return HttpAnswer(None, error=_probe._error_kind(exc))


# --- the namespace cluster ---------------------------------------------------------------


@dataclass
class Cluster(Namespaces):
    """Names and addresses of a built namespace cluster, plus helpers."""

    plan: ClusterPlan
    lan: str
    """The LAN switch's namespace."""
    nodes: dict[str, str]
    """Node name -> its namespace."""
    client: str
    pods: dict[str, Pod]

    def ns(self, who: str) -> str:
        """Namespace of "client", a node name or a pod name."""
        if who == "client":
            return self.client
        if who in self.nodes:
            return self.nodes[who]
        try:
            return self.pods[who].netns
        except KeyError:
            raise KeyError(f"no node, pod or role {who!r} in this cluster") from None

    def http_get(self, who: str, url: str, timeout: float = 2.0) -> HttpAnswer:
        """GET `url` from `who`'s namespace."""
        return netns.run_in(self.ns(who), fetch, url, timeout)



def _lan_commands(members: Mapping[str, str]) -> list[str]:
    cmds = [f"link add {_SWITCH} type bridge", f"link set {_SWITCH} up"]
    for i, ns in enumerate(members.values()):
        cmds += [
            f"link add l{i} type veth peer name {LAN_DEV} netns {ns}",
            f"link set l{i} master {_SWITCH}",
            f"link set l{i} up",
        ]
    return cmds


def _client_commands(cluster: ClusterPlan) -> list[str]:
    cmds = [f"addr add {ip}/{_LAN_LEN} dev {LAN_DEV}" for ip in cluster.client_ipv4]
    cmds.append(f"link set {LAN_DEV} up")
    return cmds


@contextlib.contextmanager
def build(cluster: ClusterPlan | None = None, *, backends: bool = True) -> Iterator[Cluster]:
    """Create the namespaces of `cluster` (default `plan()`); on leaving,
    however, stop the backends and delete every namespace this call made."""
    cluster = cluster or plan()
    token = secrets.token_hex(3)
    with contextlib.ExitStack() as stack:
        lan = new_namespace(stack, "lan", token)
        nodes = {n.name: new_namespace(stack, n.name, token) for n in cluster.nodes}
        client = new_namespace(stack, "cli", token)
        sysctls(client, COMMON_SYSCTLS)
        ip_batch(lan, _lan_commands({**nodes, "client": client}))
        ip_batch(client, _client_commands(cluster))
        pods: dict[str, Pod] = {}
        for node in cluster.nodes:
            pods.update(
                wire_node(stack, cluster, node, nodes[node.name], token=token, lan_dev=LAN_DEV)
            )
        if backends:
            start_backends(stack, list(pods.values()), cluster)
        yield Cluster(cluster, lan, nodes, client, pods)
