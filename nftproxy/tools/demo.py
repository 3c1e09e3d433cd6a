"""`nftproxy demo`: the real agent on a sample cluster, proven by traffic.

Layer: demo (below cli, its only caller; above agent, sandbox, dump and
demo_report, which it wires together). One job: build a throwaway node in network
namespaces (nftproxy.tools.sandbox: one node, three pods running the sandbox
backends, one external client), run the real `Agent` on it -- NftBackend and
conntrack cleanup bound to the node namespace, the file source watching the
cluster file -- then send traffic from the client to every service path in
the file and print, per service port, who answered how often, which source
the pod saw (preserved or masqueraded), or how it failed (reject, drop),
followed by `nftproxy dump` of the live table (which paths to try and how
to describe what they did is demo_report.py). Without `once` it keeps
running: every edit of the file that re-programs the rules is followed by a
new traffic report. The sandbox is removed on every exit path (the caller
turns SIGINT / SIGTERM into `stop`).

Where things run:
- the agent is started from a thread that entered the node namespace, and
  every thread it starts inherits that namespace: /healthz (0.0.0.0:10256),
  /metrics (127.0.0.1:10249) and the healthCheckNodePort servers listen
  inside the node namespace, as on a real node, and never on the host;
- conntrack sysctls are not applied (nf_conntrack_max and the hash size are
  host-wide);
- traffic only flows between the sandbox's namespaces.

The sandbox's pods are fixed (PODS below; the sample cluster's endpoints):
an endpoint address added to the file that no pod has gets no answer.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TextIO

from nftproxy.agent.agent import Agent, ConntrackEdge, Source
from nftproxy.agent.report import SyncReport
from nftproxy.cluster.events import ClusterEvents
from nftproxy.cluster.file import FileSource, SourceError, WatchedFiles
from nftproxy.cluster.recorder import Recorder
from nftproxy.core.config import ProxyConfig
from nftproxy.core.model import IPFamily
from nftproxy.core.nft.errors import NftError
from nftproxy.core.nft.listing import list_family, live_name
from nftproxy.kernel import netns
from nftproxy.kernel.addresses import AddressWatch
from nftproxy.kernel.libnftables import NftBackend
from nftproxy.tools.demo_report import (
    Addresses,
    Block,
    Check,
    Cluster,
    HealthCheck,
    Result,
    plan,
    render,
)
from nftproxy.tools.dump import parse_table, render_text
from nftproxy.tools.sandbox.addresses import (
    CLUSTER_CIDRS,
    NODE_IPV4,
    NODE_IPV6,
    POD_GATEWAY_IPV4,
    POD_GATEWAY_IPV6,
    PodSpec,
    Spec,
)
from nftproxy.tools.sandbox.probe import ProbeError
from nftproxy.tools.sandbox.topology import Topology, TopologyError, build

__all__ = [
    "PODS",
    "SAMPLE",
    "load_cluster",
    "run_checks",
    "run_demo",
]

SAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cluster.yaml"
"""The embedded sample cluster (copied to a temporary file for each demo)."""

PODS = (
    PodSpec("web-0", "10.244.0.11", "fd00:244::11", node_name="demo-node"),
    PodSpec("web-1", "10.244.0.12", "fd00:244::12", node_name="demo-node"),
    PodSpec("web-2", "10.244.1.13", "fd00:244:1::13", node_name="other-node"),
)
"""The sandbox's pods: the sample's endpoints. "Remote" ones are wired to
this node like the others; only their EndpointSlices call them remote."""

ATTEMPTS = 20
"""Connections (or datagrams) per path when the path answers."""
FIRST_ATTEMPTS = 3
"""Tried first on every path with a short timeout: a drop costs only these."""
FIRST_TIMEOUT = 0.5
TIMEOUT = 2.0
FIRST_SYNC_TIMEOUT = 30.0
_WORKERS = 8
_UNCHANGED_AFTER = 3.0
"""An edit that changes no rule is reported after this long (seconds)."""

_log = logging.getLogger(__name__)


class DemoError(Exception):
    """The demo cannot go on; the message is one line."""


# --- what the agent did ----------------------------------------------------------------


class _Syncs:
    """A post-commit hook: how many syncs committed, and the last report."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.last: SyncReport | None = None

    def __call__(self, report: SyncReport) -> None:
        with self._lock:
            self.count += 1
            self.last = report

    def snapshot(self) -> tuple[int, SyncReport | None]:
        with self._lock:
            return self.count, self.last


# --- sending traffic ----------------------------------------------------------------------


def run_checks(
    topo: Topology, blocks: Sequence[Block], stop: threading.Event
) -> tuple[dict[Check, Result], dict[HealthCheck, str]]:
    """Try every path (in parallel): FIRST_ATTEMPTS with a short timeout,
    then, where anything answered, the rest of ATTEMPTS."""
    checks = list(dict.fromkeys(c for b in blocks for c in b.checks))
    healths = list(dict.fromkeys(b.health for b in blocks if b.health is not None))
    results: dict[Check, Result] = {}
    with ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="demo-probe") as pool:
        health_futures = {h: pool.submit(_health, topo, h) for h in healths}
        first = {c: pool.submit(_probe, topo, c, FIRST_ATTEMPTS, FIRST_TIMEOUT, stop)
                 for c in checks}
        for c, future in first.items():
            results[c] = future.result()
        more = {
            c: pool.submit(_probe, topo, c, ATTEMPTS - FIRST_ATTEMPTS, TIMEOUT, stop)
            for c, r in results.items()
            if any(a.ok for a in r.attempts)
        }
        for c, future in more.items():
            extra = future.result()
            results[c] = Result(c, results[c].attempts + extra.attempts,
                                results[c].skipped or extra.skipped)
        health = {h: f.result() for h, f in health_futures.items()}
    return results, health


def _probe(topo: Topology, check: Check, count: int, timeout: float,
           stop: threading.Event) -> Result:
    if stop.is_set():
        return Result(check, skipped="stopped")
    if check.proto == "sctp" and topo.sctp_unsupported is not None:
        return Result(check, skipped=f"not run: no SCTP in this kernel ({topo.sctp_unsupported})")
    try:
        attempts = topo.probe("client", check.proto, check.addr, check.port,
                              count=count, src=check.src, timeout=timeout)
    except (ProbeError, OSError) as exc:
        return Result(check, skipped=f"probe failed: {exc}")
    return Result(check, tuple(attempts))


def _health(topo: Topology, check: HealthCheck) -> str:
    def get() -> str:
        conn = http.client.HTTPConnection(check.addr, check.port, timeout=TIMEOUT)
        try:
            conn.request("GET", "/")
            resp = conn.getresponse()
            body = resp.read().decode(errors="replace")
        except OSError as exc:
            return f"no answer: {_error_text(exc)}"
        finally:
            conn.close()
        try:
            local = json.loads(body).get("localEndpoints")
        except (ValueError, AttributeError):
            local = None
        return f"HTTP {resp.status}, localEndpoints {local}"

    try:
        return netns.run_in(topo.client, get)
    except OSError as exc:
        return f"not checked: {exc}"


def _error_text(exc: OSError) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    return exc.strerror or type(exc).__name__


# --- the demo ---------------------------------------------------------------------------


def _addresses(topo: Topology) -> Addresses:
    pods: dict[str, str] = {}
    for pod in topo.pods.values():
        pods[pod.ipv4] = pod.name
        if pod.ipv6:
            pods[pod.ipv6] = pod.name
    return Addresses(
        node={IPFamily.IPV4: NODE_IPV4, IPFamily.IPV6: NODE_IPV6},
        clients={IPFamily.IPV4: topo.spec.client_ipv4, IPFamily.IPV6: topo.spec.client_ipv6},
        pods=pods,
        gateways=frozenset({POD_GATEWAY_IPV4, POD_GATEWAY_IPV6}),
    )


@contextlib.contextmanager
def _editable_copy(source: Path) -> Iterator[Path]:
    """A copy of `source` in a fresh temporary directory (removed afterwards),
    owned by the sudo caller when there is one, so they can edit it."""
    tmp = Path(tempfile.mkdtemp(prefix="nftproxy-demo-"))
    try:
        path = tmp / source.name
        shutil.copyfile(source, path)
        uid, gid = os.environ.get("SUDO_UID", ""), os.environ.get("SUDO_GID", "")
        if uid.isdigit() and gid.isdigit():
            with contextlib.suppress(OSError):
                os.chown(tmp, int(uid), int(gid))
                os.chown(path, int(uid), int(gid))
        yield path
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _conntrack(node: str) -> ConntrackEdge | None:
    try:
        from nftproxy.kernel.conntrack import Conntrack
    except ImportError as exc:
        _log.warning("conntrack cleanup unavailable: %s", exc)
        return None
    return Conntrack(netns=node)


def _pending(agent: Agent) -> int:
    return sum(agent.proxier.pending_changes())


def _sync_text(report: SyncReport | None) -> str:
    if report is None:
        return "?"
    kind = "full" if report.full else "partial"
    return f"{kind} sync, {report.ops} commands in {report.total_seconds * 1000:.0f} ms"


class _Demo:
    """One demo run: the sandbox, the agent, and the reports."""

    def __init__(self, config: ProxyConfig, path: Path, out: TextIO,
                 stop: threading.Event) -> None:
        self.config = config
        self.path = path
        self.out = out
        self.stop = stop
        self.syncs = _Syncs()
        self.recorder: Recorder | None = None

    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def source_factory(self, handler: ClusterEvents) -> Source:
        self.recorder = Recorder(handler, stamp=lambda: self.syncs.snapshot()[0])
        return WatchedFiles(FileSource([self.path], self.recorder,
                                       node_name=self.config.node_name))

    def start(self, stack: contextlib.ExitStack) -> tuple[Topology, Agent, NftBackend]:
        try:
            topo = stack.enter_context(build(Spec(PODS)))
        except (TopologyError, OSError, subprocess.SubprocessError) as exc:
            raise DemoError(f"cannot build the sandbox: {exc}") from exc
        agent = Agent(
            self.config,
            backend=NftBackend(netns=topo.node),
            source_factory=self.source_factory,
            conntrack=_conntrack(topo.node),
            host_addresses=AddressWatch(netns=topo.node),
            hooks=[self.syncs],
        )
        stack.callback(agent.stop)
        # Threads inherit the namespace of the thread that starts them: the
        # runner, the health and metrics servers all live in the node.
        netns.run_in(topo.node, agent.start)
        reader = stack.enter_context(NftBackend(netns=topo.node))
        deadline = time.monotonic() + FIRST_SYNC_TIMEOUT
        # the agent's own hook sets `synced`; ours (the banner's report) runs after it
        while not agent.synced.is_set() or self.syncs.snapshot()[0] == 0:
            if self.stop.wait(0.05):
                return topo, agent, reader
            if time.monotonic() > deadline:
                raise DemoError(f"the agent did not sync within {FIRST_SYNC_TIMEOUT:.0f}s "
                                "(see the log above)")
        return topo, agent, reader

    def banner(self, topo: Topology) -> None:
        s = topo.spec
        self.say("nftproxy demo: a node, three pods and a client, each in a network namespace")
        servers = ", ".join(
            f"{what} {address}" for what, address in (
                ("/healthz", self.config.healthz_bind_address),
                ("/metrics", self.config.metrics_bind_address),
            ) if address
        )
        self.say(f"  node    {topo.node}: {NODE_IPV4}, {NODE_IPV6}")
        self.say(f"          holds nftproxy's tables and the agent's servers: {servers}"
                 if servers else "          holds nftproxy's tables")
        for pod in topo.pods.values():
            self.say(f"  pod     {pod.name}: {pod.ipv4}, {pod.ipv6} (on {pod.node_name} "
                     "in the sample)")
        self.say(f"  client  {', '.join((*s.client_ipv4, *s.client_ipv6))}")
        ports = [f"TCP {p}" for p in s.tcp_ports] + [f"UDP {p}" for p in s.udp_ports]
        if topo.sctp_unsupported is None:
            ports += [f"SCTP {p}" for p in s.sctp_ports]
        self.say(f"  every pod answers {', '.join(ports)} with its name and the source it saw")
        _count, report = self.syncs.snapshot()
        self.say(f"agent: node {self.config.node_name or '(none)'}, source {self.path}; "
                 f"first sync: {_sync_text(report)}")

    def traffic(self, topo: Topology) -> bool:
        """Print one traffic report; False if stopped meanwhile."""
        assert self.recorder is not None
        sandbox = _addresses(topo)
        blocks = plan(_cluster(self.recorder, self.config.node_name), sandbox)
        results, health = run_checks(topo, blocks, self.stop)
        if self.stop.is_set():
            return False
        self.say()
        self.say(f"== traffic from the client: {FIRST_ATTEMPTS} attempts per path "
                 f"({FIRST_TIMEOUT} s timeout), {ATTEMPTS} where it answers ==")
        self.say(render(blocks, results, health, sandbox))
        return True

    def dump(self, reader: NftBackend) -> None:
        self.say()
        self.say("== nftproxy dump: the live table, read back from the node namespace ==")
        views = []
        table = live_name(reader.list_table_objects, self.config.table_name)
        for family in ("ip", "ip6"):
            doc = list_family(reader.list_table, family, table)
            if doc is not None:
                views.append(render_text(parse_table(doc, family=family, table=table)))
        self.say("\n".join(views) if views else "(no table)")

    def follow(self, topo: Topology, agent: Agent) -> None:
        """Until stopped: once each edit of the file has been synced, report again."""
        assert self.recorder is not None
        seen, _ = self.recorder.marker()
        noticed = 0.0
        while not self.stop.wait(0.2):
            changes, syncs_before = self.recorder.marker()
            if changes == seen:
                continue
            noticed = noticed or time.monotonic()
            count, report = self.syncs.snapshot()
            synced = count > syncs_before
            if _pending(agent) or not (synced or time.monotonic() - noticed > _UNCHANGED_AFTER):
                continue  # not programmed yet
            seen, noticed = changes, 0.0
            what = f"re-programmed ({_sync_text(report)})" if synced else "no rule changed"
            self.say()
            self.say(f"== {self.path} changed: {what} ==")
            if not self.traffic(topo):
                return
            self.say()
            self.say(f"edit {self.path} to re-program; Ctrl-C stops and removes the sandbox")


def load_cluster(path: Path, node_name: str = "") -> Cluster:
    """The objects of one cluster file, for `node_name` (default: the file's
    only Node). SourceError if the file is missing or malformed."""
    recorder = Recorder()
    source = FileSource([path], recorder, node_name=node_name)
    source.load()
    return _cluster(recorder, node_name or source.chosen_node_name)


def _cluster(recorder: Recorder, node_name: str) -> Cluster:
    recorded = recorder.snapshot()
    return Cluster(recorded.services, recorded.slices, node_name)


def _silence(out: TextIO) -> None:
    """Point `out` at /dev/null, so flushing it at exit raises no second error."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, out.fileno())
        os.close(devnull)


def run_demo(
    config: ProxyConfig,
    *,
    source: str | None,
    once: bool,
    stop: threading.Event,
    out: TextIO = sys.stdout,
) -> int:
    """The whole demo; 0 when it ran (or was stopped), 1 on failure. The
    sandbox and the temporary copy are removed before this returns."""
    try:
        with contextlib.ExitStack() as stack:
            path = Path(source) if source else stack.enter_context(_editable_copy(SAMPLE))
            config = replace(
                config,
                node_name=load_cluster(path, config.node_name).node_name,
                cluster_cidrs=config.cluster_cidrs or CLUSTER_CIDRS,
            )
            demo = _Demo(config, path, out, stop)
            topo, agent, reader = demo.start(stack)
            if stop.is_set():
                return 0
            demo.banner(topo)
            if not demo.traffic(topo):
                return 0
            demo.dump(reader)
            if once:
                return 0
            demo.say()
            demo.say(f"edit {path} to re-program; Ctrl-C stops and removes the sandbox")
            demo.say(f"(the table: sudo ip netns exec {topo.node} "
                     f"{sys.executable} -m nftproxy dump)")
            demo.follow(topo, agent)
            return 0
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly
        _silence(out)
        return 0
    except (DemoError, SourceError, NftError, ProbeError, OSError) as exc:
        if stop.is_set():  # interrupted half-way: not a failure
            return 0
        print(f"nftproxy: demo: {exc}", file=sys.stderr)
        return 1
    finally:
        if stop.is_set():
            print("nftproxy demo: stopped; sandbox removed", file=sys.stderr)
