"""A full sync over an existing table in steps, on the real kernel (root; own
network namespace through the `netns` fixture).

Aspect: an agent restart over a table of a few hundred services, in chunks,
is accepted step by step by the kernel, every intermediate table has every
goto/jump target, and the result, as `nft -j list table` shows it, is the
table of the one-transaction full sync (handles aside).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import kernel
import pytest
from faults import in_generation
from test_proxier import CONFIG
from test_resync import Obj, _objects, _targets, new_cluster, old_cluster, old_table, restarted

from nftproxy.agent.proxier import Proxier
from nftproxy.kernel.libnftables import NftBackend

SERVICES = 300
CHUNK = 100  # endpoints: ~10 chunks of the ~950


class Checked(NftBackend):
    """NftBackend that counts commits, lists our ip table after each and
    keeps the goto/jump targets that name no chain."""

    def __init__(self, netns: str) -> None:
        super().__init__(netns=netns)
        self.commits = 0
        self.missing: set[str] = set()

    def commit(self, commands: Sequence[Mapping[str, Any]], *, fresh: bool = False) -> None:
        super().commit(commands, fresh=fresh)
        if commands:
            self.commits += 1
            doc = self.list_table("ip", CONFIG.table_name) or {"nftables": []}
            chains = {o["name"] for kind, o in _objects(doc) if kind == "chain"}
            self.missing |= _targets(doc) - chains


@pytest.fixture
def backend(netns: str) -> Iterator[Checked]:
    with Checked(netns) as b:
        yield b


def _listing(backend: Checked) -> Any:
    """Both tables by content, the endpoints maps' generation left out (each
    resync in steps fills the next one)."""
    tables = {f: kernel.canonical(backend.list_table(f, CONFIG.table_name)) for f in ("ip", "ip6")}
    return json.loads(in_generation(json.dumps(tables, sort_keys=True), "a"))


def _restart(backend: Checked, objects: Sequence[Obj], chunk: int) -> Proxier:
    backend.delete_tables(CONFIG.table_name)
    old_table(backend, old_cluster(SERVICES))
    backend.commits = 0
    proxier = restarted(backend, objects, chunk)
    assert proxier.sync().full
    return proxier


def test_a_restart_in_chunks_builds_the_one_transaction_table(backend: Checked) -> None:
    objects = new_cluster(SERVICES)
    _restart(backend, objects, 10**9)
    assert backend.commits == 1
    single = _listing(backend)
    proxier = _restart(backend, objects, CHUNK)
    assert backend.commits > 5
    assert not backend.missing
    assert _listing(backend) == single
    # the next periodic full sync goes over it in steps too (the affinity
    # sets the chunks created are kernel-"dynamic": kept, never re-added)
    backend.commits = 0
    proxier.request_full_sync()
    assert proxier.sync().full and backend.commits > 5
    assert _listing(backend) == single and not backend.missing
