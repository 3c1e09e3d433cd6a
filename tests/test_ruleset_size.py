"""nftproxy's tables hold what the cluster uses, and no more (real kernel).

Aspects, per family across nftproxy's tables (the main table and its
affinity table):
- an empty node lists at most 40 chains and 25 sets/maps, none of them a
  shared chooser, a map one picks from, or an eTP=Local chain;
- the sample cluster's whole `nft list ruleset` is at most 600 lines, and
  holds exactly the choosers its services use;
- when the services go, so does everything they used: the empty node's
  ruleset again.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import kernel
import pytest

from nftproxy.kernel import netns as nsutil

SAMPLE = str(Path(__file__).resolve().parent.parent / "nftproxy" / "examples" / "cluster.yaml")
NFTPROXY = [sys.executable, "-m", "nftproxy"]
EMPTY = "apiVersion: v1\nkind: List\nitems: []\n"
MAX_CHAINS, MAX_SETS, MAX_SAMPLE_LINES = 40, 25, 600


def _sync(ns: str, source: str) -> None:
    argv = [*NFTPROXY, "sync", "--source", source, "--node-name", "demo-node", "--allow-empty"]
    nsutil.exec_in(ns, argv, timeout=60)


def _objects(ns: str) -> dict[str, dict[str, list[str]]]:
    """Per family, the names of nftproxy's chains and sets/maps."""
    doc = json.loads(kernel.nft(ns, "-j", "list", "ruleset"))
    out: dict[str, dict[str, list[str]]] = {}
    for item in doc["nftables"]:
        ((kind, obj),) = item.items()
        if kind in ("chain", "set", "map") and obj["table"].startswith("nftproxy"):
            family = out.setdefault(obj["family"], {"chains": [], "sets": []})
            family["chains" if kind == "chain" else "sets"].append(obj["name"])
    return out


def _shared(names: list[str]) -> list[str]:
    return [n for n in names if n.startswith(("dispatch-", "external-local", "nodeport-local"))
            or "endpoints-" in n or n.endswith("-choosers")]


@pytest.fixture
def empty(tmp_path: Path) -> str:
    path = tmp_path / "empty.yaml"
    path.write_text(EMPTY)
    return str(path)


def test_an_empty_node_holds_the_fixed_part_only(netns: str, empty: str) -> None:
    _sync(netns, empty)
    objects = _objects(netns)
    assert sorted(objects) == ["ip", "ip6"]
    for family, held in objects.items():
        assert len(held["chains"]) <= MAX_CHAINS, (family, held["chains"])
        assert len(held["sets"]) <= MAX_SETS, (family, held["sets"])
        assert _shared(held["chains"] + held["sets"]) == [], family
    assert "numgen" not in kernel.nft(netns, "list", "ruleset")


def test_the_sample_reads_in_a_page_or_so(netns: str) -> None:
    _sync(netns, SAMPLE)
    listing = kernel.nft(netns, "list", "ruleset")
    assert len(listing.splitlines()) <= MAX_SAMPLE_LINES
    ip = _objects(netns)["ip"]
    assert sorted(_shared(ip["chains"])) == [
        "dispatch-local-tcp-1",
        "dispatch-nodeport-local-tcp-1",
        "dispatch-nodeport-tcp-2",
        "dispatch-nodeport-tcp-3",
        "dispatch-tcp-2",
        "dispatch-tcp-3",
        "dispatch-udp-3",
        "external-local",
        "nodeport-local",
    ]
    assert len(ip["chains"]) <= MAX_CHAINS and len(ip["sets"]) <= MAX_SETS


def test_what_the_services_used_goes_with_them(netns: str, empty: str) -> None:
    _sync(netns, empty)
    before = kernel.canonical(json.loads(kernel.nft(netns, "-j", "list", "ruleset")))
    _sync(netns, SAMPLE)
    _sync(netns, empty)
    after = kernel.canonical(json.loads(kernel.nft(netns, "-j", "list", "ruleset")))
    assert after == before
