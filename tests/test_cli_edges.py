"""Small CLI defects of tracker issue 36 (case 7), without root.

Aspects:
- `sync --dry-run` is deterministic (the same bytes whatever the hash
  seed), prints its plan on stdout as nft text (`--json`: one JSON object
  a line) and its summary on stderr;
- a closed stdout (`| head -1`) ends the command quietly, exit 141, no traceback;
- unprivileged `dump` says it needs root to read nftables;
- `dump`'s text has no empty `chains:` line and escapes control characters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nftproxy.tools import cli
from nftproxy.tools.dump import NoEndpoints, ServiceView, TableView, render_text

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "nftproxy" / "examples" / "cluster.yaml"
DRY_RUN = [sys.executable, "-m", "nftproxy", "sync", "--dry-run", "--source", str(EXAMPLE)]


@pytest.fixture(autouse=True)
def _no_node_name_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)


def _env(seed: str) -> dict[str, str]:
    return {**os.environ, "PYTHONHASHSEED": seed}


def test_the_dry_run_prints_the_same_plan_whatever_the_hash_seed() -> None:
    runs = [
        subprocess.run(DRY_RUN, capture_output=True, text=True, check=True, cwd=REPO,
                       env=_env(seed))
        for seed in ("1", "2", "3")
    ]
    assert runs[0].stdout and runs[0].stdout == runs[1].stdout == runs[2].stdout


def test_the_dry_run_plan_is_nft_text_on_stdout_and_the_summary_on_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["sync", "--dry-run", "--source", str(EXAMPLE)]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].startswith("add table ip nftproxy")
    assert not any(line.startswith("{") for line in lines)
    assert any(line.startswith("add map ip nftproxy service-ips { typeof ") for line in lines)
    assert any(line.startswith("add element ip nftproxy service-ips {") for line in lines)
    assert "dry run: 6 services" in captured.err and "add table" not in captured.err


def test_the_dry_run_plan_is_json_with_the_json_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["sync", "--dry-run", "--json", "--source", str(EXAMPLE)]) == 0
    commands = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert any("add" in c and "table" in c["add"] for c in commands)


@pytest.mark.parametrize(
    "argv",
    [
        ["sync", "--dry-run", "--source", str(EXAMPLE)],
        ["trace", "--source", str(EXAMPLE), "--json", "192.168.50.2", "10.96.0.10:80"],
    ],
    ids=["sync --dry-run", "trace --json"],
)
def test_a_closed_stdout_ends_the_command_quietly(argv: list[str]) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "nftproxy", *argv],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
    )
    assert proc.stdout is not None
    proc.stdout.close()  # the reader went away before a byte was written (`| head -c 0`)
    _, err = proc.communicate(timeout=60)
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()
    assert proc.returncode == 141


def test_dump_without_root_says_it_needs_root_to_read(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert cli.main(["dump"]) == 1
    err = capsys.readouterr().err
    assert "needs root (CAP_NET_ADMIN) to read nftables" in err and "program" not in err


def _view(service: ServiceView) -> TableView:
    return TableView("ip", "nftproxy", [service], chains=1, rules=1, elements=1)


def test_dump_prints_no_empty_chains_line() -> None:
    empty = ServiceView("demo/empty:http", "tcp", "ip",
                        no_endpoints=[NoEndpoints("10.96.0.99", 80, "goto KUBE-REJECT")])
    text = render_text(_view(empty))
    assert "no endpoints: 10.96.0.99:80 -> goto KUBE-REJECT" in text
    assert not [line for line in text.splitlines() if line.strip() == "chains:"]
    with_chains = ServiceView("demo/web:http", "tcp", "ip", chains=["KUBE-SVC-X"])
    assert "    chains: KUBE-SVC-X" in render_text(_view(with_chains)).splitlines()


def test_dump_escapes_control_characters_in_names() -> None:
    text = render_text(_view(ServiceView("demo/we\nb\x1b[31m:http", "tcp", "ip")))
    assert "\x1b" not in text
    assert "  demo/we\\nb\\x1b[31m:http (tcp)" in text.splitlines()
