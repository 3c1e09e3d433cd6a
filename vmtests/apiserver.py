"""The cluster's API server: tests/fakeapi.py (the real list/watch protocol)
listening on a LAN address instead of 127.0.0.1.

Layer: vmtests (test tooling). One job: let node agents on other machines or
namespaces reach the one API server the runner starts, and write the
kubeconfig `nftproxy run --kubeconfig` reads. The runner changes the cluster
through the server's Python methods (apply, delete, ...).
"""

from __future__ import annotations

import json
import sys
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))

import fakeapi  # noqa: E402  (tests/ is not a package)
import k8s  # noqa: E402

__all__ = ["LanApiServer", "k8s", "kubeconfig"]


class LanApiServer(fakeapi.FakeApiServer):
    """FakeApiServer bound to `host:port`. `start()` binds in the calling
    thread's network namespace (netns.run_in(ns, server.start) for another)."""

    def __init__(self, host: str, port: int, **options: Any) -> None:
        super().__init__(**options)
        self.host = host
        self.port = port

    def start(self) -> None:
        server = self

        class Handler(fakeapi._Handler):
            api = server

        httpd = ThreadingHTTPServer((self.host, self.port), Handler)
        httpd.daemon_threads = True
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, args=(0.05,), name="lan-api", daemon=True
        )
        self._thread.start()


def kubeconfig(url: str) -> str:
    """A kubeconfig (JSON is YAML) for an unauthenticated plain-HTTP server."""
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
