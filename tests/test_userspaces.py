"""Two nftables userspaces: what one writes, the other lists (docs/userspaces.md).

Aspects:
- declarations by typeof in both printers (core/nft/nfttext.py,
  core/nft/jsontext.py: `"type": {"typeof": ...}` and, for verdict maps,
  `"map": {"typeof": {"accept": null}}`), every set and map of the sample,
  whichever libnftables the fake stands for; a declaration without the
  selectors of its key cannot be built; the JSON printer only where
  libnftables' JSON takes typeof (1.1.x);
- the planner over what it declared: 1.1.x lists each key by its expression,
  1.0.6 by its datatypes, and either way a second full sync re-declares
  nothing;
- version skew, in the kernel, both ways: a table programmed by `nftproxy
  sync` in one userspace lists cleanly (rc 0, no segfault) with the other's
  `nft list ruleset`, `nft -j list ruleset` and `nftproxy dump` (which shows
  what the writer's own dump shows); also after the other's sync over it (an
  agent rolled back or upgraded). These need the trixie userspace
  (libnftables 1.1.3, `scripts/userspace.sh trixie`) at $NFTPROXY_TRIXIE,
  which scripts/test-userspaces.sh builds and sets; without it they skip,
  saying so; they run from the host (1.0.6), which drives both userspaces.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from nftproxy.core.config import ProxyConfig
from nftproxy.core.model import IPFamily, NodeInfo
from nftproxy.core.nft.errors import NftUnavailable
from nftproxy.core.nft.jsontext import command_json
from nftproxy.core.nft.listing import TableListing, list_family_objects
from nftproxy.core.nft.nfttext import command_text
from nftproxy.core.nft.ops import Table
from nftproxy.core.nft.plan import TableState, stage_full
from nftproxy.core.rules.dispatch import is_choosers_map, is_indexed_map
from nftproxy.core.rules.fragment import Fragment, SetDecl
from nftproxy.core.rules.skeleton import render_skeleton
from nftproxy.kernel.fake import FakeBackend
from nftproxy.kernel.libnftables import NftBackend
from nftproxy.tools.dry_run import proxier_from_files

REPO = Path(__file__).resolve().parent.parent
TRIXIE_ENV = "NFTPROXY_TRIXIE"
SAMPLE = "nftproxy/examples/cluster.yaml"
PROTOCOLS = ("tcp", "udp", "sctp")
THREE = ("ip daddr", "meta l4proto", "th dport")
CONCAT = {
    "concat": [
        {"payload": {"protocol": "ip", "field": "daddr"}},
        {"meta": {"key": "l4proto"}},
        {"payload": {"protocol": "th", "field": "dport"}},
    ]
}


# --- declarations by typeof, in both printers --------------------------------


def test_both_printers_declare_keys_by_expression_and_verdicts_by_typeof() -> None:
    t = Table("ip", "nftproxy")
    vmap = t.add_set(SetDecl.keyed("m", THREE, map="verdict"))
    spec = command_json(vmap)["add"]["map"]
    assert spec["type"] == {"typeof": CONCAT}
    assert spec["map"] == {"typeof": {"accept": None}}
    assert command_text(vmap) == (
        "add map ip nftproxy m { typeof ip daddr . meta l4proto . th dport : verdict; }")
    aff = t.add_set(SetDecl.keyed("a", ("ip6 saddr",), flags=("timeout",), timeout=60))
    spec = command_json(aff)["add"]["set"]
    assert spec["type"] == {"typeof": {"payload": {"protocol": "ip6", "field": "saddr"}}}
    assert spec["flags"] == ["timeout"] and spec["timeout"] == 60
    assert command_text(aff) == (
        "add set ip nftproxy a { typeof ip6 saddr; flags timeout; timeout 60s; }")


def test_a_declaration_without_selectors_cannot_be_built() -> None:
    """No printer could declare it by typeof, and by datatype 1.1.x would
    write userdata that crash 1.0.6's listing."""
    with pytest.raises(ValueError):
        Table("ip", "t").add_set(SetDecl("pairs", ("ipv4_addr", "ipv4_addr")))


def test_a_listing_by_typeof_is_read() -> None:
    listed = TableListing.from_json(
        "ip",
        "t",
        [{"map": {"family": "ip", "table": "t", "name": "m", "type": {"typeof": CONCAT},
                  "map": "verdict", "handle": 3}}],
    )
    (ks,) = listed.sets.values()
    assert ks.type == () and ks.map == "verdict"
    assert ks.typeof == Table.declared_typeof(SetDecl.keyed("m", THREE, map="verdict"))


def _declarations(commands: tuple[Any, ...]) -> list[Any]:
    return [
        spec
        for c in map(command_json, commands)
        for verb, body in c.items()
        if verb == "add"
        for kind, spec in body.items()
        if kind in ("set", "map")
    ]


@pytest.mark.parametrize("version", ["1.0.6", "1.1"])
def test_every_set_and_map_of_the_sample_is_declared_by_typeof(version: str) -> None:
    """Skeleton maps and sets, firewall (interval) and affinity (timeout) sets:
    none is declared by datatype, which would crash 1.0.6 when 1.1.x wrote it."""
    proxier = proxier_from_files([SAMPLE], ProxyConfig(), FakeBackend(version=version))
    decls = _declarations(proxier.plan_full().commands)
    kinds = {(bool(d.get("map")), tuple(d.get("flags", ()))) for d in decls}
    assert kinds >= {
        (True, ()), (False, ()), (False, ("interval",)), (False, ("dynamic", "timeout"))}
    assert all(isinstance(d["type"], dict) and "typeof" in d["type"] for d in decls)
    # data maps: the maps the shared choosers pick from; verdict maps: the
    # skeleton's and the eTP=Local destinations' choosers maps -- each
    # shared one only in the family where a port of the sample uses it
    verdict_maps = [d for d in decls if d.get("map") == {"typeof": {"accept": None}}]
    data_maps = [d for d in decls if "map" in d and d not in verdict_maps]
    assert all("typeof" in d["map"] for d in data_maps)
    assert all(is_indexed_map(d["name"]) for d in data_maps)
    choosers = sorted((d["family"], d["name"]) for d in verdict_maps
                      if is_choosers_map(d["name"]))
    assert choosers == sorted(("ip", f"{where}-{which}-choosers") for where in (
        "external", "nodeport") for which in ("cluster", "local"))  # demo/web-local
    assert sorted((d["family"], d["name"]) for d in data_maps) == sorted([
        ("ip", "vip-endpoints-tcp"), ("ip", "vip-endpoints-udp"),
        ("ip", "vip-local-endpoints-tcp"), ("ip", "nodeport-endpoints-tcp"),
        ("ip", "nodeport-local-endpoints-tcp"),
        ("ip6", "vip-endpoints-tcp"), ("ip6", "nodeport-endpoints-tcp"),
    ])


# --- the planner over what it declared ---------------------------------------


def _skeleton() -> Fragment:
    config = ProxyConfig(node_name="n")
    return render_skeleton(IPFamily.IPV4, config, NodeInfo("n", ("192.168.50.1",)))


def _full_sync(backend: FakeBackend) -> list[str]:
    """One full sync of the skeleton; the names of the sets it deleted."""
    state = TableState(IPFamily.IPV4, Table("ip", "nftproxy"))
    listed = list_family_objects(backend.list_table_objects, "ip", "nftproxy")
    staged = stage_full(state, listed, {"sk": _skeleton()})
    backend.commit(staged.commands)
    staged.commit()
    return [
        next(iter(c["delete"].values()))["name"]
        for c in map(command_json, staged.commands)
        if "delete" in c and {"set", "map"} & set(c["delete"])
    ]


@pytest.mark.parametrize("version", ["1.0.6", "1.1"])
def test_a_full_sync_over_what_it_declared_redeclares_nothing(version: str) -> None:
    fake = FakeBackend(version=version)
    fake.start()
    assert _full_sync(fake) == []
    assert _full_sync(fake) == []
    listed = list_family_objects(fake.list_table_objects, "ip", "nftproxy")
    assert listed is not None
    by_expression = [s.typeof is not None for s in listed.sets.values()]
    assert by_expression == [version == "1.1"] * len(listed.sets) and listed.sets


# --- the dialect of the libnftables in use (kernel) ---------------------------


def _nft_version() -> tuple[int, ...]:
    out = subprocess.run(["nft", "--version"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"v(\d+)\.(\d+)\.(\d+)", out)
    assert match, out
    return tuple(int(g) for g in match.groups())


@pytest.mark.parametrize("syntax", ["nft", "json"])
def test_each_printer_declares_by_typeof_where_libnftables_takes_it(
    netns: str, syntax: str
) -> None:
    """nft's syntax on both userspaces; JSON on 1.1.x only (1.0.6's refuses
    typeof: the backend will not start with it there). 1.1.x lists the key
    by its expression, 1.0.6 by its datatypes."""
    v11 = _nft_version() >= (1, 1, 0)
    nft = NftBackend(netns=netns, syntax=syntax)
    if syntax == "json" and not v11:
        with pytest.raises(NftUnavailable):
            nft.start()
        return
    table = Table("ip", "px")
    decl = SetDecl.keyed("m", THREE, map="verdict")
    with nft:
        assert nft.accepts_typeof() == v11
        nft.commit([*table.add_tables(), table.add_set(decl)])
        listed = nft.list_table_objects("ip", "px")
    assert listed is not None
    ks = listed.sets["m"]
    if v11:
        assert (ks.map, ks.typeof, ks.type) == ("verdict", table.declared_typeof(decl), ())
    else:
        assert (ks.map, ks.typeof) == ("verdict", None)
        assert ks.type == ("ipv4_addr", "inet_proto", "inet_service")


class Recording(NftBackend):
    """NftBackend that keeps the commands of every commit."""

    sent: list[Any]

    def commit(self, commands: Any, *, fresh: bool = False) -> None:
        self.sent = [*getattr(self, "sent", []), *commands]
        super().commit(commands, fresh=fresh)


def test_a_full_sync_keeps_what_the_last_one_declared(netns: str) -> None:
    """In either userspace the kernel lists each declaration as the planner
    expects it (ip and ip6, maps and sets): a second full sync re-declares
    nothing, so the affinity set keeps its clients."""
    with Recording(netns=netns) as nft:
        proxier = proxier_from_files([SAMPLE], ProxyConfig(), nft)
        proxier.sync()
        nft.sent = []
        proxier.request_full_sync()
        assert proxier.sync().full
        listed = nft.list_table_objects("ip", "nftproxy-affinity")
    sent = [command_json(c) for c in nft.sent]
    deleted = [c for c in sent if "delete" in c and {"set", "map"} & set(c["delete"])]
    assert deleted == []
    assert listed is not None and "affinity" in listed.sets  # the affinity table's


# --- version skew, both ways (kernel, host + trixie userspace) -------------------


@dataclass(frozen=True)
class Userspace:
    name: str
    prefix: tuple[str, ...]  # runs argv in netns "{ns}"
    python: str

    def run(
        self, ns: str, *argv: str, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        cmd = [a.format(ns=ns) for a in self.prefix] + list(argv)
        return subprocess.run(
            cmd, input=stdin, capture_output=True, text=True, check=False, cwd=REPO, timeout=300
        )

    def nftproxy(self, ns: str, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run(ns, self.python, "-m", "nftproxy", *args)


def _trixie_dir() -> Path:
    if os.environ.get("NFTPROXY_USERSPACE"):  # set by scripts/userspace.sh run
        pytest.skip("inside a built userspace: the skew tests run from the host, driving both")
    path = os.environ.get(TRIXIE_ENV)
    if not path:
        pytest.skip(
            f"version skew not tested: no trixie userspace (${TRIXIE_ENV} unset; "
            "scripts/test-userspaces.sh builds one and runs this)"
        )
    root = Path(path)
    if not (root / "etc/debian_version").exists():
        pytest.fail(f"${TRIXIE_ENV}={path} is not a built userspace", pytrace=False)
    return root


def _userspaces() -> tuple[Userspace, Userspace]:
    root = _trixie_dir()
    host = Userspace("host", ("ip", "netns", "exec", "{ns}"), sys.executable)
    helper = str(REPO / "scripts/userspace.sh")
    trixie = Userspace(
        "trixie", ("bash", helper, "run", str(root), "-n", "{ns}"), "/opt/nftproxy/bin/python"
    )
    return host, trixie


def _ok(proc: subprocess.CompletedProcess[str], what: str) -> str:
    crashed = " (segfault)" if proc.returncode in (139, -11) else ""
    assert proc.returncode == 0, f"{what}: rc {proc.returncode}{crashed}\n{proc.stderr[-2000:]}"
    return proc.stdout


def _listings(us: Userspace, ns: str) -> tuple[str, str, str]:
    """`nft list ruleset`, `nft -j list ruleset`, `nftproxy dump` by `us`."""
    text = _ok(us.run(ns, "nft", "list", "ruleset"), f"{us.name}: nft list ruleset")
    js = _ok(us.run(ns, "nft", "-j", "list", "ruleset"), f"{us.name}: nft -j list ruleset")
    dump = _ok(us.nftproxy(ns, "dump"), f"{us.name}: nftproxy dump")
    return text, js, dump


def _write(how: str, writer: Userspace, lister: Userspace, ns: str) -> None:
    _ok(writer.nftproxy(ns, "sync", "--source", SAMPLE), f"{writer.name}: nftproxy sync")
    if how == "sync, then the lister's sync":
        _ok(lister.nftproxy(ns, "sync", "--source", SAMPLE), f"{lister.name}: sync over it")


HOWS = ["sync", "sync, then the lister's sync"]


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("writer_name", ["trixie", "host"], ids=["1.1.3 writes", "1.0.6 writes"])
def test_a_table_written_by_one_userspace_lists_cleanly_with_the_other(
    netns: str, writer_name: str, how: str
) -> None:
    host, trixie = _userspaces()
    writer, lister = (trixie, host) if writer_name == "trixie" else (host, trixie)
    _write(how, writer, lister, netns)
    text, js, dump = _listings(lister, netns)
    assert "table ip nftproxy" in text and "KUBE-SERVICES" in text
    assert any("table" in o for o in json.loads(js)["nftables"])
    assert dump == _listings(writer, netns)[2]  # both read the same services
    assert "demo/web:http" in dump


def test_the_sample_declares_what_the_skew_test_needs() -> None:
    """The skew test covers every kind of declaration: verdict maps keyed by
    address . proto . port and by proto . port, plain, interval and timeout
    sets (sessionAffinity, loadBalancerSourceRanges)."""
    text = (REPO / SAMPLE).read_text()
    assert "sessionAffinity: ClientIP" in text and "loadBalancerSourceRanges" in text
