"""TLS to the API server as client-go does it, and TLS or auth failures made plain.

Aspects:
- the API client built by from_config (kubeconfig and in-cluster alike)
  verifies against the configured CA with hostname checking, with
  VERIFY_X509_STRICT cleared (Python 3.13's default, which rejects a CA
  without keyUsage; Go accepts it) and VERIFY_X509_PARTIAL_CHAIN set (Go
  trusts any certificate in its roots);
- with the strict flag forced into every default context (Python 3.13's
  behaviour, simulated on any version), the simulation does reject the CA
  without keyUsage, and KubeSource still lists from a server whose CA has
  no keyUsage, through a kubeconfig with a client certificate the server
  requires, and through the in-cluster service account (token);
- the CA and the client certificate are loaded into the context once:
  urllib3 is given no file to load per connection, and many threads
  connecting at once with a client certificate do not crash the process
  (urllib3 used to reload the certificate into the shared SSL_CTX for
  every connection, racing the other threads' handshakes: a segfault);
- a CA or client certificate that cannot be loaded is one clear error
  naming the file, when the client is built; rotated files are loaded again
  for the next connections (files that do not load: one WARNING, the
  previous ones kept);
- a wrong CA or a 401: ONE ERROR log line with the cause however many
  retries, nftproxy_api_errors_total{reason="tls"|"unauthorized"}, and
  /healthz 503 saying why once it lasted 2 x syncPeriod; all clear once
  the server answers again.

Certificates are made by tests/pki.py with `cryptography`; all traffic is on 127.0.0.1.
"""

from __future__ import annotations

import json
import logging
import os
import re
import ssl
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import urllib3
from fakeapi import FakeApiServer, ServerTls
from k8s import node, service
from kubernetes.config import incluster_config
from pki import Pki, make_pki
from test_bare_packages import in_fresh_interpreter
from test_kube_source import wait_until

from nftproxy.agent.agent import Agent, Source
from nftproxy.cluster import client_tls
from nftproxy.cluster.events import ClusterEvents, Obj
from nftproxy.cluster.kube import KubeSource, from_config
from nftproxy.core.config import ProxyConfig
from nftproxy.kernel.fake import FakeBackend


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path)


@pytest.fixture
def strict_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every context urllib3 (and ssl) makes by default has VERIFY_X509_STRICT,
    as on Python 3.13 with urllib3 >= 2.3."""
    make = urllib3.util.ssl_.create_urllib3_context
    default = ssl.create_default_context

    def strict_urllib3(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        context = make(*args, **kwargs)
        context.verify_flags |= ssl.VERIFY_X509_STRICT
        return context

    def strict_ssl(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        context = default(*args, **kwargs)
        context.verify_flags |= ssl.VERIFY_X509_STRICT
        return context

    monkeypatch.setattr(urllib3.util.ssl_, "create_urllib3_context", strict_urllib3)
    monkeypatch.setattr(urllib3.connection, "create_urllib3_context", strict_urllib3)
    monkeypatch.setattr(client_tls, "create_urllib3_context", strict_urllib3)
    monkeypatch.setattr(ssl, "create_default_context", strict_ssl)


def kubeconfig(path: Path, url: str, ca: Path, *, cert: Path | None = None,
               key: Path | None = None, token: str | None = None) -> str:
    user: dict[str, str] = {}
    if cert is not None and key is not None:
        user = {"client-certificate": str(cert), "client-key": str(key)}
    if token is not None:
        user["token"] = token
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": url, "certificate-authority": str(ca)}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
    }
    path.write_text(json.dumps(config))  # YAML is a superset of JSON
    return str(path)


# -- a handler -----------------------------------------------------------------------------


class Services:
    """A ClusterEvents handler that keeps only the Services' names."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.lock = threading.Lock()

    def on_service(self, previous: Obj | None, current: Obj | None) -> None:
        with self.lock:
            if current is not None:
                self.names.add(current["metadata"]["name"])

    def on_endpoint_slice(self, previous: Obj | None, current: Obj | None) -> None:
        pass

    def on_node(self, node: Obj | None) -> None:
        pass

    def on_service_cidrs(self, cidrs: Sequence[Obj]) -> None:
        pass

    def on_synced(self, kind: str) -> None:
        pass


@pytest.fixture
def tls_api(pki: Pki) -> Iterator[FakeApiServer]:
    with FakeApiServer(tls=pki.server) as api:
        api.create(service("web", "10.96.0.10"))
        api.create(node("node-a", ["192.168.50.1"]))
        yield api


def _lists_web(client: Any) -> None:
    handler = Services()
    source = KubeSource(client, handler, node_name="", backoff_initial=0.05, backoff_max=0.2)
    source.start()
    try:
        wait_until(lambda: "web" in handler.names, what="the Service listed over TLS")
    finally:
        source.stop()


# -- the client's SSL context ---------------------------------------------------------------


def _context(client: Any) -> ssl.SSLContext:
    context = client.rest_client.pool_manager.connection_pool_kw["ssl_context"]
    assert isinstance(context, ssl.SSLContext)
    return context


def test_the_client_verifies_like_client_go(
    tls_api: FakeApiServer, pki: Pki, tmp_path: Path, strict_default: None
) -> None:
    client = from_config(kubeconfig(tmp_path / "kc", tls_api.url, pki.ca, token="t"))
    context = _context(client)
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname
    assert not context.verify_flags & ssl.VERIFY_X509_STRICT
    assert context.verify_flags & ssl.VERIFY_X509_PARTIAL_CHAIN
    # the informers' copy of the client (without urllib3 retries) uses it too
    source = KubeSource(client, Services(), node_name="")
    assert not _context(source.api_client).verify_flags & ssl.VERIFY_X509_STRICT


def test_the_strict_simulation_rejects_a_ca_without_key_usage(
    tls_api: FakeApiServer, pki: Pki, strict_default: None
) -> None:
    """What Python 3.13 does by default, here on any version: the fix is needed."""
    pool = urllib3.PoolManager(ca_certs=str(pki.ca), retries=False)
    with pytest.raises(urllib3.exceptions.SSLError, match="key usage"):
        pool.request("GET", f"{tls_api.url}/api")
    context = ssl.create_default_context(cafile=str(pki.ca))
    with pytest.raises(urllib3.exceptions.SSLError, match="key usage"):
        urllib3.PoolManager(ssl_context=context, retries=False).request(
            "GET", f"{tls_api.url}/api")


def _client_cert_server(pki: Pki) -> FakeApiServer:
    """A server that requires a client certificate signed by the CA."""
    return FakeApiServer(tls=ServerTls(pki.server.cert_file, pki.server.key_file,
                                       pki.server.ca_file, client_ca_file=str(pki.ca)))


def test_lists_from_a_ca_without_key_usage_with_a_client_certificate(
    pki: Pki, tmp_path: Path, strict_default: None
) -> None:
    with _client_cert_server(pki) as api:
        api.create(service("web", "10.96.0.10"))
        path = kubeconfig(tmp_path / "kc", api.url, pki.ca, cert=pki.client_cert,
                          key=pki.client_key)
        _lists_web(from_config(path))


def test_the_credentials_are_loaded_once_not_per_connection(pki: Pki, tmp_path: Path) -> None:
    path = kubeconfig(tmp_path / "kc", "https://127.0.0.1:6443", pki.ca, cert=pki.client_cert,
                      key=pki.client_key)
    client = from_config(path)
    pool_kw = client.rest_client.pool_manager.connection_pool_kw
    assert not {k: v for k, v in pool_kw.items()
                if k in ("ca_certs", "ca_cert_data", "cert_file", "key_file") and v}
    assert _context(client).cert_store_stats()["x509_ca"] == 1


# Many threads, each opening a new TLS connection per request (the server
# closes it), through one client: as the informers and the Event recorder do.
_CONNECT_AT_ONCE = """
import sys, threading
from nftproxy.cluster.kube import from_config

path, url, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
pool = from_config(path).rest_client.pool_manager
failures = []

def connect():
    for _ in range(rounds):
        r = pool.request("GET", url + "/api/v1/services", retries=False,
                         headers={"Connection": "close"})
        if r.status != 200:
            failures.append(r.status)

threads = [threading.Thread(target=connect) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(len(failures), "failures")
"""


def test_many_connections_at_once_with_a_client_certificate(pki: Pki, tmp_path: Path) -> None:
    """A client in its own process: a crash is its exit status, not the suite's."""
    with _client_cert_server(pki) as api:
        path = kubeconfig(tmp_path / "kc", api.url, pki.ca, cert=pki.client_cert,
                          key=pki.client_key)
        run = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _CONNECT_AT_ONCE,
                              path, api.url, "60"],
                             capture_output=True, text=True, timeout=300, check=False)
    assert (run.returncode, run.stdout.strip()) == (0, "0 failures"), run.stderr[-3000:]


def _replace(path: Path, data: bytes) -> None:
    """Write `path` as rotation tools do: a new file renamed over the old."""
    new = path.with_name(path.name + ".new")
    new.write_bytes(data)
    os.replace(new, path)


def test_a_rotated_client_certificate_is_used_by_the_next_connections(
    pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As client-go: changed certificate and key files are loaded again
    (before the next request); files that do not load keep the previous
    ones, with one WARNING."""
    other = tmp_path / "other"
    other.mkdir()
    untrusted = make_pki(other, cn="another-ca")  # a pair the server does not accept
    cert, key = tmp_path / "rotating.crt", tmp_path / "rotating.key"
    cert.write_bytes(untrusted.client_cert.read_bytes())
    key.write_bytes(untrusted.client_key.read_bytes())
    with _client_cert_server(pki) as api:
        client = from_config(kubeconfig(tmp_path / "kc", api.url, pki.ca, cert=cert, key=key))
        pool = client.rest_client.pool_manager

        def status() -> int:
            answer = pool.request("GET", f"{api.url}/api/v1/services", retries=False)
            return int(answer.status)

        with pytest.raises(urllib3.exceptions.HTTPError):
            status()
        _replace(cert, pki.client_cert.read_bytes())
        _replace(key, pki.client_key.read_bytes())
        assert status() == 200
        caplog.set_level(logging.WARNING)
        _replace(cert, b"half written\n")
        assert [status(), status()] == [200, 200]  # the previous context
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "do not load" in warnings[0].getMessage()


@pytest.mark.parametrize("broken", ["CA", "client certificate"])
def test_unloadable_credentials_are_one_clear_error(pki: Pki, tmp_path: Path,
                                                     broken: str) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    ca, cert = (garbage, pki.client_cert) if broken == "CA" else (pki.ca, garbage)
    path = kubeconfig(tmp_path / "kc", "https://127.0.0.1:6443", ca, cert=cert,
                      key=pki.client_key)
    with pytest.raises(ValueError, match=re.escape(f"cannot load the {broken} {garbage}")):
        from_config(path)


def test_lists_from_a_ca_without_key_usage_in_cluster(
    tls_api: FakeApiServer, pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    strict_default: None,
) -> None:
    token = tmp_path / "token"
    token.write_text("service-account-token")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(pki.ca))
    host, port = tls_api.url.removeprefix("https://").rsplit(":", 1)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", host)
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", port)
    client = from_config()
    assert not _context(client).verify_flags & ssl.VERIFY_X509_STRICT
    _lists_web(client)
    auth = [r for r in tls_api.requests if r.resource == "services"]
    assert auth, "no request reached the server"


def test_an_in_cluster_client_imports_neither_the_kubeconfig_loader_nor_the_rest_of_kubernetes(
    pki: Pki, tmp_path: Path,
) -> None:
    """A pod's agent (in-cluster config) imports the client, its exceptions
    and the in-cluster loader, not what kubernetes' package __init__ would
    (dynamic client, watch, stream, leader election) nor the kubeconfig
    loader with requests and requests-oauthlib (cluster/__init__.py); a
    kubeconfig given later loads its loader then. In a fresh interpreter:
    the import state is the process's."""
    token = tmp_path / "token"
    token.write_text("service-account-token")
    path = kubeconfig(tmp_path / "kc", "https://127.0.0.1:6443", pki.ca, token="t")
    code = f"""
import json, sys
from nftproxy.cluster.kube import from_config
from kubernetes.config import incluster_config
incluster_config.SERVICE_TOKEN_FILENAME = {str(token)!r}
incluster_config.SERVICE_CERT_FILENAME = {str(pki.ca)!r}
in_cluster = from_config().configuration.host
loaded = sorted(m for m in sys.modules if m.split(".")[0] in
                ("kubernetes", "requests", "requests_oauthlib", "oauthlib"))
off_cluster = from_config({path!r}).configuration.host
print(json.dumps({{"hosts": [in_cluster, off_cluster], "loaded": loaded,
                   "loader_after": "kubernetes.config.kube_config" in sys.modules}}))
"""
    env = {**os.environ, "KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    result = in_fresh_interpreter(code, env)
    assert result["hosts"] == ["https://10.96.0.1:443", "https://127.0.0.1:6443"]
    loaded = set(result["loaded"])
    assert {"kubernetes.client.api_client", "kubernetes.config.incluster_config"} <= loaded
    for other in ("kubernetes.config.kube_config", "requests", "requests_oauthlib", "oauthlib",
                  "kubernetes.dynamic", "kubernetes.watch", "kubernetes.stream",
                  "kubernetes.leaderelection"):
        assert other not in loaded
    assert result["loader_after"] is True


# -- failures: one ERROR, a metric, /healthz ------------------------------------------------


CONFIG = ProxyConfig(
    node_name="node-a",
    cluster_cidrs=("10.244.0.0/16",),
    min_sync_period=0.05,
    sync_period=0.5,  # /healthz turns unhealthy after 2 x 0.5 s of failure
    healthz_bind_address="127.0.0.1:0",
    metrics_bind_address="",
)


def _agent(client: Any) -> Agent:
    def source_factory(handler: ClusterEvents) -> Source:
        return KubeSource(client, handler, node_name="node-a",
                          backoff_initial=0.05, backoff_max=0.2)

    return Agent(CONFIG, backend=FakeBackend(), source_factory=source_factory)


def _healthz(agent: Agent) -> tuple[int, dict[str, Any]]:
    assert agent.healthz is not None
    host, port = agent.healthz.address
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _errors(agent: Agent, reason: str) -> float:
    value = agent.metrics.registry.get_sample_value(
        "nftproxy_api_errors_total", {"resource": "services", "reason": reason})
    return value or 0.0


def _services_errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.levelno >= logging.ERROR and r.getMessage().startswith("services:")]


def _check_failure(agent: Agent, caplog: pytest.LogCaptureFixture, reason: str,
                   cause: str) -> None:
    """Many failed attempts later: one ERROR naming `cause`, the metric,
    /healthz 503 with the cause."""
    agent.start()
    wait_until(lambda: _errors(agent, reason) >= 5, what=f"5 {reason} errors")
    # Each informer's failure turns stale on its own clock: the body lists
    # them as they do, so wait for the services informer's.
    wait_until(lambda: "services" in _healthz(agent)[1].get("problem", ""),
               what="/healthz saying why")
    code, body = _healthz(agent)
    assert (code, body["healthy"]) == (503, False)
    assert cause in body["problem"] and "services" in body["problem"]
    errors = _services_errors(caplog)
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert cause in errors[0].getMessage()
    assert not [r for r in caplog.records
                if r.levelno == logging.WARNING and r.getMessage().startswith("services:")]


def test_a_wrong_ca_is_one_error_a_metric_and_unhealthy(
    tls_api: FakeApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    wrong = make_pki(other, cn="another-ca")
    client = from_config(kubeconfig(tmp_path / "kc", tls_api.url, wrong.ca, token="t"))
    agent = _agent(client)
    caplog.set_level(logging.DEBUG)
    try:
        _check_failure(agent, caplog, "tls", "CERTIFICATE_VERIFY_FAILED")
    finally:
        agent.stop()


def test_a_401_is_one_error_a_metric_and_unhealthy_until_it_answers(
    tls_api: FakeApiServer, pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tls_api.fail_requests(10_000, resource="services", status=401)
    client = from_config(kubeconfig(tmp_path / "kc", tls_api.url, pki.ca, token="expired"))
    agent = _agent(client)
    caplog.set_level(logging.DEBUG)
    try:
        _check_failure(agent, caplog, "unauthorized", "HTTP 401")
        assert _errors(agent, "tls") == 0
        tls_api.clear_failures()  # the credentials are accepted again
        wait_until(lambda: _healthz(agent)[0] == 200, what="/healthz 200 again")
        assert "problem" not in _healthz(agent)[1]
    finally:
        agent.stop()
