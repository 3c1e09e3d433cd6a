"""The multi-node scenarios, written once against a `Driver`.

Layer: vmtests (test tooling). One job: say what must hold across real
nodes, independent of how the nodes exist. Two drivers run them:
`netns_driver.NetnsDriver` (each node a network namespace with an in-process
Agent; tests/test_multinode.py, CI) and `vm_driver.VmDriver` (each node a VM
running `nftproxy run`; vmtests/run.py --mode vm inside the client VM).

The cluster (nftproxy.tools.sandbox.cluster.plan()): node-a (192.168.56.11, pods
a1 a2 in 10.244.1.0/24), node-b (192.168.56.12, pods b1 b2 in
10.244.2.0/24), the client 192.168.56.20, which also serves the API. Every
pod answers `<pod> peer=<source it saw>`.

Base state (`reset`), namespace `mn`:

| service | ClusterIP | nodePort | policy | endpoints |
|---|---|---|---|---|
| web (http 80/TCP, dns 53/UDP) | 10.96.0.10 | 30080 | Cluster | a1 a2 b1 b2 |
| only-b | 10.96.0.11 | 30081 | Cluster | b1 b2 |
| local (LoadBalancer) | 10.96.0.12 | 30082, health 32082 | eTP=Local | a1 b1 b2 |
| local-a (LoadBalancer) | 10.96.0.13 | 30083, health 32083 | eTP=Local | a1 a2 |

(The LoadBalancers have no ingress address: only their node ports and
health-check node ports are used, as an external load balancer would.)

Scenarios (each starts from the base state and waits until every node's
`nftproxy dump` equals what the API says):

- cross_node_cluster_ip: pods on either node reach the ClusterIP (TCP and
  UDP) and get answers from pods on both nodes; a pod on the other node sees
  the client pod's own address (routed, not masqueraded); the node itself
  (output path) is answered by both nodes, masqueraded to its LAN address.
- nodeport_cross_node: the client on node A's NodePort of only-b is answered
  by node B's pods, masqueraded to node A's LAN address (on node B's own
  NodePort: to B's pod gateway); web's NodePort spreads over both nodes and
  never shows the client's address.
- local_policy: eTP=Local NodePorts answer only with the node's own pods and
  preserve the client's address; a node without local endpoints drops.
- health_check_node_port: healthCheckNodePort answers 200 with the local
  endpoint count where there are local endpoints, 503 where there are none,
  per node; /healthz answers 200 on both nodes.
- node_loses_all_endpoints: every endpoint on node A goes away: A's health
  checks turn 503, its Local NodePort drops (and rejects where the service
  has no endpoints at all), while ClusterIP and Cluster-policy NodePort
  traffic entering at A is forwarded to node B's pods.
- restart_mid_churn: 60 service/endpoint changes; node B's agent is stopped
  after 20 and started again after 40. Both agents converge to the API's
  final state, traffic to every churned service goes only to its current
  endpoints (or is rejected when it has none), and a client probing a stable
  NodePort on both nodes throughout never fails a connection.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from nftproxy.tools.sandbox.cluster import ClusterPlan, HttpAnswer, NodePlan, PodPlan
from nftproxy.tools.sandbox.probe import Attempt, answered_by, errors
from vmtests.apiserver import LanApiServer, k8s

__all__ = [
    "SCENARIOS",
    "Driver",
    "Result",
    "Scenario",
    "ScenarioFailure",
    "base_objects",
    "expected_state",
    "programmed_state",
    "reset",
    "run_scenario",
    "wait_converged",
]

NS = "mn"
WEB_IP, ONLY_B_IP, LOCAL_IP, LOCAL_A_IP = "10.96.0.10", "10.96.0.11", "10.96.0.12", "10.96.0.13"
WEB_PORT, ONLY_B_PORT, LOCAL_PORT, LOCAL_A_PORT = 30080, 30081, 30082, 30083
LOCAL_HC, LOCAL_A_HC = 32082, 32083
HEALTHZ_PORT = 10256
BASE_SERVICES = frozenset({"web", "only-b", "local", "local-a"})


class ScenarioFailure(AssertionError):
    """A scenario's expectation did not hold; the message says which and what was seen."""


class ContinuousProbe(Protocol):
    def start(self) -> ContinuousProbe: ...

    def stop(self, wait: float = 30.0) -> list[Attempt]: ...


class Driver(Protocol):
    """What a scenario needs from a cluster, however it is made."""

    plan: ClusterPlan
    api: LanApiServer
    slow: float
    """Scale for waits: 1 in namespaces, more in emulated VMs. Probe and
    HTTP timeouts given to the driver are namespace seconds: the driver
    scales them by `slow` itself."""

    def probe(
        self,
        who: str,
        proto: str,
        targets: Sequence[tuple[str, int]],
        *,
        count: int = 1,
        timeout: float = 1.0,
    ) -> list[Attempt]:
        """Attempts from "client", a node name (its own stack) or a pod name."""
        ...

    def http_get(self, addr: str, port: int, path: str = "/") -> HttpAnswer:
        """A GET from the client."""
        ...

    def continuous(
        self, proto: str, targets: Sequence[tuple[str, int]], *, timeout: float, interval: float
    ) -> ContinuousProbe:
        """Attempts from the client until stop()."""
        ...

    def stop_agent(self, node: str) -> None: ...

    def start_agent(self, node: str) -> None: ...

    def programmed(self, node: str) -> list[dict[str, Any]]:
        """`nftproxy dump --json` of that node."""
        ...

    def agent_log(self, node: str) -> str:
        """The end of the node agent's log (for failure messages)."""
        ...

    def agent_starts(self, node: str) -> int:
        """How many times an agent was started on that node so far."""
        ...


# --- the cluster's objects ---------------------------------------------------------------


def _service(
    name: str, ip: str, node_port: int, *, udp: bool = False, health: int | None = None
) -> dict[str, Any]:
    ports = [("http", 80, "TCP"), *([("dns", 53, "UDP")] if udp else [])]
    obj: dict[str, Any] = k8s.service(
        name,
        ip,
        ns=NS,
        ports=ports,
        # kube-proxy serves healthCheckNodePort only for LoadBalancer services
        type="LoadBalancer" if health else "NodePort",
        node_ports=[node_port] * len(ports),
        etp="Local" if health else None,
        health_check_node_port=health,
    )
    return obj


def _slice(name: str, pods: Iterable[PodPlan], *, udp: bool = False) -> dict[str, Any]:
    ports = [("http", 8080, "TCP"), *([("dns", 5353, "UDP")] if udp else [])]
    endpoints = [(p.ipv4, p.node) for p in pods]
    obj: dict[str, Any] = k8s.endpoint_slice(name, endpoints, ns=NS, ports=ports, family="IPv4")
    return obj


def base_objects(plan: ClusterPlan) -> list[dict[str, Any]]:
    """Nodes, the four base services and their slices (see the module docstring)."""
    a, b = plan.nodes[0], plan.nodes[1]
    objs: list[dict[str, Any]] = [
        k8s.node(n.name, [n.lan_ipv4], pod_cidrs=[n.pod_cidr]) for n in plan.nodes
    ]
    objs += [
        _service("web", WEB_IP, WEB_PORT, udp=True),
        _slice("web", (*a.pods, *b.pods), udp=True),
        _service("only-b", ONLY_B_IP, ONLY_B_PORT),
        _slice("only-b", b.pods),
        _service("local", LOCAL_IP, LOCAL_PORT, health=LOCAL_HC),
        _slice("local", (a.pods[0], *b.pods)),
        _service("local-a", LOCAL_A_IP, LOCAL_A_PORT, health=LOCAL_A_HC),
        _slice("local-a", a.pods),
    ]
    return objs


def reset(d: Driver) -> float:
    """Back to the base state (churned services removed), then wait until
    every node has programmed it; the seconds that took."""
    for key, obj in d.api.objects("EndpointSlice").items():
        if obj["metadata"]["labels"]["kubernetes.io/service-name"] not in BASE_SERVICES:
            ns, name = key.split("/", 1)
            d.api.delete("EndpointSlice", name, ns)
    for key in d.api.objects("Service"):
        ns, name = key.split("/", 1)
        if name not in BASE_SERVICES:
            d.api.delete("Service", name, ns)
    for obj in base_objects(d.plan):
        current = d.api.get(
            obj["kind"], obj["metadata"]["name"], obj["metadata"].get("namespace", "")
        )
        if current is None or _spec_of(current) != _spec_of(obj):
            d.api.apply(obj)
    return wait_converged(d)


def _spec_of(obj: Mapping[str, Any]) -> Any:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")} | {
        "labels": obj["metadata"].get("labels")
    }


# --- convergence -----------------------------------------------------------------------------

State = dict[str, list[str]]
Notes = dict[str, Any]
"""What a scenario observed, for the run's summary (counts, seconds)."""


def expected_state(api: LanApiServer, node: str) -> State:
    """Per service port ("ns/name:port proto"): the ready endpoints ("ip:port")
    the API holds; for eTP=Local services also `node`'s own ones (key + " local")."""
    slices: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for obj in api.objects("EndpointSlice").values():
        meta = obj["metadata"]
        svc = meta.get("labels", {}).get("kubernetes.io/service-name")
        if svc and obj.get("addressType") == "IPv4":
            slices.setdefault((meta["namespace"], svc), []).append(obj)
    out: State = {}
    for obj in api.objects("Service").values():
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        local_policy = obj["spec"].get("externalTrafficPolicy") == "Local"
        for port in obj["spec"]["ports"]:
            key = f"{ns}/{name}:{port.get('name', '')} {port.get('protocol', 'TCP').lower()}"
            eps: list[str] = []
            local: list[str] = []
            for sl in slices.get((ns, name), []):
                target = next(
                    (p["port"] for p in sl.get("ports", []) if p.get("name") == port.get("name")),
                    None,
                )
                if target is None:
                    continue
                for ep in sl.get("endpoints", []):
                    if ep.get("conditions", {}).get("ready") is False:
                        continue
                    address = f"{ep['addresses'][0]}:{target}"
                    eps.append(address)
                    if ep.get("nodeName") == node:
                        local.append(address)
            out[key] = sorted(eps)
            if local_policy and local:
                out[f"{key} local"] = sorted(local)
    return out


def programmed_state(dump: Sequence[Mapping[str, Any]]) -> State:
    """The same shape as expected_state, read from `nftproxy dump --json` (IPv4 table)."""
    out: State = {}
    for table in dump:
        if table.get("family") != "ip":
            continue
        for svc in table.get("services", []):
            key = f"{svc['service']} {svc['protocol']}"
            out[key] = sorted(f"{e['address']}:{e['port']}" for e in svc.get("endpoints", []))
            local = sorted(f"{e['address']}:{e['port']}" for e in svc.get("local_endpoints", []))
            if local:
                out[f"{key} local"] = local
    return out


def _diff(want: State, got: State) -> str:
    lines = []
    for key in sorted(set(want) | set(got)):
        if want.get(key) != got.get(key):
            lines.append(f"  {key}: want {want.get(key)}, programmed {got.get(key)}")
    return "\n".join(lines[:12]) + (f"\n  ... {len(lines) - 12} more" if len(lines) > 12 else "")


def wait_converged(d: Driver, nodes: Sequence[str] | None = None, timeout: float = 20.0) -> float:
    """Wait until every node's programmed state equals the API's; the seconds it took."""
    names = list(nodes) if nodes is not None else [n.name for n in d.plan.nodes]
    start = time.monotonic()
    deadline = start + timeout * d.slow
    while True:
        pending = {}
        for name in names:
            want = expected_state(d.api, name)
            got = programmed_state(d.programmed(name))
            if want != got:
                pending[name] = _diff(want, got)
        if not pending:
            return time.monotonic() - start
        if time.monotonic() > deadline:
            detail = "\n".join(f"{n}:\n{text}" for n, text in pending.items())
            logs = "\n".join(f"--- {n} agent log:\n{d.agent_log(n)}" for n in pending)
            raise ScenarioFailure(f"not converged after {timeout * d.slow:.0f}s:\n{detail}\n{logs}")
        time.sleep(0.1 * d.slow)


def eventually(
    d: Driver, what: str, check: Callable[[], str | None], timeout: float = 10.0
) -> None:
    """Retry `check` (None: holds, else what was seen) until it holds."""
    deadline = time.monotonic() + timeout * d.slow
    while (seen := check()) is not None:
        if time.monotonic() > deadline:
            raise ScenarioFailure(f"{what}: still {seen} after {timeout * d.slow:.0f}s")
        time.sleep(0.1 * d.slow)


# --- assertions on attempts -----------------------------------------------------------------


def _expect(cond: bool, message: str) -> None:
    if not cond:
        raise ScenarioFailure(message)


def _summary(attempts: Sequence[Attempt]) -> str:
    return f"answered {dict(answered_by(attempts))}, errors {dict(errors(attempts))}"


def _all_answered(attempts: Sequence[Attempt], what: str) -> None:
    _expect(bool(attempts) and all(a.ok for a in attempts), f"{what}: {_summary(attempts)}")


def _answered_by_only(attempts: Sequence[Attempt], pods: Iterable[str], what: str) -> None:
    allowed = set(pods)
    _all_answered(attempts, what)
    stray = set(answered_by(attempts)) - allowed
    _expect(not stray, f"{what}: answered by {sorted(stray)}, allowed {sorted(allowed)}")


def _peers(attempts: Iterable[Attempt], pods: Iterable[str] | None = None) -> Counter[str]:
    wanted = set(pods) if pods is not None else None
    return Counter(a.peer for a in attempts if a.peer and (wanted is None or a.pod in wanted))


def _peers_are(
    attempts: Sequence[Attempt], peer: str, what: str, pods: Iterable[str] | None = None
) -> None:
    seen = _peers(attempts, pods)
    _expect(set(seen) == {peer}, f"{what}: pods saw sources {dict(seen)}, want only {peer}")


def _names(pods: Iterable[PodPlan]) -> list[str]:
    return [p.name for p in pods]


def _nodes_answering(plan: ClusterPlan, attempts: Iterable[Attempt]) -> set[str]:
    pods = plan.pods
    return {pods[name].node for name in answered_by(attempts)}


def _dropped(attempts: Sequence[Attempt], what: str, kind: str = "timeout") -> None:
    _expect(
        bool(attempts) and all(a.error == kind for a in attempts),
        f"{what}: want every attempt to end in {kind!r}, got {_summary(attempts)}",
    )


def _health(
    d: Driver, node: NodePlan, port: int, status: int, local: int
) -> Callable[[], str | None]:
    def check() -> str | None:
        ans = d.http_get(node.lan_ipv4, port, "/")
        if ans.status != status:
            return f"HTTP {ans.status or ans.error} {ans.body[:120]!r}"
        count = ans.json().get("localEndpoints")
        return None if count == local else f"localEndpoints={count}"

    return check


# --- the scenarios ---------------------------------------------------------------------------


def cross_node_cluster_ip(d: Driver) -> Notes:
    notes: Notes = {"reset_s": reset(d)}
    a, b = d.plan.nodes[0], d.plan.nodes[1]
    everyone = {a.name, b.name}
    for src, other in ((a.pods[0], b), (b.pods[1], a)):
        what = f"{src.name} -> web ClusterIP {WEB_IP}:80/tcp"
        attempts = d.probe(src.name, "tcp", [(WEB_IP, 80)], count=40)
        _all_answered(attempts, what)
        _expect(_nodes_answering(d.plan, attempts) == everyone, f"{what}: {_summary(attempts)}")
        _peers_are(attempts, src.ipv4, f"{what} (pods on {other.name})", _names(other.pods))
    what = f"a1 -> web ClusterIP {WEB_IP}:53/udp"
    attempts = d.probe(a.pods[0].name, "udp", [(WEB_IP, 53)], count=30)
    _all_answered(attempts, what)
    _expect(_nodes_answering(d.plan, attempts) == everyone, f"{what}: {_summary(attempts)}")
    _peers_are(attempts, a.pods[0].ipv4, f"{what} (pods on {b.name})", _names(b.pods))
    what = f"{a.name} itself -> web ClusterIP {WEB_IP}:80/tcp"
    attempts = d.probe(a.name, "tcp", [(WEB_IP, 80)], count=30)
    _all_answered(attempts, what)
    _expect(_nodes_answering(d.plan, attempts) == everyone, f"{what}: {_summary(attempts)}")
    _peers_are(attempts, a.lan_ipv4, f"{what} (pods on {b.name})", _names(b.pods))
    return notes


def nodeport_cross_node(d: Driver) -> Notes:
    notes: Notes = {"reset_s": reset(d)}
    a, b = d.plan.nodes[0], d.plan.nodes[1]
    # masquerade takes the address of the interface towards the pod: node A's
    # LAN address when it forwards to node B, node B's pod gateway for its own
    for entry, source in ((a, a.lan_ipv4), (b, b.gateway_ipv4)):
        what = f"client -> {entry.name}:{ONLY_B_PORT} (only-b: pods on {b.name})"
        attempts = d.probe("client", "tcp", [(entry.lan_ipv4, ONLY_B_PORT)], count=20)
        _answered_by_only(attempts, _names(b.pods), what)
        _peers_are(attempts, source, f"{what}, masqueraded")
    what = f"client -> {a.name}:{WEB_PORT} (web: pods on both nodes)"
    attempts = d.probe("client", "tcp", [(a.lan_ipv4, WEB_PORT)], count=40)
    _all_answered(attempts, what)
    _expect(_nodes_answering(d.plan, attempts) == {a.name, b.name}, f"{what}: {_summary(attempts)}")
    _peers_are(attempts, a.lan_ipv4, f"{what} (pods on {b.name})", _names(b.pods))
    _peers_are(attempts, a.gateway_ipv4, f"{what} (pods on {a.name})", _names(a.pods))
    return notes


def local_policy(d: Driver) -> Notes:
    notes: Notes = {"reset_s": reset(d)}
    a, b = d.plan.nodes[0], d.plan.nodes[1]
    client = d.plan.client_ipv4[0]
    # local: a1 on node A, b1 b2 on node B
    for entry, pods in ((a, [a.pods[0].name]), (b, _names(b.pods))):
        what = f"client -> {entry.name}:{LOCAL_PORT} (local, eTP=Local)"
        attempts = d.probe("client", "tcp", [(entry.lan_ipv4, LOCAL_PORT)], count=20)
        _answered_by_only(attempts, pods, what)
        _peers_are(attempts, client, f"{what}, source preserved")
    # local-a: a1 a2 only -- node B has none of its own
    what = f"client -> {a.name}:{LOCAL_A_PORT} (local-a, eTP=Local)"
    attempts = d.probe("client", "tcp", [(a.lan_ipv4, LOCAL_A_PORT)], count=10)
    _answered_by_only(attempts, _names(a.pods), what)
    _peers_are(attempts, client, f"{what}, source preserved")
    what = f"client -> {b.name}:{LOCAL_A_PORT} (local-a, no endpoint on {b.name})"
    attempts = d.probe("client", "tcp", [(b.lan_ipv4, LOCAL_A_PORT)], count=3, timeout=0.5)
    _dropped(attempts, what)
    what = f"{b.pods[0].name} -> local-a ClusterIP (internalTrafficPolicy Cluster)"
    attempts = d.probe(b.pods[0].name, "tcp", [(LOCAL_A_IP, 80)], count=10)
    _answered_by_only(attempts, _names(a.pods), what)
    return notes


def health_check_node_port(d: Driver) -> Notes:
    notes: Notes = {"reset_s": reset(d)}
    a, b = d.plan.nodes[0], d.plan.nodes[1]
    expected = [
        (a, LOCAL_HC, 200, 1),
        (b, LOCAL_HC, 200, len(b.pods)),
        (a, LOCAL_A_HC, 200, len(a.pods)),
        (b, LOCAL_A_HC, 503, 0),
    ]
    for node, port, status, local in expected:
        eventually(d, f"{node.name}:{port} health", _health(d, node, port, status, local))
    for node in (a, b):
        ans = d.http_get(node.lan_ipv4, HEALTHZ_PORT, "/healthz")
        _expect(ans.status == 200, f"{node.name} /healthz: {ans}")
    return notes


def node_loses_all_endpoints(d: Driver) -> Notes:
    notes: Notes = {"reset_s": reset(d)}
    a, b = d.plan.nodes[0], d.plan.nodes[1]
    client = d.plan.client_ipv4[0]
    d.api.apply(_slice("web", b.pods, udp=True))
    d.api.apply(_slice("local", b.pods))
    d.api.apply(_slice("local-a", ()))
    notes["converged_s"] = wait_converged(d)
    for node, port, status, local in (
        (a, LOCAL_HC, 503, 0),
        (b, LOCAL_HC, 200, len(b.pods)),
        (a, LOCAL_A_HC, 503, 0),
        (b, LOCAL_A_HC, 503, 0),
    ):
        eventually(d, f"{node.name}:{port} health", _health(d, node, port, status, local))
    short = 0.5
    what = f"client -> {a.name}:{LOCAL_PORT} (local, no endpoint left on {a.name})"
    _dropped(d.probe("client", "tcp", [(a.lan_ipv4, LOCAL_PORT)], count=3, timeout=short), what)
    what = f"client -> {a.name}:{LOCAL_A_PORT} (local-a, no endpoints at all)"
    _dropped(
        d.probe("client", "tcp", [(a.lan_ipv4, LOCAL_A_PORT)], count=3, timeout=short),
        what,
        kind="refused",
    )
    what = f"client -> {b.name}:{LOCAL_PORT} (local)"
    attempts = d.probe("client", "tcp", [(b.lan_ipv4, LOCAL_PORT)], count=10)
    _answered_by_only(attempts, _names(b.pods), what)
    _peers_are(attempts, client, f"{what}, source preserved")
    what = f"{a.pods[0].name} -> web ClusterIP (endpoints only on {b.name})"
    attempts = d.probe(a.pods[0].name, "tcp", [(WEB_IP, 80)], count=20)
    _answered_by_only(attempts, _names(b.pods), what)
    _peers_are(attempts, a.pods[0].ipv4, what)
    what = f"client -> {a.name}:{WEB_PORT} (web, endpoints only on {b.name})"
    attempts = d.probe("client", "tcp", [(a.lan_ipv4, WEB_PORT)], count=20)
    _answered_by_only(attempts, _names(b.pods), what)
    _peers_are(attempts, a.lan_ipv4, f"{what}, masqueraded")
    reset(d)  # and node A comes back
    eventually(d, f"{a.name}:{LOCAL_HC} health again", _health(d, a, LOCAL_HC, 200, 1))
    return notes


def _churn_ip(k: int) -> str:
    return f"10.96.1.{k + 1}"


def _churn(d: Driver, rng: random.Random, services: int) -> None:
    """One change: re-create, re-point or delete one of `services` services."""
    k = rng.randrange(services)
    name = f"churn{k}"
    roll = rng.random()
    if roll < 0.15:
        for kind, key in (("EndpointSlice", f"{name}-ipv4"), ("Service", name)):
            if d.api.get(kind, key, NS) is not None:
                d.api.delete(kind, key, NS)
        return
    if roll < 0.4 or d.api.get("Service", name, NS) is None:
        d.api.apply(_service(name, _churn_ip(k), 31000 + k))
    pods = list(d.plan.pods.values())
    d.api.apply(_slice(name, rng.sample(pods, rng.randrange(len(pods) + 1))))


def restart_mid_churn(d: Driver, *, steps: int = 60, services: int = 8, seed: int = 7) -> Notes:
    notes: Notes = {"reset_s": reset(d), "changes": steps, "restarted": d.plan.nodes[1].name}
    a, b = d.plan.nodes[0], d.plan.nodes[1]
    rng = random.Random(seed)
    pace = 0.05 * d.slow
    starts = d.agent_starts(b.name)
    targets = [(a.lan_ipv4, WEB_PORT), (b.lan_ipv4, WEB_PORT)]
    down = False
    probe = d.continuous("tcp", targets, timeout=1.0, interval=0.02).start()
    try:
        for step in range(steps):
            if step == steps // 3:
                d.stop_agent(b.name)
                down = True
            if step == 2 * steps // 3:
                d.start_agent(b.name)
                down = False
            _churn(d, rng, services)
            time.sleep(pace)
        took = wait_converged(d, timeout=30.0)
    finally:
        steady = probe.stop()
        if down:  # failed half-way: leave the next scenario a running agent
            d.start_agent(b.name)
    _all_answered(steady, "client -> web NodePort on both nodes during churn and restart")
    _expect(len(steady) >= 10, f"too few steady-traffic attempts: {len(steady)}")
    _expect(
        d.agent_starts(b.name) == starts + 1,
        f"{b.name}'s agent was started {d.agent_starts(b.name) - starts} times, want once",
    )
    # every churned service now goes exactly where the API says, from both nodes
    wanted: dict[str, set[str]] = {}
    for key, obj in d.api.objects("Service").items():
        name = key.split("/", 1)[1]
        if name.startswith("churn"):
            ips = {
                ep["addresses"][0]
                for ep in (d.api.get("EndpointSlice", f"{name}-ipv4", NS) or {}).get(
                    "endpoints", []
                )
            }
            wanted[obj["spec"]["clusterIP"]] = {
                p.name for p in d.plan.pods.values() if p.ipv4 in ips
            }
    _expect(bool(wanted), "the churn left no service behind")
    for src in (b.pods[0], a.pods[0]):
        attempts = d.probe(src.name, "tcp", [(ip, 80) for ip in sorted(wanted)], count=6)
        for ip, pods in sorted(wanted.items()):
            mine = [x for x in attempts if x.target == f"{ip}:80"]
            what = f"{src.name} -> {ip}:80 after churn (converged in {took:.1f}s)"
            if pods:
                _answered_by_only(mine, pods, what)
            else:
                _dropped(mine, what, kind="refused")
    notes.update(
        converged_s=took,
        steady_attempts=len(steady),
        churned_services=len(wanted),
    )
    return notes


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    run: Callable[[Driver], Notes]
    doc: str


@dataclass
class Result:
    name: str
    ok: bool
    seconds: float
    notes: Notes
    error: str = ""


class _Counting:
    """A Driver that counts the connection attempts of the probes it runs."""

    def __init__(self, inner: Driver) -> None:
        self.inner = inner
        self.plan = inner.plan
        self.api = inner.api
        self.slow = inner.slow
        self.attempts = 0

    def probe(
        self,
        who: str,
        proto: str,
        targets: Sequence[tuple[str, int]],
        *,
        count: int = 1,
        timeout: float = 1.0,
    ) -> list[Attempt]:
        out = self.inner.probe(who, proto, targets, count=count, timeout=timeout)
        self.attempts += len(out)
        return out

    def http_get(self, addr: str, port: int, path: str = "/") -> HttpAnswer:
        return self.inner.http_get(addr, port, path)

    def continuous(
        self, proto: str, targets: Sequence[tuple[str, int]], *, timeout: float, interval: float
    ) -> ContinuousProbe:
        return self.inner.continuous(proto, targets, timeout=timeout, interval=interval)

    def stop_agent(self, node: str) -> None:
        self.inner.stop_agent(node)

    def start_agent(self, node: str) -> None:
        self.inner.start_agent(node)

    def programmed(self, node: str) -> list[dict[str, Any]]:
        return self.inner.programmed(node)

    def agent_log(self, node: str) -> str:
        return self.inner.agent_log(node)

    def agent_starts(self, node: str) -> int:
        return self.inner.agent_starts(node)


def run_scenario(scenario: Scenario, d: Driver) -> Result:
    """Run one scenario; its outcome, never an exception (but Ctrl-C)."""
    counting = _Counting(d)
    start = time.monotonic()
    try:
        notes = scenario.run(counting)
    except Exception as exc:
        kind = "" if isinstance(exc, ScenarioFailure) else f"{type(exc).__name__}: "
        notes = {"probe_attempts": counting.attempts}
        return Result(scenario.name, False, time.monotonic() - start, notes, f"{kind}{exc}")
    notes = {k: round(v, 2) if isinstance(v, float) else v for k, v in notes.items()}
    notes["probe_attempts"] = counting.attempts
    return Result(scenario.name, True, time.monotonic() - start, notes)


SCENARIOS: tuple[Scenario, ...] = tuple(
    Scenario(fn.__name__, fn, (fn.__doc__ or "").strip())
    for fn in (
        cross_node_cluster_ip,
        nodeport_cross_node,
        local_policy,
        health_check_node_port,
        node_loses_all_endpoints,
        restart_mid_churn,
    )
)
