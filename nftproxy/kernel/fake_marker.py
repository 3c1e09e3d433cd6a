"""FakeMarker: FakeBackend as the kube-proxy marker's `MarkerBackend`, for tests.

Layer: kernel edge's test double (no kernel). One job: apply the nft text
core/nft/marker.py writes -- `create table F T { comment "C"; }`, `add
chain F T N { comment "C"; }`, `delete table F T`, `delete chain F T N`,
one command a line -- to a FakeBackend's tables, as one transaction, and
read them back through its `find_tables` and `list_table_objects`.
`create` refuses an existing table (NftExists), as the kernel does; the
rest is the fake's own all-or-nothing commit. FakeBackend's `declare` reads
set declarations only (kernel/fake_text.py), hence this wrapper.

Known limits: a chain's comment is not kept (FakeBackend lists none); any
other text raises NotImplementedError.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from nftproxy.core.nft.errors import NftExists
from nftproxy.core.nft.listing import TableListing
from nftproxy.core.nft.ownership import FoundTable
from nftproxy.kernel.fake import FakeBackend

__all__ = ["FakeMarker"]

_NAME = r"[A-Za-z][A-Za-z0-9_.-]*"
_TABLE = re.compile(
    rf'^(?P<verb>create|delete) table (?P<family>ip6?) (?P<table>{_NAME})'
    r'(?: \{ comment "(?P<comment>[^"]*)"; \})?$'
)
_CHAIN = re.compile(
    rf"^(?P<verb>add|delete) chain (?P<family>ip6?) (?P<table>{_NAME}) (?P<name>{_NAME})"
    r'(?: \{ comment "[^"]*"; \})?$'
)


class FakeMarker:
    """The marker's view of `backend` (a started FakeBackend)."""

    def __init__(self, backend: FakeBackend) -> None:
        self.backend = backend

    def find_tables(self, table: str) -> list[FoundTable]:
        return self.backend.find_tables(table)

    def list_table_objects(self, family: str, table: str) -> TableListing | None:
        return self.backend.list_table_objects(family, table)

    def declare(self, texts: Sequence[str]) -> None:
        """`texts` as one transaction of the fake."""
        commands = [self._command(text) for text in texts]
        if commands:
            self.backend.commit(commands)

    def _command(self, text: str) -> dict[str, Any]:
        if (m := _TABLE.match(text)) is not None:
            spec: dict[str, Any] = {"family": m["family"], "name": m["table"]}
            if m["verb"] == "delete":
                return {"delete": {"table": spec}}
            if self.backend.list_table(m["family"], m["table"]) is not None:
                raise NftExists(f"Could not process rule: File exists: {text}")
            return {"add": {"table": {**spec, "comment": m["comment"]}}}
        if (m := _CHAIN.match(text)) is not None:
            chain = {"family": m["family"], "table": m["table"], "name": m["name"]}
            return {m["verb"]: {"chain": chain}}
        raise NotImplementedError(f"FakeMarker does not model {text!r}")
