"""`nftproxy trace SRC DST:PORT[/PROTO]`: the command around the interpreter.

Aspects:
- with --source FILE it needs no root and no kernel: it traces what a sync
  from FILE would program (the sample's ClusterIP, LoadBalancer from an
  allowed and a disallowed source, Local-policy NodePort), in text and JSON;
- --from defaults from the address (node's own / cluster CIDR or podCIDR /
  anything else), and can be given;
- bad arguments exit 2 with one line; no table, or a rule it cannot
  interpret, exit 1; without --source it needs root;
- live: on a node programmed by `nftproxy sync`, tracing the programmed
  tables gives the same answer as tracing the files (kernel test);
- docs/trace.md's examples are the command's real output;
- the parser every `nftproxy` builds loads no trace interpreter.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_cli import _no_node_name_env, not_root  # noqa: F401  (fixtures, shared)

from nftproxy.core.trace.packet import Origin
from nftproxy.kernel import netns as nsutil
from nftproxy.tools import cli
from nftproxy.tools.trace_flags import ORIGINS

SAMPLE = str(Path(__file__).resolve().parents[1] / "nftproxy" / "examples" / "cluster.yaml")
PODS = "10.244.0.0/16,fd00:244::/48"
NFTPROXY = [sys.executable, "-m", "nftproxy"]


def trace(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(["trace", "--source", SAMPLE, "--cluster-cidr", PODS, *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def trace_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    rc, out, err = trace(capsys, "--json", *argv)
    assert rc == 0, err
    doc: dict[str, Any] = json.loads(out)
    return doc


@pytest.mark.usefixtures("not_root")
def test_cluster_ip_from_the_files_without_root(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = trace(capsys, "192.168.50.2", "10.96.0.10:80")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == "192.168.50.2 -> 10.96.0.10:80/tcp from external  (table ip nftproxy)"
    # a cluster-IP-only port: its KUBE-SVC is named by the service-ips element
    # that goes to the shared chooser standing in for it
    assert lines[1] == ("  service demo/web:http: KUBE-SVC-XRY76EGRC3BSCIIJ "
                        "(shared chooser dispatch-tcp-2)")
    assert lines[2].split()[:3] == ["50.00%", "10.244.0.11:8080", "KUBE-SEP-QRUEL26JRDPVFLID"]
    assert "masqueraded: off-cluster source to a cluster IP" in lines[2]
    assert lines[3].split()[:2] == ["50.00%", "10.244.1.13:8080"]
    assert "  steps (shared by every path):" in lines
    assert any("@service-ips: 10.96.0.10 . tcp . 80 : goto dispatch-tcp-2" in line
               and line.endswith("(demo/web:http KUBE-SVC-XRY76EGRC3BSCIIJ)") for line in lines)
    assert any(line.startswith("  path 2 (50.00%, 10.244.1.13:8080):") for line in lines)


def test_load_balancer_source_ranges_allowed_and_denied(capsys: pytest.CaptureFixture[str]) -> None:
    allowed = trace_json(capsys, "192.168.50.2", "192.168.60.10:80")
    (path,) = allowed["paths"]
    assert (path["verdict"], path["endpoint"]["address"], path["masquerade"]) == (
        "accept", "10.244.0.11", False)
    # KUBE-FW-<h> is no chain in ruleset v2: the firewall-vips element's comment names it
    assert path["chains"] == ["KUBE-EXT-EPQ2GAXAICHDUGFX", "KUBE-SVL-EPQ2GAXAICHDUGFX"]
    assert path["firewall"] == "KUBE-FW-EPQ2GAXAICHDUGFX"
    assert path["endpoint"]["identity"] == "KUBE-SEP-YZLWVCKNA5MIF3EP"
    denied = trace_json(capsys, "192.168.50.3", "192.168.60.10:80")
    assert [(p["verdict"], p["reasons"], p["firewall"]) for p in denied["paths"]] == [
        ("drop", ["source 192.168.50.3 is outside the service's loadBalancerSourceRanges"],
         "KUBE-FW-EPQ2GAXAICHDUGFX")]
    rc, out, _ = trace(capsys, "192.168.50.3", "192.168.60.10:80")
    assert rc == 0 and "  service demo/web-local:http: KUBE-FW-EPQ2GAXAICHDUGFX\n" in out


def test_local_policy_node_port(capsys: pytest.CaptureFixture[str]) -> None:
    external = trace_json(capsys, "192.168.50.2", "192.168.50.1:30081")
    assert [(p["endpoint"]["address"], p["masquerade"], p["reasons"][0])
            for p in external["paths"]] == [
        ("10.244.0.11", False, "externalTrafficPolicy=Local: the client's address is kept")]
    node = trace_json(capsys, "192.168.50.1", "192.168.50.1:30081")
    assert node["packet"]["from"] == "node"  # the node's own address
    assert sorted(p["endpoint"]["address"] for p in node["paths"]) == ["10.244.0.11",
                                                                         "10.244.1.13"]
    assert all(p["masquerade"] for p in node["paths"])


def test_from_is_inferred_and_can_be_given(capsys: pytest.CaptureFixture[str]) -> None:
    assert trace_json(capsys, "10.244.0.12", "10.96.0.10:80")["packet"]["from"] == "pod"
    given = trace_json(capsys, "--from", "external", "10.244.0.12", "10.96.0.10:80")
    assert given["packet"]["from"] == "external"
    rc = cli.main(["trace", "--source", SAMPLE, "--json", "10.244.0.12", "10.96.0.10:80"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["packet"]["from"] == "pod"  # the Node's podCIDRs, no --cluster-cidr


def test_ipv6_and_udp(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = trace(capsys, "fd00:50::2", "[fd00:96::99]:53/udp")
    assert rc == 0
    assert out.splitlines()[0].startswith("fd00:50::2 -> [fd00:96::99]:53/udp from external")
    assert "dropped: fd00:96::99 is in a ServiceCIDR but no service has it" in out


@pytest.mark.parametrize("argv", [
    ["10.0.0.1", "10.96.0.10"],            # no port
    ["10.0.0.1", "10.96.0.10:80/icmp"],    # protocol
    ["nonsense", "10.96.0.10:80"],          # source
    ["10.0.0.1", "[fd00::1]:80"],          # families differ
])
def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    rc, out, err = trace(capsys, *argv)
    assert rc == 2 and not out
    assert err.startswith("nftproxy: trace: ") and len(err.splitlines()) == 1


def test_unreadable_files_exit_1(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc = cli.main(["trace", "--source", str(tmp_path / "missing.yaml"), "10.0.0.1",
                   "10.96.0.10:80"])
    assert rc == 1
    assert capsys.readouterr().err.startswith("nftproxy: trace: ")


@pytest.mark.usefixtures("not_root")
def test_live_trace_needs_root(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["trace", "10.0.0.1", "10.96.0.10:80"]) == 1
    assert "needs root" in capsys.readouterr().err


def _in(ns: str, *argv: str) -> Any:
    return nsutil.exec_in(ns, [*NFTPROXY, *argv], check=False)


def test_live_trace_matches_the_files(netns: str) -> None:
    nsutil.exec_in(netns, ["ip", "addr", "add", "192.168.50.1/32", "dev", "lo"], check=True)
    nsutil.exec_in(netns, ["ip", "link", "set", "lo", "up"], check=True)
    none = _in(netns, "trace", "192.168.50.2", "10.96.0.10:80")
    assert none.returncode == 1 and "has not programmed this node" in none.stderr
    assert _in(netns, "sync", "--source", SAMPLE, "--cluster-cidr", PODS).returncode == 0
    for src, dst in (("192.168.50.2", "10.96.0.10:80"), ("192.168.50.3", "192.168.60.10:80"),
                     ("192.168.50.2", "192.168.50.1:30081"), ("10.244.0.11", "10.96.0.53:53/udp")):
        live = _in(netns, "trace", "--json", "--cluster-cidr", PODS, src, dst)
        planned = _in(netns, "trace", "--json", "--cluster-cidr", PODS, "--source", SAMPLE,
                      src, dst)
        assert live.returncode == 0, live.stderr
        assert _answers(live.stdout) == _answers(planned.stdout), (src, dst)


def _answers(text: str) -> list[Any]:
    doc = json.loads(text)
    return [(p["probability_fraction"], p["verdict"], p["endpoint"], p["masquerade"],
             p["reasons"], [(s["hook"], s["chain"], s["rule"]) for s in p["steps"]])
            for p in doc["paths"]]


def _readme_examples() -> list[tuple[list[str], list[str]]]:
    """(argv, printed lines) of every `$ nftproxy trace` in docs/trace.md's examples."""
    text = (Path(SAMPLE).parents[2] / "docs" / "trace.md").read_text()
    section = text.split("## Tracing a packet", 1)[1].split("\n## ", 1)[0]
    examples: list[tuple[list[str], list[str]]] = []
    for block in section.split("```")[1::2]:
        for chunk in block.split("$ nftproxy ")[1:]:
            command, *printed = chunk.strip("\n").splitlines()
            shown = [line for line in printed if line and line != "  (steps left out)"]
            examples.append((shlex.split(command), shown))
    return examples


def test_the_documented_examples_are_real_output(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    examples = _readme_examples()
    assert len(examples) == 5
    monkeypatch.chdir(Path(SAMPLE).parents[2])
    for argv, shown in examples:
        assert cli.main(argv) == 0
        printed = [line for line in capsys.readouterr().out.splitlines() if line]
        assert printed[: len(shown)] == shown, argv


def test_the_trace_flags_offer_every_origin() -> None:
    assert tuple(o.value for o in Origin) == ORIGINS


def test_the_command_line_loads_the_interpreter_only_for_trace_and_dump() -> None:
    """Every `nftproxy` builds the whole parser: the agent's start must not
    pay for the trace interpreter (tools/trace_flags.py)."""
    code = (
        "import sys, nftproxy.tools.cli; print(sorted(m for m in sys.modules if m.startswith("
        "('nftproxy.core.trace', 'nftproxy.tools.dump')) or m in "
        "('nftproxy.tools.trace', 'nftproxy.tools.trace_live')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
