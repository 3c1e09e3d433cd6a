"""`nftproxy demo`: the real agent on the sample cluster, in a sandbox, proven by traffic.

Aspects:
- the traffic plan for the sample (pure): every service port, its ClusterIPs
  of both families, node ports, the LB VIP from an allowed and from a
  disallowed source; outcomes are described as a newcomer reads them;
- endpoints are shown, and paths judged, per IP family: an endpoint ready in
  the IPv4 slice and terminating in the IPv6 one reads so; a family without
  endpoints says "none" and its paths expect a reject;
- `nftproxy demo --once` (a subprocess, as a user runs it) exits 0 and its
  report shows: web spread over its two ready endpoints (not the
  terminating one), masqueraded; web-local's LB and node port from the
  client answered by the local endpoint only with the client's source
  preserved, and dropped from a source outside its ranges; its health check
  node port says 1 local endpoint; sticky on one backend; dns over UDP;
  empty refused (reject); then the dump of the live table (ip and ip6);
- without --once: editing the printed file re-programs the rules and the
  report is printed again, showing the change; SIGINT to the demo, and a
  terminal-style Ctrl-C (SIGINT to its whole process group, backends and
  probes included) in the middle of a report, exit 0;
- every run removes its namespaces (`nftpx-<role>-<pid>-<hex>`) and its
  temporary copy of the sample.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kernel
import pytest

from nftproxy.core.model import IPFamily
from nftproxy.tools.demo import SAMPLE, load_cluster
from nftproxy.tools.demo_report import Addresses, Check, Cluster, Result, describe, plan, render
from nftproxy.tools.sandbox.probe import Attempt

ROOT = Path(__file__).resolve().parents[1]
DEMO = [sys.executable, "-m", "nftproxy", "demo"]
RUN_TIMEOUT = 60.0

SANDBOX = Addresses(
    node={IPFamily.IPV4: "192.168.50.1", IPFamily.IPV6: "fd00:50::1"},
    clients={
        IPFamily.IPV4: ("192.168.50.2", "192.168.50.3"),
        IPFamily.IPV6: ("fd00:50::2", "fd00:50::3"),
    },
    pods={
        "10.244.0.11": "web-0", "10.244.0.12": "web-1", "10.244.1.13": "web-2",
        "fd00:244::11": "web-0", "fd00:244::12": "web-1", "fd00:244:1::13": "web-2",
    },
    gateways=frozenset({"10.244.0.1", "fd00:244::1"}),
)


# --- the plan and the wording (pure) ---------------------------------------------------


def test_plan_covers_every_path_of_the_sample() -> None:
    blocks = {b.name: b for b in plan(load_cluster(SAMPLE), SANDBOX)}
    assert sorted(blocks) == [
        "demo/dns:dns", "demo/empty:http", "demo/sticky:http",
        "demo/web-local:http", "demo/web-np:http", "demo/web:http",
    ]  # fmt: skip
    assert [c.target for c in blocks["demo/web:http"].checks] == [
        "10.96.0.10:80", "[fd00:96::10]:80"]  # fmt: skip
    assert [c.target for c in blocks["demo/web-np:http"].checks] == [
        "10.96.0.20:80", "192.168.50.1:30080", "[fd00:96::20]:80", "[fd00:50::1]:30080"]
    local = blocks["demo/web-local:http"]
    assert [(c.target, c.src, c.note) for c in local.checks] == [
        ("10.96.0.30:80", "192.168.50.2", ""),
        ("192.168.60.10:80", "192.168.50.2", ""),
        ("192.168.60.10:80", "192.168.50.3", "source outside loadBalancerSourceRanges"),
        ("192.168.50.1:30081", "192.168.50.2", ""),
    ]
    assert local.health is not None and local.health.port == 30500
    assert "externalTrafficPolicy Local" in local.details
    assert local.endpoints == ("IPv4 endpoints: web-0 ready, web-2 ready on other-node",)
    assert blocks["demo/web:http"].endpoints == (
        "IPv4 endpoints: web-0 ready, web-1 terminating, web-2 ready on other-node",
        "IPv6 endpoints: web-0 ready, web-1 terminating, web-2 ready on other-node")
    assert blocks["demo/dns:dns"].checks[0].proto == "udp"
    (empty,) = blocks["demo/empty:http"].checks
    assert empty.note == "the service has no endpoints"


def _sample_with(edit: Callable[[dict[tuple[str, str], Any]], None]) -> Cluster:
    """The sample cluster with its slices changed by `edit` (on a deep copy)."""
    cluster = load_cluster(SAMPLE)
    slices = copy.deepcopy(dict(cluster.slices))
    edit(slices)
    return dataclasses.replace(cluster, slices=slices)


def _web_slice(slices: dict[tuple[str, str], Any], family: str) -> Any:
    (found,) = [s for s in slices.values()
                if s["metadata"]["labels"]["kubernetes.io/service-name"] == "web"
                and s["addressType"] == family]
    return found


def test_endpoints_are_shown_per_family() -> None:
    def web_1_ready_in_ipv4_only(slices: dict[tuple[str, str], Any]) -> None:
        (ep,) = [e for e in _web_slice(slices, "IPv4")["endpoints"]
                 if e["addresses"] == ["10.244.0.12"]]
        ep["conditions"] = {"ready": True, "serving": True, "terminating": False}

    blocks = {b.name: b for b in plan(_sample_with(web_1_ready_in_ipv4_only), SANDBOX)}
    web = blocks["demo/web:http"]
    assert web.endpoints == (
        "IPv4 endpoints: web-0 ready, web-1 ready, web-2 ready on other-node",
        "IPv6 endpoints: web-0 ready, web-1 terminating, web-2 ready on other-node")
    report = render([web], {c: Result(c, skipped="not run") for c in web.checks}, {}, SANDBOX)
    lines = report.splitlines()
    assert "    IPv4 endpoints: web-0 ready, web-1 ready, web-2 ready on other-node" in lines
    assert "    IPv6 endpoints: web-0 ready, web-1 terminating, web-2 ready on other-node" in lines


def test_a_family_without_endpoints_says_none_and_expects_a_reject() -> None:
    def no_ipv6_endpoints(slices: dict[tuple[str, str], Any]) -> None:
        _web_slice(slices, "IPv6")["endpoints"] = []

    web = {b.name: b for b in plan(_sample_with(no_ipv6_endpoints), SANDBOX)}["demo/web:http"]
    assert web.endpoints[1] == "IPv6 endpoints: none"
    assert [(c.target, c.note) for c in web.checks] == [
        ("10.96.0.10:80", ""), ("[fd00:96::10]:80", "the service has no endpoints")]


def _attempt(answer: str | None, error: str | None = None, seconds: float = 0.001) -> Attempt:
    return Attempt("10.96.0.10:80", "192.168.50.2", answer, error, seconds)


CHECK = Check("tcp", "10.96.0.10", 80, "192.168.50.2", note="why it fails")


@pytest.mark.parametrize(
    ("attempts", "outcome", "source"),
    [
        ([_attempt("web-0 peer=10.244.0.1:4000")] * 2 + [_attempt("web-2 peer=10.244.0.1:1")],
         "web-0: 2  web-2: 1", "masqueraded (10.244.0.1)"),
        ([_attempt("web-0 peer=192.168.50.2:4000")], "web-0: 1", "preserved (192.168.50.2)"),
        ([_attempt(None, "refused", 0.0004)] * 3, "refused in < 1 ms x3 (reject)", "why it fails"),
        ([_attempt(None, "refused", 0.003)] * 3, "refused in 3 ms x3 (reject)", "why it fails"),
        ([_attempt(None, "timeout", 0.5)] * 3, "no answer in 0.5 s x3 (drop)", "why it fails"),
        ([_attempt("web-1 peer=10.244.0.1:1"), _attempt(None, "timeout", 2.0)],
         "web-1: 1  + 1 timeout", "masqueraded (10.244.0.1)"),
    ],
    ids=["masqueraded", "preserved", "reject-fast", "reject", "drop", "partly"],
)
def test_outcomes_read_as_a_newcomer_wants(
    attempts: list[Attempt], outcome: str, source: str
) -> None:
    assert describe(Result(CHECK, tuple(attempts)), SANDBOX) == (outcome, source)


# --- the real thing ----------------------------------------------------------------------


def _ours(pid: int) -> set[str]:
    """The namespaces of the demo process `pid` (nftpx-<role>-<pid>-<hex>)."""
    return {n for n in kernel.namespaces() if f"-{pid}-" in n and n.startswith("nftpx-")}


def _blocks(report: str) -> dict[str, list[str]]:
    """The traffic report's rows by service port (the first report only)."""
    blocks: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in report.split("== nftproxy dump")[0].splitlines():
        if m := re.match(r"^  (\S+/\S+)  ", line):
            current = blocks.setdefault(m.group(1), [])
        elif current is not None and line.startswith("    ") and ("->" in line or "health" in line):
            current.append(line.strip())
    return blocks


def _row(rows: list[str], path: str) -> str:
    found = [r for r in rows if r.startswith(path + " ")]
    assert len(found) == 1, f"no single row {path!r} in {rows}"
    return found[0]


def _answers(row: str) -> dict[str, int]:
    return {pod: int(n) for pod, n in re.findall(r"\b(web-\d): (\d+)\b", row)}


@pytest.mark.kernel
def test_demo_once_reports_every_service_and_the_dump_and_cleans_up() -> None:
    kernel.require_root()
    before = kernel.namespaces()
    proc = subprocess.Popen([*DEMO, "--once"], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    finally:
        if proc.poll() is None:  # a hung demo: leave nothing behind
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert not _ours(proc.pid), "the demo left namespaces behind"
    assert not {n for n in kernel.namespaces() - before if f"-{proc.pid}-" in n}
    copy = re.search(r"source (/\S+/cluster\.yaml)", out)
    assert copy, out
    assert not Path(copy.group(1)).parent.exists(), "the temporary copy was left behind"

    blocks = _blocks(out)
    assert set(blocks) >= {
        "demo/web:http", "demo/web-np:http", "demo/web-local:http",
        "demo/sticky:http", "demo/dns:dns", "demo/empty:http",
    }, out  # fmt: skip

    for path, gateway in (("192.168.50.2 -> 10.96.0.10:80", "10.244.0.1"),
                          ("fd00:50::2 -> [fd00:96::10]:80", "fd00:244::1")):
        row = _row(blocks["demo/web:http"], path)
        answers = _answers(row)
        assert set(answers) == {"web-0", "web-2"}, row  # web-1 is terminating
        assert sum(answers.values()) == 20, row
        assert f"masqueraded ({gateway})" in row

    local = blocks["demo/web-local:http"]
    for path in ("192.168.50.2 -> 192.168.60.10:80", "192.168.50.2 -> 192.168.50.1:30081"):
        row = _row(local, path)
        assert _answers(row) == {"web-0": 20}, row  # the one local endpoint
        assert "preserved (192.168.50.2)" in row
    row = _row(local, "192.168.50.3 -> 192.168.60.10:80")
    assert "(drop)" in row and "outside loadBalancerSourceRanges" in row
    assert "HTTP 200, localEndpoints 1" in _row(local, "health check http://192.168.50.1:30500/")

    for path in ("192.168.50.2 -> 192.168.50.1:30080", "fd00:50::2 -> [fd00:50::1]:30080"):
        row = _row(blocks["demo/web-np:http"], path)
        assert sum(_answers(row).values()) == 20 and "masqueraded" in row, row

    sticky = _answers(_row(blocks["demo/sticky:http"], "192.168.50.2 -> 10.96.0.40:80"))
    assert list(sticky.values()) == [20], sticky

    dns = _row(blocks["demo/dns:dns"], "192.168.50.2 -> 10.96.0.53:53")
    assert "udp" in dns and sum(_answers(dns).values()) == 20, dns

    empty = _row(blocks["demo/empty:http"], "192.168.50.2 -> 10.96.0.99:80")
    assert "refused" in empty and "(reject)" in empty and not _answers(empty), empty

    dump = out.split("== nftproxy dump", 1)[1]
    assert "table ip nftproxy:" in dump and "table ip6 nftproxy:" in dump
    assert "demo/web:http (tcp)" in dump and "KUBE-SEP-" in dump


class _Lines:
    """A running demo's stdout, line by line, with deadlines."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.seen: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def until(self, pattern: str, timeout: float = 30.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
            if m := re.search(pattern, line):
                return m
        pytest.fail(f"no line matching {pattern!r}; output:\n" + "\n".join(self.seen))


@pytest.fixture
def running_demo(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], _Lines]]:
    """`nftproxy demo` (no --once) in its own process group, stderr to a file."""
    kernel.require_root()
    with (tmp_path / "stderr").open("w") as err:
        proc = subprocess.Popen(DEMO, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                                stderr=err, start_new_session=True)
        try:
            yield proc, _Lines(proc)
        finally:
            if proc.poll() is None:  # the test failed half-way: still clean up
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            assert not _ours(proc.pid), "the demo left namespaces behind"


@pytest.mark.kernel
def test_editing_the_file_reprograms_and_sigint_cleans_up(
    running_demo: tuple[subprocess.Popen[str], _Lines],
) -> None:
    proc, lines = running_demo
    path = Path(lines.until(r"^edit (/\S+/cluster\.yaml) to re-program").group(1))
    assert _ours(proc.pid), "the demo runs in namespaces named after its pid"
    first = "\n".join(lines.seen)
    assert "refused" in _row(_blocks(first)["demo/empty:http"], "192.168.50.2 -> 10.96.0.99:80")

    text = path.read_text()
    assert text.count("  ports: null\n  endpoints: null") == 1
    path.write_text(text.replace(
        "  ports: null\n  endpoints: null",
        "  ports:\n  - name: http\n    port: 8080\n    protocol: TCP\n"
        "  endpoints:\n  - addresses:\n    - 10.244.0.12\n    nodeName: demo-node",
    ))
    lines.until(r"changed: re-programmed")
    start = len(lines.seen)
    lines.until(r"^edit .* to re-program")
    again = "\n".join(lines.seen[start:])
    row = _row(_blocks(again)["demo/empty:http"], "192.168.50.2 -> 10.96.0.99:80")
    assert _answers(row) == {"web-1": 20}, row

    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    assert not _ours(proc.pid)
    assert not path.parent.exists(), "the temporary copy was left behind"


@pytest.mark.kernel
def test_ctrl_c_in_the_middle_of_a_report_exits_cleanly(
    running_demo: tuple[subprocess.Popen[str], _Lines],
) -> None:
    """As a terminal's Ctrl-C: SIGINT to the whole process group (the
    backends and the probes in flight get it too)."""
    proc, lines = running_demo
    lines.until(r"^agent: node demo-node")  # the first sync is done; traffic starts
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    assert not _ours(proc.pid)
