"""The `nftproxy` command line.

Aspects: help for every subcommand, listing exactly the flags it reads
(each listed configuration flag changes the ProxyConfig it builds);
`sync --dry-run` prints the model of the sample cluster without root; `sync`
needs no --once but still accepts it; configuration errors exit 2 with one
line naming the field or flag; --config-hard-fail turns config warnings into
that error; boolean flags take kube-proxy's --flag[=true|false]; kernel
commands refuse to run without root.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import pytest

from nftproxy.tools import cli

EXAMPLE = Path(__file__).resolve().parents[1] / "nftproxy" / "examples" / "cluster.yaml"
COMMANDS = ["run", "sync", "dump", "cleanup", "demo"]


@pytest.fixture(autouse=True)
def _no_node_name_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)


@pytest.fixture
def not_root(monkeypatch: pytest.MonkeyPatch) -> None:
    # no seam for the euid yet: the check is one os.geteuid() call in cli.py
    monkeypatch.setattr("os.geteuid", lambda: 1000)


def dry_run(*extra: str) -> list[str]:
    return ["sync", "--once", "--dry-run", "--source", str(EXAMPLE), *extra]


@pytest.mark.parametrize("argv", [["--help"], *[[c, "--help"] for c in COMMANDS]], ids=str)
def test_help_works_for_every_command(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: nftproxy")
    if argv != ["--help"]:
        assert "--table-name" in out


def test_no_command_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "commands" in capsys.readouterr().err


def test_sync_dry_run_prints_the_sample_clusters_model(
    capsys: pytest.CaptureFixture[str], not_root: None
) -> None:
    assert cli.main(dry_run("--json")) == 0
    captured = capsys.readouterr()
    commands = [json.loads(line) for line in captured.out.splitlines()]
    mark = "managed by nftproxy"
    # one transaction, JSON a line: per family its marked tables first ...
    assert commands[0] == {"add": {"table": {"family": "ip", "name": "nftproxy", "comment": mark}}}
    assert {"add": {"table": {"family": "ip6", "name": "nftproxy", "comment": mark}}} in commands
    assert sum(mark in json.dumps(c) for c in commands) == 4  # and their affinity tables
    # ... then the maps (and set) with an integer key, declared by typeof like
    # every other, each only where a port of the sample uses it (shared
    # objects come with their first user): IPv4's TCP and UDP (demo/dns)
    # choosers, the local ones of demo/web-local's eTP=Local LB and node
    # port, the affinity set (demo/sticky); IPv6's web and web-np (TCP, eTP=Cluster)
    declared = [(spec["family"], spec["name"]) for c in commands for kind, spec in
                c.get("add", {}).items() if kind in ("set", "map")
                and "numgen" in json.dumps(spec["type"])]
    assert sorted(declared) == sorted([
        ("ip", "vip-endpoints-tcp"), ("ip", "vip-endpoints-udp"),
        ("ip", "vip-local-endpoints-tcp"), ("ip", "nodeport-endpoints-tcp"),
        ("ip", "nodeport-local-endpoints-tcp"), ("ip", "affinity"),
        ("ip6", "vip-endpoints-tcp"), ("ip6", "nodeport-endpoints-tcp"),
    ])
    out = captured.err
    lines = [ln for ln in out.splitlines() if " INFO " not in ln]
    assert lines[0].startswith("dry run: 6 services, 8 endpoint slices")
    assert "node demo-node: 192.168.50.1, fd00:50::1; zone zone-a" in out
    assert "service CIDRs: 10.96.0.0/16, fd00:96::/112" in out

    def row(service_port: str, family: str) -> str:
        (line,) = [ln for ln in lines if ln.split()[:2] == [service_port, family]]
        return line

    web4 = row("demo/web:http", "IPv4")
    assert "10.96.0.10" in web4 and "80/TCP" in web4
    assert "3 (2 ready, 1 serving-terminating, 2 local)" in web4
    assert "fd00:96::10" in row("demo/web:http", "IPv6")
    assert "nodePort 30080" in row("demo/web-np:http", "IPv4")
    local = row("demo/web-local:http", "IPv4")
    assert "LB 192.168.60.10" in local and "eTP=Local" in local and "healthCheck=30500" in local
    assert "2 (2 ready, 1 local)" in local
    assert "affinity=ClientIP/600s" in row("demo/sticky:http", "IPv4")
    assert "53/UDP" in row("demo/dns:dns", "IPv4")
    assert "0 (rejects)" in row("demo/empty:http", "IPv4")


def test_sync_dry_run_with_another_node_name_sees_no_local_endpoints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(dry_run("--node-name", "other-node")) == 0
    out = capsys.readouterr().err
    assert "node other-node: no Node object" in out
    web = next(ln for ln in out.splitlines() if ln.startswith("demo/web:http "))
    assert "1 local" in web  # 10.244.1.13 runs on other-node


def test_sync_syncs_once_without_the_once_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["sync", "--dry-run", "--source", str(EXAMPLE)]) == 0
    assert "\ndry run: 6 services" in "\n" + capsys.readouterr().err


def test_once_is_still_accepted_but_no_longer_shown(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(dry_run()) == 0  # dry_run() passes --once, as old scripts do
    with pytest.raises(SystemExit):
        cli.main(["sync", "--help"])
    out = capsys.readouterr().out
    assert "--once" not in out and "for now" not in out


def test_sync_with_a_broken_source_fails_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: Service\nmetadata: [\n")
    assert cli.main(["sync", "--once", "--dry-run", "--source", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"nftproxy: sync: {bad}:")
    assert err.count("\n") == 1


def config_file(tmp_path: Path, body: str) -> Path:
    """A v1alpha1 KubeProxyConfiguration with `body` after its header."""
    path = tmp_path / "kp.yaml"
    path.write_text(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n" + body
    )
    return path


def test_a_config_file_error_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = config_file(tmp_path, "nftables:\n  masqueradeBit: 40\n")
    assert cli.main(dry_run("--config", str(config))) == 2
    err = capsys.readouterr().err
    assert err == f"nftproxy: config: {config}: nftables.masqueradeBit: 40 is not in 0..31\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (dry_run("--masquerade-bit", "32"), "--masquerade-bit: 32 is not in 0..31"),
        # the agent's flags are not `sync` flags; the error comes before the root check
        (["demo", "--once", "--sync-period", "30"], "--sync-period: invalid duration '30'"),
        (dry_run("--cluster-cidr", "10.0.0.0/8,x"), "--cluster-cidr: 'x' is not a CIDR"),
        (dry_run("--nodeport-addresses", "primary,lo"), "--nodeport-addresses: 'lo' is not a CIDR"),
        (dry_run("--feature-gates", "KubeProxyNFTablesLocalhostNodePorts"), "--feature-gates: "),
        (dry_run("--detect-local-mode", "BridgeInterface"), "--detect-local-mode: detectLocalMode"),
    ],
)
def test_a_flag_error_exits_2_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"nftproxy: config: {message}")
    assert err.count("\n") == 1


def test_flags_override_the_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "kp.yaml"
    config.write_text("kind: KubeProxyConfiguration\nhostnameOverride: other-node\n")
    assert cli.main(dry_run("--config", str(config), "--node-name", "demo-node")) == 0
    assert "node demo-node:" in capsys.readouterr().err


def test_config_warnings_are_logged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    config = tmp_path / "kp.yaml"
    config.write_text("kind: KubeProxyConfiguration\nmode: ipvs\n")
    with caplog.at_level(logging.WARNING):
        assert cli.main(dry_run("--config", str(config))) == 0
    assert any("mode: 'ipvs' ignored" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "argv",
    [["run"], ["dump"], ["cleanup"], ["demo", "--once"], ["sync", "--once", "--source", "x.yaml"]],
    ids=str,
)
def test_kernel_commands_need_root(
    argv: list[str], not_root: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "needs root (CAP_NET_ADMIN)" in err
    assert err.count("\n") == 1


# ---- each subcommand's flags ---------------------------------------------------------

SHARED = {"-h", "--help", "-v", "--verbose", "--table-name"}
RULESET = {
    "--config", "--config-hard-fail", "--node-name", "--node-ip", "--cluster-cidr",
    "--detect-local-mode", "--pod-bridge-interface", "--pod-interface-name-prefix",
    "--nodeport-addresses", "--masquerade-all", "--masquerade-bit",
    "--allow-service-external-ips", "--feature-gates",
}
AGENT = {
    "--healthz-bind-address", "--metrics-bind-address", "--bind-address-hard-fail",
    "--sync-period", "--min-sync-period",
}
MARKER = {"--kube-proxy-marker"}
FLAGS = {
    "run": SHARED | RULESET | AGENT | MARKER | {"--kubeconfig", "--source", "--allow-empty"},
    "sync": SHARED | RULESET | MARKER | {"--source", "--dry-run", "--json", "--allow-empty"},
    "dump": SHARED | {"--json", "--service"},
    "cleanup": SHARED,
    "demo": SHARED | RULESET | AGENT | {"--once", "--source"},
}
REQUIRED = {"sync": ["--source", "x.yaml"]}
# a value for each configuration flag other than the default (None: the flag alone)
NON_DEFAULT = {
    "--table-name": "other", "--node-name": "node-9", "--node-ip": "10.9.0.1",
    "--cluster-cidr": "10.9.0.0/16", "--detect-local-mode": "NodeCIDR",
    "--pod-bridge-interface": "br9", "--pod-interface-name-prefix": "veth9",
    "--nodeport-addresses": "primary", "--masquerade-all": None, "--masquerade-bit": "3",
    "--allow-service-external-ips": "false",
    "--feature-gates": "KubeProxyNFTablesLocalhostNodePorts=true",
    "--healthz-bind-address": "127.0.0.1:9",
    "--metrics-bind-address": "", "--bind-address-hard-fail": None, "--sync-period": "45s",
    "--min-sync-period": "2s", "--kube-proxy-marker": "false",
}


def help_flags(command: str, capsys: pytest.CaptureFixture[str]) -> set[str]:
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    flags: set[str] = set()
    for line in capsys.readouterr().out.splitlines():
        option = re.match(r"\s{2}(?:(-\w), )?(--[\w-]+)", line)  # "  -v, --verbose ..."
        if option:
            flags.update(f for f in option.groups() if f)
    return flags


@pytest.mark.parametrize("command", sorted(FLAGS))
def test_each_subcommand_shows_only_the_flags_it_uses(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert help_flags(command, capsys) == FLAGS[command]


@pytest.mark.parametrize(
    ("command", "flag"),
    [(c, f) for c, flags in sorted(FLAGS.items()) for f in sorted(flags & set(NON_DEFAULT))],
)
def test_every_configuration_flag_a_subcommand_shows_is_read(command: str, flag: str) -> None:
    parser = cli.build_parser()
    base = [command, *REQUIRED.get(command, [])]
    value = NON_DEFAULT[flag]
    given = [flag] if value is None else [f"{flag}={value}"]
    default = cli._load_config(parser.parse_args(base))
    assert cli._load_config(parser.parse_args([*base, *given])) != default


@pytest.mark.parametrize(
    ("given", "expected"),
    [([], True), (["--allow-service-external-ips"], True),
     (["--allow-service-external-ips=false"], False),
     (["--allow-service-external-ips", "true"], True)],
)
def test_boolean_flags_take_kube_proxy_values(given: list[str], expected: bool) -> None:
    args = cli.build_parser().parse_args(["sync", "--source", "x.yaml", *given])
    assert cli._load_config(args).allow_service_external_ips is expected


def test_config_hard_fail_flag_turns_warnings_into_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = config_file(tmp_path, "masqueradeBitt: 3\n")
    assert cli.main(dry_run("--config", str(config))) == 0  # v1alpha1: a warning
    capsys.readouterr()
    assert cli.main(dry_run("--config", str(config), "--config-hard-fail")) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"nftproxy: config: {config}: configHardFail: masqueradeBitt:")
    assert err.count("\n") == 1


def test_run_posts_an_event_about_the_object_with_an_invalid_field(tmp_path: Path) -> None:
    """`run` with the API source: each invalid field the Intake reports
    becomes one Warning Event about the object it is in."""
    from fakeapi import FakeApiServer

    from nftproxy.agent.intake import InvalidField
    from nftproxy.core.convert import Problem

    server = FakeApiServer()
    server.start()
    try:
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        report = cli._kube_source(kubeconfig, "node-a")[1].on_invalid_field
        assert report is not None
        problem = Problem("EndpointSlice", "ns/web-1", "endpoints[1].addresses[0]",
                          "invalid IP address '10.0.1.999'")
        report(InvalidField(problem, "ns", "web-1", "u-1"))
        deadline = time.monotonic() + 10
        while not server.objects("Event") and time.monotonic() < deadline:
            time.sleep(0.02)
        (event,) = server.objects("Event").values()
    finally:
        server.stop()
    assert event["metadata"]["namespace"] == "ns"
    assert event["involvedObject"] == {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
                                       "namespace": "ns", "name": "web-1", "uid": "u-1"}
    assert (event["type"], event["reason"]) == ("Warning", "InvalidFieldSkipped")
    assert event["message"] == str(problem)
