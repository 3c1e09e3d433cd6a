"""The real agent, started as an operator starts it, timed and measured for bench/.

Layer: bench tooling (not part of the nftproxy package). One job: run
`nftproxy run` (the CLI process, this interpreter) inside a network
namespace against a cluster source -- tests/fakeapi.py's FakeApiServer
(the real list/watch protocol, paged lists, to the real kubernetes client),
listening on the namespace's loopback, or a `kind: List` file given with
`--source` -- and report:

- start_to_commit_s: the parent's clock just before spawning the agent ->
  the agent's own timestamp of its first committed sync
  (`kubeproxy_sync_proxy_rules_last_timestamp_seconds`, set by the
  post-commit hook), read from its /metrics once
  `kubeproxy_sync_full_proxy_rules_duration_seconds_count` is 1: the same
  clock (time.time()), so the poll interval does not blur it. It includes
  interpreter start, imports (of the package's bytecode, compiled before the
  start as the image holds it), connecting, listing every page, the intake
  and the whole first full sync;
- from the same scrape: the full sync's duration, render and commit time,
  ops, the table's chains/rules/sets/elements, the objects the informers
  hold (proof the lists were complete);
- memory of the agent's whole process tree (proctree.TreeSampler: the agent
  and every descendant, summed, every `interval` s): the peak over the run,
  and the steady value `idle` seconds after the commit (kube-proxy's
  "steady RSS (30 s)"); the tree's CPU seconds up to the commit.

The agent runs with kube-proxy's defaults (minSyncPeriod 1 s, syncPeriod
30 s); its health server, metrics server and the service health servers
(one per eTP=Local LoadBalancer) listen inside the namespace. It is
stopped with SIGTERM (SIGKILL after 30 s); its log is kept in `workdir`.
"""

from __future__ import annotations

import compileall
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import benchlib as bl
from fakeapi import FakeApiServer
from pki import make_pki

from nftproxy.kernel import netns

__all__ = ["AgentRun", "ApiCluster", "Launch", "in_cluster", "run_agent", "write_list"]

METRICS = "127.0.0.1:10249"
HEALTHZ = "127.0.0.1:10256"
POLL = 0.25  # s between scrapes until the commit (each costs the agent ~1-2 ms)
STOP_TIMEOUT = 30.0

_FULL_COUNT = "kubeproxy_sync_full_proxy_rules_duration_seconds_count"
_LAST_SYNC = "kubeproxy_sync_proxy_rules_last_timestamp_seconds"


class ApiCluster:
    """A FakeApiServer holding this node and the given objects, loaded once
    and served (`serving`) in one namespace at a time."""

    def __init__(self, services: Sequence[Mapping[str, Any]], slices: Sequence[Mapping[str, Any]]):
        self.server = FakeApiServer()
        self.server.create(bl.node_obj())
        for obj in (*services, *slices):
            self.server.create(obj)

    @contextlib.contextmanager
    def serving(self, ns: str, workdir: Path, *, pod: bool = False) -> Iterator[Launch]:
        """Serve on `ns`'s loopback; yields how to start the agent: from a
        kubeconfig (plain HTTP), or with `pod` as a pod starts it (TLS,
        configured in-cluster: `in_cluster`)."""
        self.server.tls = make_pki(_fresh_dir(workdir / "pki")).server if pod else None
        netns.run_in(ns, self.server.start)  # the listening socket lives in `ns`
        try:
            self.server.requests.clear()
            if pod:
                yield in_cluster(self.server, _fresh_dir(workdir / "serviceaccount"))
            else:
                yield Launch(("--kubeconfig", self.server.write_kubeconfig(workdir / "kubeconfig")))
        finally:
            self.server.stop()

    def list_requests(self) -> int:
        """List requests (pages) served since `serving` began."""
        return sum(1 for r in self.server.requests if r.verb == "list")


@dataclass(frozen=True)
class Launch:
    """How the agent starts: its source arguments, and for an agent
    configured in-cluster its environment and the command it runs under."""

    args: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    prefix: tuple[str, ...] = ()


_POD_RUN = """set -e
mount -t tmpfs -o mode=0755 tmpfs /run
mkdir -p /run/secrets/kubernetes.io/serviceaccount
cp "$1"/token "$1"/ca.crt /run/secrets/kubernetes.io/serviceaccount/
shift
exec "$@"
"""
"""A pod's /run, in the agent's own mount namespace (`ip netns exec` made
it; nothing reaches the host's): a fresh tmpfs holding the service
account's token and CA where the in-cluster configuration reads them."""


def in_cluster(server: FakeApiServer, account: Path) -> Launch:
    """The agent as a DaemonSet pod starts it: no kubeconfig, the API
    server's address in KUBERNETES_SERVICE_HOST/PORT, the service account
    (`account`: a token and the server's CA, written here) under /run."""
    assert server.tls is not None, "a pod reaches the API server over TLS"
    (account / "token").write_text("service-account-token")
    shutil.copyfile(server.tls.ca_file, account / "ca.crt")
    host, port = server.url.split("://", 1)[1].rsplit(":", 1)
    env = {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port}
    return Launch((), env, ("sh", "-c", _POD_RUN, "sh", str(account)))


def _fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def write_list(path: Path, services: Sequence[Any], slices: Sequence[Any]) -> Launch:
    """`path` as one `kind: List` JSON file (the node, then the objects);
    returns how the agent starts from it."""
    items = [bl.node_obj(), *services, *slices]
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
    return Launch(("--source", str(path)))


def agent_argv(source_args: Sequence[str]) -> list[str]:
    return [
        sys.executable, "-m", "nftproxy", "run", *source_args,
        "--node-name", bl.NODE,
        "--node-ip", bl.NODE_IP,
        "--cluster-cidr", bl.POD_CIDR,
        "--metrics-bind-address", METRICS,
        "--healthz-bind-address", HEALTHZ,
        "--min-sync-period", "1s",
        "--sync-period", "30s",
    ]  # fmt: skip


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value} (comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[key] = float(value)
    return out


def scrape(ns: str) -> dict[str, float] | None:
    """The agent's /metrics inside `ns`; None while it does not answer."""

    def get() -> str:
        with urllib.request.urlopen(f"http://{METRICS}/metrics", timeout=5) as resp:
            return str(resp.read().decode())

    try:
        return parse_metrics(netns.run_in(ns, get))
    except (OSError, urllib.error.URLError):
        return None


@dataclass(frozen=True)
class AgentRun:
    """How to run one agent: where, what to measure, how long to wait."""

    ns: str
    workdir: Path
    label: str
    idle: float = 30.0
    interval: float = 0.05
    timeout: float = 3600.0


def run_agent(run: AgentRun, launch: Launch) -> dict[str, Any]:
    """Start the agent, wait for its first committed full sync, idle, stop
    it; the result fields (see the module docstring)."""
    log_path = run.workdir / f"agent-{run.label}.log"
    env = {**os.environ, "PYTHONPATH": str(bl.ROOT), **launch.env}
    # as the image holds it (scripts/setup.sh): else, where the tree is fresh or
    # PYTHONDONTWRITEBYTECODE is set, every start compiles the package (~0.1 s)
    compileall.compile_dir(bl.ROOT / "nftproxy", quiet=1)
    with log_path.open("w") as log:
        t0 = time.time()
        proc = subprocess.Popen(
            ["ip", "netns", "exec", run.ns, *launch.prefix, *agent_argv(launch.args)],
            stdout=log, stderr=subprocess.STDOUT, cwd=bl.ROOT, env=env,
        )  # fmt: skip
    sampler = bl.TreeSampler(proc.pid, run.interval)
    sampler.start()
    try:
        metrics = _wait_committed(run, proc, log_path)
        cpu_to_commit = bl.tree_cpu_s(proc.pid)
        t_commit = metrics[_LAST_SYNC]
        time.sleep(max(0.0, t_commit + run.idle - time.time()))
        steady = sampler.sample()
        threads = _threads(proc.pid)
    finally:
        _stop(proc)
        memory = sampler.stop()
    return {
        "start_to_commit_s": round(t_commit - t0, 3),
        **_first_sync(metrics),
        "cpu_to_commit_s": cpu_to_commit,
        "peak_tree_mb": memory.peak_mb,
        "peak_agent_mb": memory.peak_root_mb,
        "peak_children_mb": memory.peak_children_mb,
        "peak_hwm_sum_mb": memory.hwm_sum_mb,
        "max_processes": memory.max_processes,
        "steady_tree_mb": steady,
        "steady_after_s": run.idle,
        "agent_threads": threads,
        "rss_samples": memory.samples,
    }


def _wait_committed(run: AgentRun, proc: subprocess.Popen[Any], log: Path) -> dict[str, float]:
    deadline = time.monotonic() + run.timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"agent exited ({proc.returncode}):\n{_tail(log)}")
        metrics = scrape(run.ns)
        if metrics and metrics.get(_FULL_COUNT, 0) >= 1 and metrics.get(_LAST_SYNC, 0) > 0:
            return metrics
        time.sleep(POLL)
    raise TimeoutError(f"no full sync committed in {run.timeout:.0f} s:\n{_tail(log)}")


def _first_sync(m: Mapping[str, float]) -> dict[str, Any]:
    """The scrape's figures of the first full sync (the sums are its own
    while `syncs_at_commit` is 1)."""

    def table(kind: str) -> int:
        return int(m.get(f'nftproxy_programmed_{kind}{{ip_family="IPv4"}}', 0))

    def objects(resource: str) -> int | None:  # API source only
        value = m.get(f'nftproxy_api_objects{{resource="{resource}"}}')
        return None if value is None else int(value)

    return {
        "sync_s": round(m.get("kubeproxy_sync_full_proxy_rules_duration_seconds_sum", 0), 3),
        "render_s": round(m.get("nftproxy_sync_render_duration_seconds_sum", 0), 3),
        "commit_s": round(m.get("nftproxy_sync_commit_duration_seconds_sum", 0), 3),
        "ops": int(m.get("nftproxy_sync_transaction_ops_sum", 0)),
        "syncs_at_commit": int(m.get("kubeproxy_sync_proxy_rules_duration_seconds_count", 0)),
        "skipped_syncs": int(m.get("nftproxy_sync_skipped_total", 0)),
        **{kind: table(kind) for kind in ("chains", "rules", "sets", "elements")},
        "informer_services": objects("services"),
        "informer_endpointslices": objects("endpointslices"),
    }


def _threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def _stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
