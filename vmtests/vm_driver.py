"""The scenarios' driver on real VMs: the runner sits in the client VM, the
nodes are VMs running vmtests/vmnode.py.

Layer: vmtests (test tooling). One job: implement scenarios.Driver with
HTTP calls to each node's daemon (probes from its pods or from the node,
`nftproxy run` start/stop, `nftproxy dump --json`, the agent's log), and
local actions for the client (probes, Continuous, health-check GETs): the
runner's own namespace is the client's. The API server is the runner's
in-process LanApiServer on the client's LAN address.

`slow` scales waits and probe timeouts: every VM is emulated (TCG) and three
share two host cores in the qemu runs, so a connection can take far longer
than in namespaces.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from nftproxy.tools.sandbox import probe as _probe
from nftproxy.tools.sandbox.cluster import ClusterPlan, HttpAnswer, fetch
from nftproxy.tools.sandbox.probe import Attempt, Continuous
from vmtests.apiserver import LanApiServer

__all__ = ["DaemonError", "VmDriver"]


class DaemonError(RuntimeError):
    """A node daemon could not be reached or answered with an error."""


class VmDriver:
    def __init__(
        self,
        plan: ClusterPlan,
        api: LanApiServer,
        *,
        client_ns: str,
        daemons: Mapping[str, str],
        slow: float = 4.0,
    ) -> None:
        self.plan = plan
        self.api = api
        self.client_ns = client_ns
        self.daemons = dict(daemons)
        self.slow = slow
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def _call(
        self, node: str, method: str, path: str, body: Any = None, timeout: float = 60
    ) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.daemons[node] + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with self._opener.open(request, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            raise DaemonError(f"{node} {method} {path}: HTTP {exc.code} {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise DaemonError(f"{node} {method} {path}: {exc}") from None

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """Poll every daemon's /status until all answer; their statuses."""
        deadline = time.monotonic() + timeout
        status: dict[str, Any] = {}
        while True:
            for node in self.daemons:
                if node not in status:
                    with contextlib.suppress(DaemonError):
                        status[node] = self._call(node, "GET", "/status", timeout=10)
            if len(status) == len(self.daemons):
                return status
            if time.monotonic() > deadline:
                missing = sorted(set(self.daemons) - set(status))
                raise DaemonError(f"node daemons not ready after {timeout:.0f}s: {missing}")
            time.sleep(2)

    # -- scenarios.Driver ---------------------------------------------------------------

    def probe(
        self,
        who: str,
        proto: str,
        targets: Sequence[tuple[str, int]],
        *,
        count: int = 1,
        timeout: float = 1.0,
    ) -> list[Attempt]:
        timeout *= self.slow
        if who == "client":
            return _probe.run(self.client_ns, proto, targets, count=count, timeout=timeout)
        node = who if who in self.daemons else self.plan.pods[who].node
        body = {
            "who": "node" if who == node else who,
            "proto": proto,
            "targets": [list(t) for t in targets],
            "count": count,
            "timeout": timeout,
        }
        budget = 30 + len(targets) * count * 2 * timeout
        doc = self._call(node, "POST", "/probe", body, timeout=budget)
        return [
            Attempt(a["target"], a["src"], a["answer"], a["error"], float(a["seconds"]))
            for a in doc["attempts"]
        ]

    def http_get(self, addr: str, port: int, path: str = "/") -> HttpAnswer:
        return fetch(f"http://{addr}:{port}{path}", timeout=2.0 * self.slow)

    def continuous(
        self, proto: str, targets: Sequence[tuple[str, int]], *, timeout: float, interval: float
    ) -> Continuous:
        return Continuous(
            self.client_ns, proto, targets, timeout=timeout * self.slow, interval=interval
        )

    def start_agent(self, node: str) -> None:
        self._call(node, "POST", "/agent/start", {"api_url": self.plan.api_url})

    def stop_agent(self, node: str) -> None:
        self.stop_agent_status(node)

    def stop_agent_status(self, node: str) -> int | None:
        """Stop the agent; its exit status (0 after a clean SIGTERM stop)."""
        rc = self._call(node, "POST", "/agent/stop", {}, timeout=120)["returncode"]
        return None if rc is None else int(rc)

    def programmed(self, node: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self._call(node, "GET", "/dump")
        return out

    def agent_starts(self, node: str) -> int:
        return int(self._call(node, "GET", "/status")["agent"]["starts"])

    def agent_log(self, node: str) -> str:
        try:
            return str(self._call(node, "GET", "/log")["log"])
        except DaemonError as exc:
            return str(exc)
