"""A one-node cluster in network namespaces: node, pods, external client.

Layer: edge (test, bench and demo tooling; uses nftproxy.kernel.netns and `ip`).
One job: build the namespaces of a `Spec`, hand back a `Topology` that
knows every name and address, and remove all of it afterwards -- on
success, on exceptions and on Ctrl-C (`build` is a context manager).

    client (eth0) ==veth== (ext0) node (vpN) ==veth== (eth0) pod N
                                       (cbr0 + vpN) ==veth== (eth0) bridged pod

- node: ip_forward and IPv6 forwarding on, rp_filter off, ICMP rate limits
  off (the per-host limiter swallows the forwarded-path port-unreachable of
  a REJECT otherwise; nft-python-notes.md §3); addresses NODE_IPV4/IPV6 and
  a second pair NODE_ALT_IPV4/IPV6 on ext0; default routes towards the
  client, so node-originated (output path) traffic to service VIPs has a
  route. nftproxy's tables go here (NftBackend(netns=topology.node)).
- pods: each its own namespace and veth; no bridge by default. The node side
  of every pod veth carries POD_GATEWAY_IPV4/IPV6 as /32 and /128 and a host
  route to the pod; the pod has its /32 and /128 and a default route via that
  gateway. So a masqueraded connection reaches the pod from the gateway
  address, and an unmasqueraded one from the client's own address. Pods
  with `bridge=True` sit on bridge BRIDGE instead (BridgeInterface detection;
  gateway BRIDGE_IPV4/IPV6 on the bridge, ports in hairpin mode as kubelet
  sets them, bridge-nf-call-ip(6)tables on where br_netfilter exists).
  A pod's `node_name` is only what EndpointSlices should say: "remote" pods
  are wired exactly like local ones.
- client: CLIENT addresses (extra ones in the spec, e.g. for session
  affinity or loadBalancerSourceRanges), routes to the service, LB and
  alternate node ranges via the node.
- every pod runs `nftproxy.tools.sandbox.backends` on the spec's ports.

The addresses named here and the Spec/Pod values live in sandbox/addresses.py
(re-exported from this module).

Namespaces are named `nftpx-<role>-<pid>-<hex>` (as netns.temporary), so the
test session's leak check recognises them. Only addresses inside these
namespaces are ever used; nothing touches the host's network.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import selectors
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from nftproxy.kernel import netns
from nftproxy.tools.sandbox import probe as _probe
from nftproxy.tools.sandbox.addresses import (
    BRIDGE,
    BRIDGE_IPV4,
    BRIDGE_IPV6,
    LB_RANGES,
    NODE_ALT_IPV4,
    NODE_ALT_IPV6,
    NODE_IPV4,
    NODE_IPV6,
    POD_GATEWAY_IPV4,
    POD_GATEWAY_IPV6,
    SERVICE_RANGES,
    Pod,
    Spec,
)

# Re-exported: tests, bench and vmtests take the whole address plan from here.
from nftproxy.tools.sandbox.addresses import CLIENT_IPV4 as CLIENT_IPV4
from nftproxy.tools.sandbox.addresses import CLIENT_IPV6 as CLIENT_IPV6
from nftproxy.tools.sandbox.addresses import CLUSTER_CIDRS as CLUSTER_CIDRS
from nftproxy.tools.sandbox.addresses import NODE_NAME as NODE_NAME
from nftproxy.tools.sandbox.addresses import REMOTE_NODE_NAME as REMOTE_NODE_NAME
from nftproxy.tools.sandbox.addresses import PodSpec as PodSpec
from nftproxy.tools.sandbox.addresses import default_pods as default_pods
from nftproxy.tools.sandbox.backends import sctp_support

__all__ = [
    "COMMON_SYSCTLS",
    "NODE_SYSCTLS",
    "Namespaces",
    "Topology",
    "TopologyError",
    "build",
    "ip_batch",
    "new_namespace",
    "start_backend",
    "stop_process",
    "sysctls",
    "wait_ready",
]

_ROUTED_VIA_NODE = (*SERVICE_RANGES, *LB_RANGES, "192.168.51.0/24", "fd00:51::/64")
_SUBPROCESS_TIMEOUT = 20.0
_READY_TIMEOUT = 20.0


class TopologyError(RuntimeError):
    """The sandbox could not be built (namespaces, links or backends)."""


class Namespaces:
    """Helpers that act in a sandbox's namespaces, shared by the one-node
    Topology and the multi-node sandbox.cluster.Cluster; subclasses say
    which namespace each role or pod is in."""

    def ns(self, who: str) -> str:
        raise NotImplementedError

    def probe_many(
        self,
        who: str,
        proto: str,
        targets: Sequence[tuple[str, int]],
        *,
        count: int = 1,
        src: str | Sequence[str] | None = None,
        timeout: float = 1.0,
    ) -> list[_probe.Attempt]:
        """Several targets from one probe process (one process start)."""
        return _probe.run(self.ns(who), proto, targets, count=count, src=src, timeout=timeout)

    def continuous(
        self,
        who: str,
        proto: str,
        targets: Sequence[tuple[str, int]],
        *,
        src: str | Sequence[str] | None = None,
        timeout: float = 1.0,
        interval: float = 0.0,
    ) -> _probe.Continuous:
        """A probe that runs until its `stop()`; use as a context manager."""
        return _probe.Continuous(
            self.ns(who), proto, targets, src=src, timeout=timeout, interval=interval
        )

    def run(self, who: str, argv: Sequence[str]) -> str:
        """Run a command in `who`'s namespace; its stdout (raises on failure)."""
        out: str = netns.exec_in(self.ns(who), list(argv), timeout=_SUBPROCESS_TIMEOUT).stdout
        return out


@dataclass
class Topology(Namespaces):
    """Names and addresses of a built sandbox, plus helpers that act in it."""

    spec: Spec
    node: str
    """The node's namespace name."""
    client: str
    pods: dict[str, Pod]
    sctp_unsupported: str | None = None
    """None if SCTP works in this kernel, else why not (the SCTP backends are
    then not started)."""

    def ns(self, who: str) -> str:
        """Namespace of "node", "client" or a pod name."""
        if who == "node":
            return self.node
        if who == "client":
            return self.client
        try:
            return self.pods[who].netns
        except KeyError:
            raise KeyError(f"no pod or role {who!r} in this topology") from None

    def probe(
        self,
        who: str,
        proto: str,
        addr: str,
        port: int,
        *,
        count: int = 1,
        src: str | Sequence[str] | None = None,
        timeout: float = 1.0,
        interval: float = 0.0,
        sport: int = 0,
    ) -> list[_probe.Attempt]:
        """`count` attempts from `who` ("client", "node" or a pod) to addr:port
        (from each of `src` if given; from source port `sport` if non-zero)."""
        return _probe.run(
            self.ns(who),
            proto,
            [(addr, port)],
            count=count,
            src=src,
            timeout=timeout,
            interval=interval,
            sport=sport,
        )

    def flush_conntrack(self) -> None:
        """Forget every flow the node tracks (both families), so state left
        by one test (a UDP flow's DNAT, say) cannot answer for the next."""
        netns.run_in(self.node, _flush_conntrack)


def _flush_conntrack() -> None:
    import socket

    from pyroute2.conntrack import Conntrack

    for family in (socket.AF_INET, socket.AF_INET6):
        ct = Conntrack(nfgen_family=family)
        try:
            ct.flush()
        finally:
            ct.close()


# --- building ------------------------------------------------------------------


def ip_batch(ns: str, commands: Sequence[str]) -> None:
    """Run `ip` commands in one process (`ip -n NS -batch -`); the first
    failing command aborts the batch and names itself."""
    text = "\n".join(commands) + "\n"
    proc = subprocess.run(
        ["ip", "-n", ns, "-batch", "-"],
        input=text,
        capture_output=True,
        text=True,
        check=False,
        timeout=_SUBPROCESS_TIMEOUT,
    )
    if proc.returncode != 0:
        raise TopologyError(f"ip -n {ns}: {proc.stderr.strip() or proc.returncode}")


def sysctls(ns: str, values: Mapping[str, str | int]) -> None:
    """Write net.* sysctls inside `ns` (one thread that entered it); keys in
    _OPTIONAL_SYSCTLS are skipped where the kernel lacks them."""

    def write() -> None:
        for key, value in values.items():
            if not key.startswith("net."):
                raise ValueError(f"sysctl {key!r} is not per network namespace")
            path = Path("/proc/sys", *key.split("."))
            if key in _OPTIONAL_SYSCTLS and not path.exists():
                continue
            path.write_text(f"{value}\n")

    netns.run_in(ns, write)


COMMON_SYSCTLS: dict[str, str | int] = {
    # addresses usable at once (DAD would keep them tentative for a second)
    "net.ipv6.conf.all.accept_dad": 0,
    "net.ipv6.conf.default.accept_dad": 0,
}
NODE_SYSCTLS: dict[str, str | int] = {
    **COMMON_SYSCTLS,
    "net.ipv4.ip_forward": 1,
    "net.ipv6.conf.all.forwarding": 1,
    "net.ipv4.conf.all.rp_filter": 0,
    "net.ipv4.conf.default.rp_filter": 0,
    # REJECT answers must not be eaten by the per-host ICMP rate limiter
    "net.ipv4.icmp_ratelimit": 0,
    "net.ipv6.icmp.ratelimit": 0,
    # bridged pods: bridged IP traffic passes the IP hooks, as on a k8s node
    # (br_netfilter); absent when the kernel has no br_netfilter
    "net.bridge.bridge-nf-call-iptables": 1,
    "net.bridge.bridge-nf-call-ip6tables": 1,
}
_OPTIONAL_SYSCTLS = frozenset(
    {"net.bridge.bridge-nf-call-iptables", "net.bridge.bridge-nf-call-ip6tables"}
)


def _node_commands(spec: Spec, client_ns: str, pods: Sequence[Pod]) -> list[str]:
    cmds = [
        f"link add ext0 type veth peer name eth0 netns {client_ns}",
        f"addr add {NODE_IPV4}/24 dev ext0",
        f"addr add {NODE_IPV6}/64 dev ext0 nodad",
        f"addr add {NODE_ALT_IPV4}/32 dev ext0",
        # deprecated: bindable and served, never the node's default source
        f"addr add {NODE_ALT_IPV6}/128 dev ext0 nodad preferred_lft 0",
        "link set ext0 up",
        f"route add default via {spec.client_ipv4[0]} dev ext0",
        f"route add default via {spec.client_ipv6[0]} dev ext0",
    ]
    if any(p.bridge for p in spec.pods):
        cmds += [
            f"link add {BRIDGE} type bridge",
            f"addr add {BRIDGE_IPV4}/24 dev {BRIDGE}",
            f"addr add {BRIDGE_IPV6}/64 dev {BRIDGE} nodad",
            f"link set {BRIDGE} up",
        ]
    for pod, pspec in zip(pods, spec.pods, strict=True):
        cmds.append(f"link add {pod.interface} type veth peer name eth0 netns {pod.netns}")
        if pspec.bridge:
            # hairpin on, as kubelet's hairpin-veth mode does: with br_netfilter a
            # pod's DNATed packet to itself is bridged back out of its own port
            cmds += [
                f"link set {pod.interface} master {BRIDGE}",
                f"link set {pod.interface} type bridge_slave hairpin on",
                f"link set {pod.interface} up",
            ]
            continue
        cmds += [
            f"addr add {POD_GATEWAY_IPV4}/32 dev {pod.interface}",
            f"addr add {POD_GATEWAY_IPV6}/128 dev {pod.interface} nodad",
            f"link set {pod.interface} up",
            f"route add {pod.ipv4}/32 dev {pod.interface}",
        ]
        if pod.ipv6:
            cmds.append(f"route add {pod.ipv6}/128 dev {pod.interface}")
    return cmds


def _pod_commands(pod: Pod, bridged: bool) -> list[str]:
    if bridged:
        cmds = [f"addr add {pod.ipv4}/24 dev eth0", "link set eth0 up"]
        cmds.append(f"route add default via {pod.gateway_ipv4} dev eth0")
        if pod.ipv6:
            cmds += [
                f"addr add {pod.ipv6}/64 dev eth0 nodad",
                f"route add default via {pod.gateway_ipv6} dev eth0",
            ]
        return cmds
    cmds = [
        f"addr add {pod.ipv4}/32 dev eth0",
        "link set eth0 up",
        f"route add {pod.gateway_ipv4}/32 dev eth0 scope link",
        f"route add default via {pod.gateway_ipv4} dev eth0",
    ]
    if pod.ipv6:
        cmds += [
            f"addr add {pod.ipv6}/128 dev eth0 nodad",
            f"route add {pod.gateway_ipv6}/128 dev eth0",
            f"route add default via {pod.gateway_ipv6} dev eth0",
        ]
    return cmds


def _client_commands(spec: Spec) -> list[str]:
    cmds = [f"addr add {ip}/24 dev eth0" for ip in spec.client_ipv4]
    # extra IPv6 sources are deprecated (preferred_lft 0): still usable when
    # bound explicitly, never picked as a default source, like IPv4 secondaries
    v6 = spec.client_ipv6
    cmds += [f"addr add {ip}/64 dev eth0 nodad" for ip in v6[:1]]
    cmds += [f"addr add {ip}/64 dev eth0 nodad preferred_lft 0" for ip in v6[1:]]
    cmds.append("link set eth0 up")
    for dst in _ROUTED_VIA_NODE:
        if ":" in dst:
            cmds.append(f"route add {dst} via {NODE_IPV6} src {spec.client_ipv6[0]}")
        else:
            cmds.append(f"route add {dst} via {NODE_IPV4} src {spec.client_ipv4[0]}")
    return cmds


def start_backend(pod: Pod, spec: Spec, sctp: bool) -> subprocess.Popen[bytes]:
    argv = [
        "ip", "netns", "exec", pod.netns,
        sys.executable, "-m", "nftproxy.tools.sandbox.backends", "--name", pod.name,
    ]  # fmt: skip
    for port in spec.tcp_ports:
        argv += ["--tcp", str(port)]
    for port in spec.udp_ports:
        argv += ["--udp", str(port)]
    if sctp:
        for port in spec.sctp_ports:
            argv += ["--sctp", str(port)]
    return subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_probe.subprocess_env(),
    )


def wait_ready(procs: Mapping[str, subprocess.Popen[bytes]]) -> None:
    """Every backend prints `ready` once bound; fail with its stderr if not."""
    pending = {p.stdout.fileno(): (name, p) for name, p in procs.items() if p.stdout}
    deadline = time.monotonic() + _READY_TIMEOUT
    with selectors.DefaultSelector() as sel:
        for fd in pending:
            sel.register(fd, selectors.EVENT_READ)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                names = sorted(n for n, _ in pending.values())
                raise TopologyError(f"backends not ready after {_READY_TIMEOUT}s: {names}")
            for key, _ in sel.select(left):
                fd = key.fd
                assert isinstance(fd, int)
                name, proc = pending.pop(fd)
                sel.unregister(fd)
                line = os.read(fd, 64)
                if not line.startswith(b"ready"):
                    proc.kill()
                    _, err = proc.communicate(timeout=5)
                    raise TopologyError(f"backend {name} failed: {err.decode().strip()}")


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """End one backend we started: EOF on stdin, then SIGTERM, then SIGKILL."""
    with contextlib.suppress(OSError):
        if proc.stdin:
            proc.stdin.close()
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for stream in (proc.stdout, proc.stderr):
        if stream:
            stream.close()


def new_namespace(stack: contextlib.ExitStack, role: str, token: str) -> str:
    name = f"nftpx-{role}-{os.getpid()}-{token}"
    try:
        netns.create(name)
    except OSError as exc:
        raise TopologyError(f"cannot create network namespace {name}: {exc}") from exc
    stack.callback(_delete_namespace, name)
    return name


def _delete_namespace(name: str) -> None:
    if netns.exists(name):
        netns.delete(name)


@contextlib.contextmanager
def build(spec: Spec) -> Iterator[Topology]:
    """Create everything in `spec`; on leaving (however), stop the backends
    and delete every namespace this call created."""
    names = [p.name for p in spec.pods]
    if len(set(names)) != len(names) or {"node", "client"} & set(names):
        raise ValueError(f"pod names must be unique and not node/client: {names}")
    token = secrets.token_hex(3)
    with contextlib.ExitStack() as stack:
        node = new_namespace(stack, "node", token)
        client = new_namespace(stack, "cli", token)
        pods: list[Pod] = []
        for i, p in enumerate(spec.pods):
            ns = new_namespace(stack, p.name, token)
            gw4, gw6 = (
                (BRIDGE_IPV4, BRIDGE_IPV6) if p.bridge else (POD_GATEWAY_IPV4, POD_GATEWAY_IPV6)
            )
            pods.append(Pod(p.name, ns, p.ipv4, p.ipv6, p.node_name, f"vp{i}", gw4, gw6))
        sysctls(node, NODE_SYSCTLS)
        for ns in (client, *(p.netns for p in pods)):
            sysctls(ns, COMMON_SYSCTLS)
        ip_batch(node, _node_commands(spec, client, pods))
        ip_batch(client, _client_commands(spec))
        for pod, pspec in zip(pods, spec.pods, strict=True):
            ip_batch(pod.netns, _pod_commands(pod, pspec.bridge))
        topo = Topology(spec, node, client, {p.name: p for p in pods})
        if pods:
            topo.sctp_unsupported = netns.run_in(pods[0].netns, sctp_support)
        if spec.backends:
            procs: dict[str, subprocess.Popen[bytes]] = {}
            for pod in pods:
                proc = start_backend(pod, spec, topo.sctp_unsupported is None)
                stack.callback(stop_process, proc)
                procs[pod.name] = proc
            wait_ready(procs)
        yield topo
