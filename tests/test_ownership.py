"""Table ownership and the flags with a kernel limit (no kernel needed).

Aspects: every table nftproxy creates carries its mark (ops, nft text,
declarations, the fake kernel, which keeps the comment a table was created
with); the decision that a table of our name without the mark is someone
else's; other programs' table names refused as tableName, whatever their
case, from a flag or the file; interface names and prefixes that the
kernel could not hold refused before anything is written, naming the flag
or the field. tests/test_ownership_kernel.py runs the commands against
real tables.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from builders import SVC1, endpoint, render

from nftproxy.core.config import ProxyConfig
from nftproxy.core.model import IPFamily, NodeInfo
from nftproxy.core.nft.commands import AddTable, Where
from nftproxy.core.nft.jsontext import command_json
from nftproxy.core.nft.nfttext import transaction_text
from nftproxy.core.nft.ops import Table
from nftproxy.core.nft.ownership import (
    TABLE_MARK,
    FoundTable,
    foreign_table,
    our_tables,
    refusal,
)
from nftproxy.core.nft.plan import SKELETON, TableState, stage_full
from nftproxy.core.rules.skeleton import render_skeleton
from nftproxy.kernel.fake import FakeBackend
from nftproxy.tools import cli
from nftproxy.tools.config_load import build_config
from nftproxy.tools.config_values import WELL_KNOWN_TABLES, ConfigError

SAMPLE = str(Path(__file__).resolve().parent.parent / "nftproxy" / "examples" / "cluster.yaml")


@pytest.fixture
def fake() -> FakeBackend:
    backend = FakeBackend()
    backend.start()
    return backend


# --- the mark ---------------------------------------------------------------------------


def test_our_tables_are_the_main_and_affinity_tables_of_both_families() -> None:
    tables = our_tables("t")
    for family in ("ip", "ip6"):
        assert (family, "t") in tables and (family, "t-affinity") in tables
    assert {family for family, _ in tables} == {"ip", "ip6"}


def test_every_table_nftproxy_adds_carries_the_mark() -> None:
    adds = Table("ip6", "t").add_tables()
    assert [command_json(a)["add"]["table"] for a in adds] == [
        {"family": "ip6", "name": "t", "comment": TABLE_MARK},
        {"family": "ip6", "name": "t-affinity", "comment": TABLE_MARK},
    ]
    assert transaction_text(adds) == (
        f'add table ip6 t {{ comment "{TABLE_MARK}"; }}\n'
        f'add table ip6 t-affinity {{ comment "{TABLE_MARK}"; }}\n'
    )


def test_a_first_sync_creates_its_tables_with_the_mark_in_its_own_transaction() -> None:
    """Tables, marks and declarations go in the sync's one transaction (a
    chooser's map included): nothing is declared ahead of it."""
    config = ProxyConfig(node_name="n", node_ips=("192.168.50.1",))
    skeleton = render_skeleton(IPFamily.IPV4, config, NodeInfo(name="n", ipv4=("192.168.50.1",)))
    port = render(SVC1, [endpoint("10.180.0.1"), endpoint("10.180.0.2")]).fragment
    desired = {SKELETON: skeleton, SVC1.name: port}
    staged = stage_full(TableState(IPFamily.IPV4, Table("ip", "t")), None, desired)
    text = transaction_text(staged.commands)
    assert text.startswith(f'add table ip t {{ comment "{TABLE_MARK}"; }}\n'
                           f'add table ip t-affinity {{ comment "{TABLE_MARK}"; }}\n')
    assert text.count("comment \"" + TABLE_MARK) == 2
    assert "add map ip t vip-endpoints-tcp { typeof ip daddr . tcp dport . numgen" in text


def test_the_fake_keeps_the_mark_of_tables_it_creates(fake: FakeBackend) -> None:
    fake.commit([*Table("ip", "t").add_tables(), *Table("ip6", "t").add_tables()])
    found = fake.find_tables("t")
    assert {(f.family, f.name) for f in found} == {
        ("ip", "t"), ("ip", "t-affinity"), ("ip6", "t"), ("ip6", "t-affinity")
    }
    assert all(f.marked for f in found)
    assert foreign_table(found) is None


def test_adding_a_table_that_exists_does_not_mark_it(fake: FakeBackend) -> None:
    """The kernel keeps the comment a table was created with."""
    fake.commit([AddTable(Where("ip", "t"))])
    fake.commit(Table("ip", "t").add_tables())
    assert FoundTable("ip", "t", None) in fake.find_tables("t")
    assert foreign_table(fake.find_tables("t")) == FoundTable("ip", "t", None)


def test_find_tables_names_only_tables_of_that_name(fake: FakeBackend) -> None:
    fake.commit([AddTable(Where(f, n))
                 for f, n in (("ip", "nat"), ("ip6", "filter"), ("inet", "t"))])
    assert fake.find_tables("t") == []
    assert fake.find_tables("nat") == [FoundTable("ip", "nat", None)]


# --- the decision -----------------------------------------------------------------------


def test_a_table_without_the_mark_is_foreign() -> None:
    ours = FoundTable("ip", "t", TABLE_MARK)
    assert foreign_table([]) is None
    assert foreign_table([ours, FoundTable("ip6", "t", TABLE_MARK)]) is None
    theirs = FoundTable("ip6", "t-affinity", "something else")
    assert foreign_table([ours, theirs]) == theirs
    assert foreign_table([FoundTable("ip", "t"), theirs]) == FoundTable("ip", "t")


def test_the_refusal_names_the_table_and_the_way_out() -> None:
    text = refusal(FoundTable("ip6", "nat"))
    assert "table ip6 nat " in text
    assert "--table-name" in text and "tableName" in text
    assert "\n" not in text


# --- other programs' table names --------------------------------------------------------


@pytest.mark.parametrize("name", ["nat", "NAT", "filter", "Mangle", "raw", "security",
                                  "broute", "kube-proxy", "firewalld", "firewalld_policy_drop"])
def test_another_programs_table_name_is_refused_from_a_flag(name: str) -> None:
    with pytest.raises(ConfigError, match=rf"^--table-name: '{name}' is another program's"):
        build_config({}, {"table_name": name})


def test_another_programs_table_name_is_refused_from_the_file() -> None:
    with pytest.raises(ConfigError, match=r"^tableName: 'filter' is another program's"):
        build_config({"table_name": "filter"}, {})


def test_names_near_another_programs_are_ours() -> None:
    for name in ("nftproxy", "natx", "my-filter", "kube-proxy2"):
        assert build_config({}, {"table_name": name}).table_name == name
    assert "nftproxy" not in WELL_KNOWN_TABLES


@pytest.mark.parametrize("name", ["nftproxy-b", "nftproxy-affinity", "x-b-affinity"])
def test_a_name_another_names_tables_take_is_refused(name: str) -> None:
    """`<name>-b` and `<name>-affinity` are tables of another name's pair:
    a second proxy so named would take over the first one's."""
    with pytest.raises(ConfigError, match=rf"^--table-name: '{name}' is named like the table"):
        build_config({}, {"table_name": name})
    assert build_config({}, {"table_name": "nftproxy-bb"}).table_name == "nftproxy-bb"


def test_a_table_name_leaves_room_for_every_suffix() -> None:
    longest = max(len(name) - len("x") for _, name in our_tables("x"))
    fits = "a" * (255 - longest)
    assert build_config({}, {"table_name": fits}).table_name == fits
    with pytest.raises(ConfigError, match=r"^--table-name: "):
        build_config({}, {"table_name": fits + "a"})


# --- interface names --------------------------------------------------------------------


PREFIX_MODE: dict[str, Any] = {"detect_local_mode": "InterfaceNamePrefix"}
BRIDGE_MODE: dict[str, Any] = {"detect_local_mode": "BridgeInterface"}


def test_an_interface_name_prefix_fits_with_its_wildcard() -> None:
    """nft matches PREFIX*, and the '*' takes one of IFNAMSIZ's 15 bytes."""
    config = build_config({}, {**PREFIX_MODE, "interface_name_prefix": "a" * 14})
    assert config.interface_name_prefix == "a" * 14
    with pytest.raises(ConfigError, match=r"^--pod-interface-name-prefix: 'a{15}' is longer "
                                          r"than 14 bytes"):
        build_config({}, {**PREFIX_MODE, "interface_name_prefix": "a" * 15})
    with pytest.raises(ConfigError, match=r"^detectLocal\.interfaceNamePrefix: .* 14 bytes"):
        build_config({**PREFIX_MODE, "interface_name_prefix": "veth-long-prefix"}, {})


def test_an_interface_name_prefix_is_counted_in_bytes() -> None:
    with pytest.raises(ConfigError, match=r"^--pod-interface-name-prefix: "):
        build_config({}, {**PREFIX_MODE, "interface_name_prefix": "\u00e9" * 8})


def test_a_bridge_interface_holds_at_most_15_bytes() -> None:
    assert build_config({}, {**BRIDGE_MODE, "bridge_interface": "b" * 15}).bridge_interface
    with pytest.raises(ConfigError, match=r"^--pod-bridge-interface: 'b{16}' is longer than 15"):
        build_config({}, {**BRIDGE_MODE, "bridge_interface": "b" * 16})
    with pytest.raises(ConfigError, match=r"^detectLocal\.bridgeInterface: "):
        build_config({**BRIDGE_MODE, "bridge_interface": "b" * 16}, {})


@pytest.mark.parametrize("name", ["br 0", "br/0", "br:0", "br*", "br\t0"])
def test_an_interface_name_the_kernel_refuses_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match=r"^--pod-bridge-interface: .* is not an interface name"):
        build_config({}, {**BRIDGE_MODE, "bridge_interface": name})
    with pytest.raises(ConfigError, match=r"^--pod-interface-name-prefix: "):
        build_config({}, {**PREFIX_MODE, "interface_name_prefix": name})


# --- the commands refuse before anything touches the kernel -----------------------------


@pytest.fixture
def not_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused before the root check: no kernel could be reached anyway."""
    monkeypatch.setattr("os.geteuid", lambda: 1000)


@pytest.mark.parametrize("argv", [
    ["sync", "--source", SAMPLE, "--table-name", "nat"],
    ["sync", "--dry-run", "--source", SAMPLE, "--table-name", "Filter"],
    ["run", "--source", SAMPLE, "--table-name", "kube-proxy"],
    ["cleanup", "--table-name", "nat"],
    ["sync", "--dry-run", "--source", SAMPLE, "--detect-local-mode", "InterfaceNamePrefix",
     "--pod-interface-name-prefix", "123456789012345"],
    ["run", "--source", SAMPLE, "--detect-local-mode", "BridgeInterface",
     "--pod-bridge-interface", "bridge-too-long0"],
])
def test_commands_refuse_a_bad_flag_with_one_line_and_exit_2(
    argv: list[str], not_root: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nftproxy: config: --") and "\n" not in err, err
    flag = next(a for a in argv[::-1] if a.startswith("--") and a != "--source")
    assert err.startswith(f"nftproxy: config: {flag}: "), err
