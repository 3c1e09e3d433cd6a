"""Safe edges in the kernel (tracker issue 36), each in throwaway namespaces.

Aspects:
- whatever valid names a file holds, the ruleset nftproxy programs lists
  as text `nft -f` reads back (`nft list ruleset | nft -c -f -`);
- `sync` refuses files without any Service while the table holds
  services (exit 1, saying so; the table untouched), and empties it with
  --allow-empty; `run --source` refuses to start so, and while running
  keeps the previous state on an emptied file (one WARNING) and keeps
  watching;
- `dump --service` of an unknown service exits 1 and says so; a service
  without endpoints has no empty `chains:` line;
- a real `sync` logs under the CLI's logger, not the dry run's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kernel
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nftproxy.core.config import ProxyConfig
from nftproxy.kernel import netns as _netns
from nftproxy.kernel.libnftables import NftBackend
from nftproxy.tools.dry_run import files_input

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "nftproxy" / "examples" / "cluster.yaml"

pytestmark = pytest.mark.kernel


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "NODE_NAME"}


def nftproxy(ns: str, *args: str) -> subprocess.CompletedProcess[str]:
    return _netns.exec_in(ns, [sys.executable, "-m", "nftproxy", *args], check=False,
                          cwd=REPO, env=_env(), timeout=120)


def _sample() -> list[dict[str, Any]]:
    """The objects of the embedded sample (one `kind: List`)."""
    (listed,) = yaml.safe_load_all(EXAMPLE.read_text())
    items: list[dict[str, Any]] = listed["items"]
    return items


def wait_for(
    condition: Callable[[], bool], timeout: float = 15.0, log: Path | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out" + (f"; log:\n{log.read_text()}" if log else ""))
        time.sleep(0.1)


# -- every name that reaches the kernel lists back as text nft reads -----------------

_LABEL = st.from_regex(r"\A[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")
_SERVICE_NAME = st.from_regex(r"\A[a-z]([-a-z0-9]{0,61}[a-z0-9])?\Z")
_SUBDOMAIN = st.from_regex(r"\A[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?(\.[a-z0-9]{1,10}){0,3}\Z")


def _objects(i: int, namespace: str, name: str, port: str, slice_name: str) -> list[Any]:
    svc = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"type": "NodePort", "clusterIP": f"10.96.0.{i + 10}",
                 "ports": [{"name": port, "port": 80, "protocol": "TCP",
                            "nodePort": 30000 + i}]},
    }
    eps = {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": slice_name, "namespace": namespace,
                     "labels": {"kubernetes.io/service-name": name}},
        "addressType": "IPv4",
        "ports": [{"name": port, "port": 8080, "protocol": "TCP"}],
        "endpoints": [{"addresses": [f"10.244.0.{i + 10}"], "conditions": {"ready": True},
                       "nodeName": "node-1"}],
    }
    return [svc, eps]


_SERVICES = st.lists(
    st.tuples(_LABEL, _SERVICE_NAME, st.one_of(st.just(""), _LABEL), _SUBDOMAIN),
    min_size=1, max_size=4, unique_by=lambda t: (t[0], t[1]),
)


def test_programmed_names_list_back_as_text_nft_reads(tmp_path: Path) -> None:
    """Issue 36 case 4: a name with braces, quotes or newlines made
    `nft list ruleset > backup; nft -f backup` fail."""
    path = tmp_path / "c.yaml"
    with kernel.fresh_netns() as ns, kernel.fresh_netns() as restore, \
            NftBackend(netns=ns) as backend:

        @settings(max_examples=15, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(services=_SERVICES)
        def check(services: list[tuple[str, str, str, str]]) -> None:
            docs = [o for i, s in enumerate(services) for o in _objects(i, *s)]
            docs.append({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1"}})
            path.write_text(yaml.safe_dump_all(docs))
            config = ProxyConfig(node_name="node-1", table_name="nftproxy")
            proxier, read = files_input([str(path)], config, backend, log=_quiet())
            assert len(read.services) == len(services)
            proxier.sync()
            listed = kernel.nft(ns, "list", "ruleset")
            assert "KUBE-SVC-" in listed or "dispatch-" in listed
            checked = _netns.exec_in(restore, ["nft", "-c", "-f", "-"], input=listed,
                                     check=False)
            assert checked.returncode == 0, checked.stderr[-2000:]

        check()


def _quiet() -> Any:
    import logging

    return logging.getLogger("test.safe_edges_kernel")


# -- an empty source never empties a programmed table silently --------------------------


def _services_in_dump(ns: str) -> str:
    dumped = nftproxy(ns, "dump")
    return dumped.stdout if dumped.returncode == 0 else ""


def test_sync_refuses_an_empty_source_over_a_programmed_table(
    netns: str, tmp_path: Path
) -> None:
    """Issue 36 case 2: `sync --source empty.yaml` exited 0 and every
    service left the kernel."""
    assert nftproxy(netns, "sync", "--source", str(EXAMPLE)).returncode == 0
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    refused = nftproxy(netns, "sync", "--source", str(empty))
    assert refused.returncode == 1
    assert "hold no Service" in refused.stderr and "--allow-empty" in refused.stderr
    assert "demo/web:http" in _services_in_dump(netns)
    allowed = nftproxy(netns, "sync", "--source", str(empty), "--allow-empty")
    assert allowed.returncode == 0, allowed.stderr
    assert "demo/" not in _services_in_dump(netns)
    assert nftproxy(netns, "sync", "--source", str(empty)).returncode == 0  # nothing to lose


def test_run_refuses_to_start_on_an_empty_source_over_a_programmed_table(
    netns: str, tmp_path: Path
) -> None:
    assert nftproxy(netns, "sync", "--source", str(EXAMPLE)).returncode == 0
    empty = tmp_path / "empty.yaml"
    empty.write_text("---\n")
    refused = nftproxy(netns, "run", "--source", str(empty), "--node-name", "demo-node",
                       "--healthz-bind-address", "", "--metrics-bind-address", "")
    assert refused.returncode == 1 and "hold no Service" in refused.stderr
    assert "demo/web:http" in _services_in_dump(netns)


def test_run_keeps_the_previous_state_when_its_file_is_emptied(
    netns: str, tmp_path: Path
) -> None:
    """Issue 36 case 2: under `run --source`, `: > FILE` wiped every rule
    within 3 s, and the only log line was about the Node."""
    source = tmp_path / "cluster.yaml"
    source.write_text(EXAMPLE.read_text())
    log = tmp_path / "run.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", netns, sys.executable, "-m", "nftproxy", "run",
             "--source", str(source), "--healthz-bind-address", "",
             "--metrics-bind-address", ""],
            stdout=subprocess.DEVNULL, stderr=stderr, cwd=REPO, env=_env(),
        )
        try:
            wait_for(lambda: "demo/web:http" in _services_in_dump(netns))
            source.write_text("")
            wait_for(lambda: "keeping the previous state" in log.read_text())
            time.sleep(1.5)  # a poll or two more: nothing may be removed meanwhile
            assert "demo/web:http" in _services_in_dump(netns)
            text = log.read_text()
            assert text.count("keeping the previous state") == 1
            (line,) = [ln for ln in text.splitlines() if "keeping the previous state" in ln]
            assert " WARNING " in line and "--allow-empty" in line
            # still watching: the next edit is programmed
            kept = [o for o in _sample() if o["kind"] != "Service"
                    or o["metadata"]["name"] == "dns"]
            source.write_text(yaml.safe_dump_all(kept))
            wait_for(lambda: "demo/web:http" not in _services_in_dump(netns), log=log)
            assert "demo/dns:dns" in _services_in_dump(netns)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- dump -------------------------------------------------------------------------------


def test_dump_of_an_unknown_service_fails_and_no_chains_line_is_empty(netns: str) -> None:
    """Issue 36 case 7: `dump --service demo/nonexistent` printed headers
    and exited 0; a service without endpoints printed `chains: `."""
    assert nftproxy(netns, "sync", "--source", str(EXAMPLE)).returncode == 0
    unknown = nftproxy(netns, "dump", "--service", "demo/nonexistent")
    assert unknown.returncode == 1 and unknown.stdout == ""
    assert "no service 'demo/nonexistent'" in unknown.stderr
    empty = nftproxy(netns, "dump", "--service", "demo/empty")
    assert empty.returncode == 0 and "demo/empty:http" in empty.stdout
    whole = nftproxy(netns, "dump").stdout
    assert not [ln for ln in whole.splitlines() if ln.strip() == "chains:"]


# -- who speaks --------------------------------------------------------------------------


def test_a_real_sync_logs_under_the_cli_logger(netns: str, tmp_path: Path) -> None:
    """Issue 36 case 7: a real `sync` logged its warnings under
    nftproxy.tools.dry_run."""
    objects = _sample()
    for obj in objects:
        if obj.get("kind") == "Service" and obj["metadata"]["name"] == "web":
            obj["spec"]["ports"][0]["name"] = "Http"  # not a DNS-1123 label
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump_all(objects))
    synced = nftproxy(netns, "sync", "--source", str(path))
    assert synced.returncode == 0, synced.stderr
    (line,) = [ln for ln in synced.stderr.splitlines() if "skipped invalid field" in ln]
    assert " nftproxy.tools.cli " in line and "spec.ports[0].name" in line
    assert "nftproxy.tools.dry_run" not in synced.stderr
