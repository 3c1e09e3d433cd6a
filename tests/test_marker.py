"""The kube-proxy marker without the kernel: what nftproxy writes where peers
look for kube-proxy's nftables table, and what it never touches.

Aspects: the decisions (core/nft/marker.py) per state of `F kube-proxy`;
KubeProxyMarker over FakeBackend: both families written once, nothing sent
when whole, written again after a deletion, a table nftproxy did not create
left as it was (and said once), removal of its own table only, and of the
marker chain alone where kube-proxy has written since; the agent's wiring:
written by the first full sync, written again by the full sync the drift
check forces after another process deleted it, never counted as drift
itself, and absent when turned off; the flag and the file field.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from feed import initial_list
from k8s import endpoint_slice, node, service
from prometheus_client import CollectorRegistry

from nftproxy.agent.agent import Agent, Source
from nftproxy.agent.marker import KubeProxyMarker, Removal
from nftproxy.core.config import ProxyConfig
from nftproxy.core.nft.commands import AddChain, AddTable, Command, DeleteChain, DeleteTable, Where
from nftproxy.core.nft.listing import TableListing
from nftproxy.core.nft.marker import (
    KUBE_PROXY_COMMENT,
    MARKER_CHAIN,
    MARKER_COMMENT,
    MARKER_TABLE,
    create_commands,
    ensure_commands,
    removal_commands,
)
from nftproxy.core.nft.nfttext import command_text
from nftproxy.core.nft.ownership import TABLE_MARK, FoundTable
from nftproxy.core.rules.names import COMMENT_MAX_BYTES
from nftproxy.kernel.fake import FakeBackend
from nftproxy.tools import cli
from nftproxy.tools.config_load import load_config_file

NODE = "node-a"


def fake() -> tuple[FakeBackend, FakeBackend]:
    """The fake kernel, and the marker's edge onto it (FakeBackend as it is)."""
    backend = FakeBackend()
    backend.start()
    return backend, backend


def texts(commands: tuple[Command, ...]) -> tuple[str, ...]:
    return tuple(command_text(c) for c in commands)


def chains(backend: FakeBackend, family: str) -> list[str] | None:
    listing = backend.list_table_objects(family, MARKER_TABLE)
    return None if listing is None else sorted(listing.chains)


def kube_proxy_table(backend: FakeBackend, family: str, comment: str | None) -> None:
    """What kube-proxy's nftables mode holds (trimmed): its table and chains."""
    where = Where(family, MARKER_TABLE)
    backend.commit([
        AddTable(where, comment),
        *(AddChain(where, name) for name in ("services", "masquerading")),
    ])


def comments(backend: FakeBackend) -> dict[str, str | None]:
    return {t.family: t.comment for t in backend.find_tables(MARKER_TABLE)
            if t.name == MARKER_TABLE}


# ---- decisions -----------------------------------------------------------------------


MARKED = FoundTable("ip", MARKER_TABLE, TABLE_MARK)
KUBE_PROXY = FoundTable("ip", MARKER_TABLE, KUBE_PROXY_COMMENT)
ONLY_MARKER = TableListing({MARKER_CHAIN: None}, {})
ADOPTED = TableListing({MARKER_CHAIN: None, "services": None}, {})


def test_the_marker_is_created_only_where_no_table_of_its_name_exists() -> None:
    assert ensure_commands("ip", None, None) == create_commands("ip")
    created = texts(create_commands("ip"))
    assert created[0].startswith("create table ip kube-proxy")  # EEXIST if raced
    assert f'comment "{TABLE_MARK}"' in created[0]
    assert ensure_commands("ip", KUBE_PROXY, ADOPTED) == ()
    assert ensure_commands("ip", FoundTable("ip", MARKER_TABLE, None), None) == ()
    assert ensure_commands("ip", MARKED, ONLY_MARKER) == ()
    assert ensure_commands("ip", MARKED, ADOPTED) == ()
    assert ensure_commands("ip", MARKED, TableListing({}, {})) == (create_commands("ip")[1],)
    assert ensure_commands("ip", MARKED, None) == create_commands("ip")  # deleted since found


def test_the_marker_chain_is_inert_and_says_whose_it_is() -> None:
    chain = command_text(create_commands("ip6")[1])
    assert chain == (f"add chain ip6 kube-proxy {MARKER_CHAIN} "
                     f'{{ comment "{MARKER_COMMENT}"; }}')
    assert chain.count(";") == 1, "a comment only: no type, hook or policy"
    assert len(MARKER_COMMENT.encode()) <= COMMENT_MAX_BYTES
    assert "nftproxy" in MARKER_COMMENT and "docs/ruleset.md" in MARKER_COMMENT


def test_removal_touches_only_what_nftproxy_made() -> None:
    assert texts(removal_commands("ip", MARKED, ONLY_MARKER)) == ("delete table ip kube-proxy",)
    assert texts(removal_commands("ip", MARKED, ADOPTED)) == (
        f"delete chain ip kube-proxy {MARKER_CHAIN}",)
    assert removal_commands("ip", MARKED, TableListing({"services": None}, {})) == ()
    assert removal_commands("ip", KUBE_PROXY, ONLY_MARKER) == ()
    assert removal_commands("ip", MARKED, None) == ()


# ---- KubeProxyMarker over FakeBackend ------------------------------------------------


def test_ensure_writes_both_families_once() -> None:
    backend, edge = fake()
    marker = KubeProxyMarker(edge)
    assert marker.ensure() == ("ip", "ip6")
    assert comments(backend) == {"ip": TABLE_MARK, "ip6": TABLE_MARK}
    assert chains(backend, "ip") == chains(backend, "ip6") == [MARKER_CHAIN]
    generation = backend.generation()
    assert marker.ensure() == ()
    assert backend.generation() == generation, "a whole marker sends nothing"


def test_ensure_writes_the_marker_again_after_a_deletion() -> None:
    backend, edge = fake()
    marker = KubeProxyMarker(edge)
    marker.ensure()
    backend.commit([DeleteTable(Where("ip6", MARKER_TABLE))])
    assert marker.ensure() == ("ip6",)
    backend.commit([DeleteChain(Where("ip", MARKER_TABLE), MARKER_CHAIN)])
    assert marker.ensure() == ("ip",)
    assert chains(backend, "ip") == chains(backend, "ip6") == [MARKER_CHAIN]


@pytest.mark.parametrize("comment", [KUBE_PROXY_COMMENT, None, "someone else's"])
def test_a_table_nftproxy_did_not_create_is_left_and_said_once(
    comment: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    backend, edge = fake()
    kube_proxy_table(backend, "ip", comment)
    before = backend.list_table("ip", MARKER_TABLE)
    marker = KubeProxyMarker(edge)
    with caplog.at_level(logging.WARNING):
        assert marker.ensure() == ("ip6",)
        assert marker.ensure() == ()
    assert backend.list_table("ip", MARKER_TABLE) == before
    said = [r.getMessage() for r in caplog.records if "left untouched" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith("table ip kube-proxy exists")
    assert ("kube-proxy's own" in said[0]) is (comment == KUBE_PROXY_COMMENT)

    assert marker.remove() == Removal(deleted=("ip6",), foreign=(
        FoundTable("ip", MARKER_TABLE, comment),))
    assert backend.list_table("ip", MARKER_TABLE) == before
    assert backend.list_table("ip6", MARKER_TABLE) is None


def test_after_kube_proxy_cleanup_the_marker_takes_the_place(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Migration from kube-proxy: its table is left while it is there; once
    `kube-proxy --cleanup` deleted it, the next check writes the marker, and
    a table of kube-proxy's that comes back is said again."""
    backend, edge = fake()
    for family in ("ip", "ip6"):
        kube_proxy_table(backend, family, KUBE_PROXY_COMMENT)
    marker = KubeProxyMarker(edge)
    with caplog.at_level(logging.WARNING):
        assert marker.ensure() == ()
        for family in ("ip", "ip6"):
            backend.commit([DeleteTable(Where(family, MARKER_TABLE))])
        assert marker.ensure() == ("ip", "ip6")
        backend.commit([DeleteTable(Where("ip", MARKER_TABLE))])
        kube_proxy_table(backend, "ip", KUBE_PROXY_COMMENT)
        assert marker.ensure() == ()
    said = [r.getMessage()[:21] for r in caplog.records if "left untouched" in r.getMessage()]
    assert said == ["table ip kube-proxy e", "table ip6 kube-proxy ", "table ip kube-proxy e"]


def test_removal_keeps_what_kube_proxy_wrote_into_the_marker_table() -> None:
    """Migration back to kube-proxy: its start adds to the marker table
    (which keeps nftproxy's mark); `nftproxy cleanup` then deletes the
    marker chain alone, and kube-proxy's chains stay."""
    backend, edge = fake()
    marker = KubeProxyMarker(edge)
    marker.ensure()
    kube_proxy_table(backend, "ip", KUBE_PROXY_COMMENT)  # its `add table` keeps the mark
    assert comments(backend)["ip"] == TABLE_MARK
    assert marker.ensure() == ()
    removal = marker.remove()
    assert removal == Removal(deleted=("ip6",), adopted=("ip",))
    assert chains(backend, "ip") == ["masquerading", "services"]
    assert chains(backend, "ip6") is None
    assert marker.remove() == Removal()
    assert [line.split(":")[0] for line in removal.lines()] == [
        "deleted table ip6 kube-proxy (nftproxy's marker)", "kept table ip kube-proxy"]


def test_a_refused_marker_is_logged_and_never_raised(caplog: pytest.LogCaptureFixture) -> None:
    """kube-proxy's table appearing between the check and the commit: the
    `create` is refused, and nothing of the marker's transaction is kept."""
    backend, _ = fake()

    class Racing(FakeBackend):
        def commit(self, commands: Any, *, fresh: bool = False) -> None:
            kube_proxy_table(backend, "ip", KUBE_PROXY_COMMENT)
            backend.commit(commands)

        def find_tables(self, table: str) -> Any:
            return backend.find_tables(table)

        def list_table_objects(self, family: str, table: str) -> Any:
            return backend.list_table_objects(family, table)

    with caplog.at_level(logging.WARNING):
        assert KubeProxyMarker(Racing()).ensure() == ()
    assert "cannot write nftproxy's kube-proxy marker" in caplog.text
    assert chains(backend, "ip") == ["masquerading", "services"]
    assert chains(backend, "ip6") is None


# ---- the agent -----------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


OBJECTS = [node(NODE, ["192.168.50.1"]), service("web", "10.96.0.10"),
           endpoint_slice("web", [("10.244.0.11", NODE)])]


def _no_source(_: object) -> Source:
    raise AssertionError("these tests drive the proxier; the agent is never started")


def agent(*, on: bool = True) -> tuple[Agent, FakeBackend, Clock]:
    backend, edge = fake()
    clock = Clock()
    config = ProxyConfig(node_name=NODE, healthz_bind_address="", metrics_bind_address="",
                         sync_period=30.0, kube_proxy_marker=on)
    built = Agent(config, backend=backend, marker=edge, source_factory=_no_source,
                  registry=CollectorRegistry(), clock=clock)
    initial_list(built.events, OBJECTS)
    return built, backend, clock


def repairs(built: Agent) -> float:
    total = 0.0
    for metric in built.metrics.registry.collect():
        for s in metric.samples:
            if s.name == "nftproxy_drift_repairs_total":
                total += s.value
    return total


def test_the_agent_writes_the_marker_after_its_first_full_sync() -> None:
    built, backend, clock = agent()
    assert built.proxier.sync().full
    assert chains(backend, "ip") == chains(backend, "ip6") == [MARKER_CHAIN]
    clock.now += 31  # the drift check reads the generation again
    report = built.proxier.sync()
    assert not report.full and repairs(built) == 0, "the marker's commit is nftproxy's own"


def test_the_agent_writes_the_marker_again_after_another_process_deleted_it() -> None:
    built, backend, clock = agent()
    built.proxier.sync()
    backend.commit([DeleteTable(Where("ip", MARKER_TABLE))])
    built.proxier.sync()
    assert chains(backend, "ip") is None, "a partial sync reads nothing"
    clock.now += 31
    assert built.proxier.sync().full, "the drift check saw another process's commit"
    assert chains(backend, "ip") == [MARKER_CHAIN]
    assert repairs(built) == 1
    clock.now += 31
    assert not built.proxier.sync().full and repairs(built) == 1


def test_the_agent_writes_no_marker_when_turned_off() -> None:
    built, backend, _ = agent(on=False)
    built.proxier.sync()
    assert backend.find_tables(MARKER_TABLE) == []


# ---- configuration -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [([], True), (["--kube-proxy-marker"], True), (["--kube-proxy-marker=false"], False)],
)
def test_the_flag(given: list[str], expected: bool) -> None:
    for command in (["sync", "--source", "x.yaml"], ["run"]):
        args = cli.build_parser().parse_args([*command, *given])
        assert cli._load_config(args).kube_proxy_marker is expected


@pytest.mark.parametrize("version", ["v1alpha1", "v1alpha2"])
def test_the_file_field(tmp_path: Path, version: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(f"apiVersion: kubeproxy.config.k8s.io/{version}\n"
                    "kind: KubeProxyConfiguration\nkubeProxyMarker: false\n")
    overrides, warnings = load_config_file(path)
    assert overrides == {"kube_proxy_marker": False} and warnings == []
