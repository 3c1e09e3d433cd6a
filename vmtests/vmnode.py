"""The node daemon of a VM cluster node: pods, probes and the nftproxy agent,
driven over HTTP by the runner in the client VM.

Layer: vmtests (test tooling, runs as root inside a node VM: started by
vmtests/qemu/guest-init.sh or the systemd unit vmtests/provision.sh
installs). One job: make this VM a node of nftproxy.tools.sandbox.cluster.plan()
and let the runner act on it. At start it names its own network namespace
(`ip netns attach`, so the sandbox's netns-named helpers work on the VM's
real network), wires the node's pods (network namespaces behind /32 veths,
routes to the other node's pod CIDR, forwarding sysctls) and starts their
backends. Then it serves JSON on the LAN address, port 7070:

    GET  /status       node, pods, agent state, kernel and nft versions
    POST /probe        {"who": "node" | pod, "proto", "targets": [[addr, port]],
                        "count", "timeout"} -> {"attempts": [...]} (sandbox probe)
    POST /agent/start  {"api_url"}: start `nftproxy run` (the real CLI agent)
                       with a kubeconfig for that API server
    POST /agent/stop   SIGTERM the agent and wait (the rules stay)
    GET  /dump         what `nftproxy dump --json` prints ([] before any sync)
    GET  /log          the end of the agent's log

The agent is `python -m nftproxy run --kubeconfig K --node-name N --node-ip
IP --cluster-cidr 10.244.0.0/16 --min-sync-period 100ms --sync-period 10s`,
its output appended to /var/log/nftproxy-agent.log.

Known limits: no authentication -- a test VM on a private network only.
SIGTERM or SIGINT stops the agent, the backends and the pods.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from nftproxy.kernel.libnftables import NftBackend
from nftproxy.tools.dump import parse_table
from nftproxy.tools.sandbox import cluster
from nftproxy.tools.sandbox import probe as _probe
from nftproxy.tools.sandbox.topology import Pod

__all__ = ["PORT", "main"]

PORT = 7070
NODE_NS = "nftvm-node"
LOG = Path("/var/log/nftproxy-agent.log")
KUBECONFIG = Path("/run/nftvm/kubeconfig")
TABLE = "nftproxy"


def _kubeconfig(url: str) -> str:
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "vmtests",
            "clusters": [{"name": "vmtests", "cluster": {"server": url}}],
            "users": [{"name": "vmtests", "user": {}}],
            "contexts": [{"name": "vmtests", "context": {"cluster": "vmtests", "user": "vmtests"}}],
        }
    )


class AgentProcess:
    """`nftproxy run` as a child process: start, SIGTERM, log."""

    def __init__(self, node: cluster.NodePlan) -> None:
        self.node = node
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._lock = threading.Lock()

    def argv(self) -> list[str]:
        return [
            sys.executable, "-m", "nftproxy", "run",
            "--kubeconfig", str(KUBECONFIG),
            "--node-name", self.node.name,
            "--node-ip", self.node.lan_ipv4,
            "--cluster-cidr", cluster.CLUSTER_CIDR,
            "--min-sync-period", "100ms",
            "--sync-period", "10s",
        ]  # fmt: skip

    def start(self, api_url: str) -> dict[str, Any]:
        with self._lock:
            if self.proc is not None and self.proc.poll() is None:
                raise RuntimeError(f"the agent is running (pid {self.proc.pid})")
            KUBECONFIG.parent.mkdir(parents=True, exist_ok=True)
            KUBECONFIG.write_text(_kubeconfig(api_url))
            self.starts += 1
            with LOG.open("ab") as log:
                log.write(f"=== start {self.starts} at {time.time():.3f}: {self.argv()}\n".encode())
                log.flush()
                self.proc = subprocess.Popen(
                    self.argv(),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            print(f"vmnode {self.node.name}: agent start {self.starts}, pid {self.proc.pid}")
            sys.stdout.flush()
            return {"pid": self.proc.pid, "starts": self.starts}

    def stop(self, timeout: float = 60.0) -> dict[str, Any]:
        with self._lock:
            proc, self.proc = self.proc, None
            if proc is None:
                return {"returncode": None}
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
            with LOG.open("ab") as log:
                log.write(f"=== stopped with {rc} at {time.time():.3f}\n".encode())
            print(f"vmnode {self.node.name}: agent pid {proc.pid} stopped with {rc}")
            sys.stdout.flush()
            return {"returncode": rc}

    def state(self) -> dict[str, Any]:
        proc = self.proc
        running = proc is not None and proc.poll() is None
        return {
            "running": running,
            "pid": proc.pid if proc else None,
            "returncode": proc.poll() if proc else None,
            "starts": self.starts,
        }


def _log_tail(lines: int = 80) -> str:
    try:
        text = LOG.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
    except OSError as exc:
        return f"unavailable: {exc}"
    return out.stdout.strip() or out.stderr.strip()


class Node:
    """Everything the handlers act on."""

    def __init__(
        self, node: cluster.NodePlan, pods: Mapping[str, Pod], node_ns: str, reader: NftBackend
    ) -> None:
        self.node = node
        self.pods = pods
        self.node_ns = node_ns
        self.reader = reader
        self.agent = AgentProcess(node)
        self.versions = {
            "kernel": platform.release(),
            "nft": _version(["nft", "--version"]),
            "python": platform.python_version(),
        }

    def ns(self, who: str) -> str:
        if who in ("node", self.node.name):
            return self.node_ns
        return self.pods[who].netns

    def status(self, _: Any) -> Any:
        return {
            "node": self.node.name,
            "pods": {name: pod.ipv4 for name, pod in self.pods.items()},
            "agent": self.agent.state(),
            **self.versions,
        }

    def probe(self, body: Any) -> Any:
        targets = [(str(addr), int(port)) for addr, port in body["targets"]]
        attempts = _probe.run(
            self.ns(str(body.get("who", "node"))),
            str(body["proto"]),
            targets,
            count=int(body.get("count", 1)),
            timeout=float(body.get("timeout", 1.0)),
        )
        return {"attempts": [_probe._as_json(a) for a in attempts]}

    def dump(self, _: Any) -> Any:
        out = []
        for family in ("ip", "ip6"):
            doc = self.reader.list_table(family, TABLE)
            if doc is not None:
                out.append(parse_table(doc, family=family, table=TABLE).to_json())
        return out

    def routes(self) -> dict[tuple[str, str], Callable[[Any], Any]]:
        return {
            ("GET", "/status"): self.status,
            ("POST", "/probe"): self.probe,
            ("POST", "/agent/start"): lambda body: self.agent.start(str(body["api_url"])),
            ("POST", "/agent/stop"): lambda _: self.agent.stop(),
            ("GET", "/dump"): self.dump,
            ("GET", "/log"): lambda _: {"log": _log_tail()},
        }


class _Handler(BaseHTTPRequestHandler):
    node: Node
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        handler = self.node.routes().get((method, urlsplit(self.path).path))
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if handler is None:
            self._send(404, {"error": f"no route {method} {self.path}"})
            return
        try:
            body = json.loads(raw) if raw else {}
            self._send(200, handler(body))
        except Exception as exc:  # the runner reports it; the daemon keeps serving
            self._send(500, {"error": f"{type(exc).__name__}: {exc}"})

    def _send(self, code: int, doc: Any) -> None:
        data = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vmtests/vmnode.py")
    parser.add_argument("--node", required=True, help="this node's name in cluster.plan()")
    parser.add_argument("--listen", help="address to serve on (default: the node's LAN IP)")
    parser.add_argument("--port", type=int, default=PORT)
    args = parser.parse_args(argv)
    plan = cluster.plan()
    node = plan.node(args.node)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with contextlib.ExitStack() as stack:
        node_ns = stack.enter_context(cluster.attached(NODE_NS))
        pods = cluster.wire_node(
            stack, plan, node, node_ns, token=secrets.token_hex(3), lan_dev=None
        )
        cluster.start_backends(stack, list(pods.values()), plan)
        reader = NftBackend()
        reader.start()
        stack.callback(reader.close)
        state = Node(node, pods, node_ns, reader)
        stack.callback(state.agent.stop)

        class Handler(_Handler):
            pass

        Handler.node = state
        server = ThreadingHTTPServer((args.listen or node.lan_ipv4, args.port), Handler)
        server.daemon_threads = True
        stack.callback(server.server_close)
        thread = threading.Thread(target=server.serve_forever, name="vmnode", daemon=True)
        thread.start()
        stack.callback(server.shutdown)
        print(f"vmnode {node.name}: ready on {server.server_address}, pods {sorted(pods)}")
        sys.stdout.flush()
        stop.wait()
    print(f"vmnode {node.name}: stopped")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
