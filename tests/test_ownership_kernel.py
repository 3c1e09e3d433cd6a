"""`sync`, `run` and `cleanup` never touch a table nftproxy did not create (real kernel).

Aspects: in a namespace holding iptables-nft's tables (nat, filter, both
families) and a user's tables -- one with their own name, one named like
the affinity table of a name they might pass, one named like nftproxy's
default table but without its mark -- each command given one of those
names exits 2 with one line naming the table (or the flag, for another
program's well-known name) and leaves every byte of the ruleset as it was;
the tables nftproxy creates carry its mark, and sync and cleanup keep
working on them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kernel
import pytest

from nftproxy.core.nft.errors import NftUnavailable
from nftproxy.core.nft.ops import Table
from nftproxy.core.nft.ownership import TABLE_MARK
from nftproxy.core.rules.fragment import SetDecl
from nftproxy.kernel import netns as nsutil
from nftproxy.kernel.libnftables import NftBackend

SAMPLE = str(Path(__file__).resolve().parent.parent / "nftproxy" / "examples" / "cluster.yaml")
NFTPROXY = [sys.executable, "-m", "nftproxy"]
QUIET = ["--healthz-bind-address", "", "--metrics-bind-address", ""]


def _run(ns: str, *args: str) -> subprocess.CompletedProcess[str]:
    # `run` must refuse at once: one that starts would outlive the timeout
    return nsutil.exec_in(ns, [*NFTPROXY, *args], check=False, timeout=60)


def _others(ns: str, family: str) -> None:
    """iptables-nft's nat and filter tables (both families), and a user's
    tables of `family`: `foreign`, `theirs-affinity` and `nftproxy`, none
    with nftproxy's mark."""
    for tool in ("iptables-nft", "ip6tables-nft"):
        nsutil.exec_in(ns, [tool, "-t", "nat", "-A", "POSTROUTING", "-o", "eth9",
                            "-j", "MASQUERADE"])
        nsutil.exec_in(ns, [tool, "-t", "filter", "-A", "INPUT", "-p", "tcp", "--dport", "22",
                            "-j", "ACCEPT"])
    kernel.nft(ns, "-f", "-", stdin=(
        f"table {family} foreign {{ chain c {{ type filter hook input priority 0; "
        "policy accept; tcp dport 9 drop; }; }\n"
        f'table {family} theirs-affinity {{ comment "a user\'s"; chain c {{ counter; }}; }}\n'
        f"table {family} nftproxy {{ chain c {{ tcp dport 10 drop; }}; }}\n"
    ))


VERBS = {
    "sync": ["sync", "--source", SAMPLE],
    "run": ["run", "--source", SAMPLE, *QUIET],
    "cleanup": ["cleanup"],
}


@pytest.mark.parametrize("family", ["ip", "ip6"])
@pytest.mark.parametrize("verb", sorted(VERBS))
@pytest.mark.parametrize(
    ("name", "refused"),
    [
        ("nat", "--table-name: 'nat' is another program's table"),
        ("filter", "--table-name: 'filter' is another program's table"),
        ("foreign", "table {family} foreign exists and was not created by nftproxy"),
        ("theirs", "table {family} theirs-affinity exists and was not created by nftproxy"),
        (None, "table {family} nftproxy exists and was not created by nftproxy"),
    ],
)
def test_a_table_nftproxy_did_not_create_is_left_alone(
    netns: str, family: str, verb: str, name: str | None, refused: str
) -> None:
    _others(netns, family)
    before = kernel.nft(netns, "list", "ruleset")
    argv = VERBS[verb] + ([] if name is None else ["--table-name", name])
    proc = _run(netns, *argv)
    assert kernel.nft(netns, "list", "ruleset") == before
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if " INFO " not in ln]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"nftproxy: config: {refused.format(family=family)}"), lines
    assert "choose another name" in lines[0]


def test_the_tables_nftproxy_creates_carry_its_mark(netns: str) -> None:
    """And sync and cleanup go on working on them, next to other tables."""
    kernel.nft(netns, "add", "table", "ip", "other")
    first = _run(netns, "sync", "--source", SAMPLE)
    assert first.returncode == 0, first.stderr
    with NftBackend(netns=netns) as backend:
        found = backend.find_tables("nftproxy")
    assert {(f.family, f.name) for f in found} >= {
        ("ip", "nftproxy"), ("ip", "nftproxy-affinity"),
        ("ip6", "nftproxy"), ("ip6", "nftproxy-affinity"),
    }
    assert all(f.comment == TABLE_MARK for f in found), found
    assert kernel.nft(netns, "list", "table", "ip", "nftproxy").splitlines()[1].strip() == (
        f'comment "{TABLE_MARK}"'
    )
    again = _run(netns, "sync", "--source", SAMPLE)
    assert again.returncode == 0, again.stderr
    cleanup = _run(netns, "cleanup")
    assert cleanup.returncode == 0, cleanup.stderr
    assert kernel.nft(netns, "list", "tables").split() == ["table", "ip", "other"]


@pytest.mark.parametrize("syntax", ["nft", "json"])
def test_tables_are_created_with_their_mark_in_the_one_transaction(
    netns: str, syntax: str
) -> None:
    """Whichever printer the userspace takes (JSON: 1.1.x only), the mark
    goes in with the tables and a declaration: one commit, no other."""
    tables = [*Table("ip", "t").add_tables(), *Table("ip6", "t").add_tables()]
    declare = Table("ip", "t").add_set(SetDecl.keyed("s", ("ip daddr",)))
    with NftBackend(netns=netns) as probe:
        json_takes_typeof = probe.accepts_typeof()
    backend = NftBackend(netns=netns, syntax=syntax)
    if syntax == "json" and not json_takes_typeof:
        with pytest.raises(NftUnavailable):
            backend.start()
        return
    with backend:
        before = backend.generation()
        backend.commit([*tables, declare])
        assert backend.generation() == before + 1
        found = backend.find_tables("t")
        assert {(f.family, f.name) for f in found} == {
            ("ip", "t"), ("ip", "t-affinity"), ("ip6", "t"), ("ip6", "t-affinity")
        }
        assert all(f.marked for f in found), found
