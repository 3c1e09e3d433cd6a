"""A transaction in libnftables JSON: one of the two printers of commands.

Layer: nft (pure). One job: write typed commands (core/nft/commands.py) as
libnftables JSON, as objects (`command_json`) or as the text sent
(`transaction_text`). Total over the commands, declarations by typeof
included. libnftables 1.0.6 reads no typeof in JSON, so a backend takes
this printer (`syntax="json"`, kernel/libnftables.py) on 1.1.x only.

The agent prints in nft's syntax, whose element text is written straight
from the values (the hot path of a full sync); this printer builds the
objects and dumps them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from nftproxy.core.nft.commands import (
    AddChain,
    AddElements,
    AddRule,
    AddSet,
    AddTable,
    Command,
    DeleteChain,
    DeleteElements,
    DeleteSet,
    DeleteTable,
    FlushChain,
    FlushSet,
    Where,
)
from nftproxy.core.nft.ops import typeof_key
from nftproxy.core.rules import names
from nftproxy.core.rules.expr import prefix
from nftproxy.core.rules.fragment import Element, Json, Key

__all__ = [
    "METAINFO",
    "command_json",
    "command_text",
    "document_text",
    "element_json",
    "key_json",
    "transaction_text",
]

METAINFO: Json = {"metainfo": {"json_schema_version": 1}}
VERDICT: Json = {"accept": None}
"""A verdict map's data by typeof: a verdict expression (nft's `: verdict`)."""

_DUMPS = json.JSONEncoder(separators=(",", ":"), check_circular=False).encode
"""Compact JSON, as libnftables reads it (no cycle check: commands are trees)."""


def _key_part(part: str | int) -> Any:
    """A key part as JSON: a CIDR text ("10.0.0.0/8", in interval keys)
    becomes a prefix (a host prefix its address)."""
    return prefix(part) if isinstance(part, str) and "/" in part else part


def key_json(key: Key) -> Any:
    parts = [_key_part(p) for p in key]
    return parts[0] if len(parts) == 1 else {"concat": parts}


def element_json(e: Element, *, with_comment: bool) -> Any:
    """`e` as a libnftables JSON element: its key (with its comment, if
    asked), paired with its value in a map."""
    key = key_json(e.key)
    if with_comment and e.comment:
        key = {"elem": {"val": key, "comment": names.comment(e.comment)}}
    if e.value is None:
        return key
    return [key, e.value.to_json()]


def _set_fields(command: AddSet) -> dict[str, Any]:
    decl = command.decl
    fields: dict[str, Any] = {"type": {"typeof": typeof_key(decl.key)}}
    if decl.map:
        fields["map"] = {"typeof": typeof_key(decl.data) if decl.data else VERDICT}
    if decl.flags:
        fields["flags"] = list(decl.flags)
    if decl.timeout is not None:
        fields["timeout"] = decl.timeout
    if decl.size is not None:
        fields["size"] = decl.size
    if decl.comment:
        fields["comment"] = decl.comment
    return fields


def _where(w: Where, **fields: Any) -> dict[str, Any]:
    return {"family": w.family, "table": w.table, **fields}


def command_json(command: Command) -> Json:
    """One command as a libnftables JSON object."""
    match command:
        case AddElements(where, name, elements):
            elem = [element_json(e, with_comment=True) for e in elements]
            return {"add": {"element": _where(where, name=name, elem=elem)}}
        case DeleteElements(where, name, keys):
            elem = [key_json(k) for k in keys]
            return {"delete": {"element": _where(where, name=name, elem=elem)}}
        case AddRule(where, chain, rule):
            fields = _where(where, chain=chain, expr=list(rule.expr))
            if rule.comment:
                fields["comment"] = rule.comment
            return {"add": {"rule": fields}}
        case AddChain(where, name, hook, comment):
            fields = _where(where, name=name)
            if hook is not None:
                fields.update(type=hook.type, hook=hook.hook, prio=hook.prio, policy=hook.policy)
            if comment:
                fields["comment"] = comment
            return {"add": {"chain": fields}}
        case FlushChain(where, name):
            return {"flush": {"chain": _where(where, name=name)}}
        case DeleteChain(where, name):
            return {"delete": {"chain": _where(where, name=name)}}
        case AddSet(where, name):
            return {"add": {command.kind: _where(where, name=name, **_set_fields(command))}}
        case FlushSet(where, name, is_map):
            return {"flush": {"map" if is_map else "set": _where(where, name=name)}}
        case DeleteSet(where, name, is_map):
            return {"delete": {"map" if is_map else "set": _where(where, name=name)}}
        case AddTable(where, comment, create):
            table: dict[str, Any] = {"family": where.family, "name": where.table}
            if comment:
                table["comment"] = comment
            return {"create" if create else "add": {"table": table}}
        case DeleteTable(where):
            return {"delete": {"table": {"family": where.family, "name": where.table}}}
    raise TypeError(f"not a command: {command!r}")


def command_text(command: Command) -> str:
    """The compact JSON text of one command."""
    return _DUMPS(command_json(command))


def transaction_text(commands: Sequence[Command]) -> str:
    """`{"nftables": [metainfo, *commands]}` as compact JSON text."""
    parts = [_DUMPS(METAINFO), *[command_text(c) for c in commands]]
    return '{"nftables":[' + ",".join(parts) + "]}"


def document_text(objects: Sequence[Json]) -> str:
    """`{"nftables": objects}`: libnftables JSON input other than commands (lists)."""
    return _DUMPS({"nftables": list(objects)})
