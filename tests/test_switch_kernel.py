"""A full sync is atomic as traffic sees it, at every size (issue 35).

A full sync too large for one transaction is built in a table no hook
reaches and switched to in one transaction (agent/chunked.py). These tests
sample, from another process, what traffic reaches in a throwaway
namespace -- the tables of the pair that have base chains -- while such a
sync runs, and check every sample against the complete old state and the
complete new one; and that a first sync that fails leaves no table.
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import kernel
import pytest
from faults import our_table
from feed import initial_list, intake
from k8s import endpoint_slice, node, service

from nftproxy.agent.proxier import Proxier
from nftproxy.core.config import ProxyConfig
from nftproxy.core.nft.errors import NftRejected
from nftproxy.kernel.libnftables import NftBackend

NODE, NODE_IP = "node-a", "192.168.50.1"
CONFIG = ProxyConfig(node_name=NODE, node_ips=(NODE_IP,), cluster_cidrs=("10.244.0.0/16",))
SERVICES = 2000
CHUNK = 1000
"""Endpoints a step: 2,000 services of two endpoints make four chunks."""


def _cluster(endpoint_net: int) -> list[dict[str, Any]]:
    """SERVICES ClusterIP Services, two endpoints each, in 10.<endpoint_net>.x.y."""
    objects = [node(NODE, [NODE_IP])]
    for i in range(SERVICES):
        a, b = divmod(i, 250)
        objects += [
            service(f"s{i}", f"10.96.{a}.{b + 1}"),
            endpoint_slice(f"s{i}", [(f"10.{endpoint_net}.{a}.{b + 1}", NODE),
                                     (f"10.{endpoint_net}.{a + 100}.{b + 1}", "node-b")]),
        ]
    return objects


def _synced(ns: str, objects: Sequence[Mapping[str, Any]], *, fail_at: int = 0) -> None:
    """A new agent's first sync of `objects` in `ns` (over whatever tables
    are there); `fail_at`: the kernel refuses that commit (1-based)."""
    with NftBackend(netns=ns) as backend:
        if fail_at:
            commit, sent = backend.commit, [0]

            def refusing(commands: Sequence[Mapping[str, Any]], *, fresh: bool = False) -> None:
                sent[0] += 1
                if sent[0] == fail_at:
                    raise NftRejected("Could not process rule: Invalid argument (injected)")
                commit(commands, fresh=fresh)

            backend.commit = refusing  # type: ignore[method-assign]
        proxier = Proxier(CONFIG, backend, fresh_chunk=CHUNK)
        initial_list(intake(proxier), objects)
        report = proxier.sync()
        assert report.full


def _reached(ns: str) -> str:
    """What traffic reaches in `ns`: our hooked tables of both families, by content."""
    doc = json.loads(kernel.nft(ns, "-j", "list", "ruleset"))
    tables = {f: kernel.canonical(our_table(doc, f)) for f in ("ip", "ip6")}
    return json.dumps(tables, sort_keys=True)


class _Sampler:
    """Another thread listing the ruleset again and again (each listing is
    one consistent dump: libnftables retries a dump the generation moved
    under) until stopped."""

    def __init__(self, ns: str) -> None:
        self.ns = ns
        self.samples: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(_reached(self.ns))
            except subprocess.CalledProcessError:  # a dump interrupted: not a sample
                continue

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_traffic_reaches_the_whole_old_ruleset_or_the_whole_new_one_during_a_restart(
    netns: str,
) -> None:
    """An agent restarts over its 2,000 services while every endpoint has
    moved: its full sync goes in steps, and every sample taken meanwhile is
    the complete table of before or the complete table of after."""
    ns = netns
    _synced(ns, _cluster(244))
    old = _reached(ns)
    with _Sampler(ns) as sampler:
        _synced(ns, _cluster(245))
    new = _reached(ns)
    assert old != new and json.loads(new)["ip"] is not None
    mixed = [i for i, s in enumerate(sampler.samples) if s not in (old, new)]
    assert not mixed, f"{len(mixed)} of {len(sampler.samples)} samples were neither"
    assert len(sampler.samples) >= 2, "the sampler saw the sync too rarely to tell"
    assert old in sampler.samples, "no sample was taken while the new table was built"
    # the restart switched names; the old tables are gone
    names = {line.split()[-1] for line in kernel.nft(ns, "list", "tables").splitlines()}
    assert "nftproxy-b" in names and "nftproxy" not in names


def test_a_first_sync_that_fails_half_way_leaves_no_table(netns: str) -> None:
    """The third step (a chunk of services) is refused: what the first
    steps built is deleted, and nothing of nftproxy is left in the kernel."""
    ns = netns
    with pytest.raises(NftRejected):
        _synced(ns, _cluster(244), fail_at=3)
    assert "nftproxy" not in kernel.nft(ns, "list", "tables")
    _synced(ns, _cluster(244))  # and the next start builds it whole
    assert json.loads(_reached(ns))["ip"] is not None
