"""The nft text declarations FakeBackend takes, read into its JSON commands.

Layer: kernel edge's test double (no kernel). One job: read what
core/nft/ops.py `Table.declare_text` writes -- `add table F T [{ comment
"..."; }]` and `add set|map F T NAME { typeof KEY [: DATA]; [flags ...;]
[timeout Ns;] [size N;] [comment "..."; ] }`, one command per line -- into
the JSON commands the fake applies, in the shape each libnftables lists
such a declaration: 1.1.x keeps the typeof expressions, 1.0.6 their
datatypes (`"type": ["integer", ...]`, `"map": "ipv4_addr .
inet_service"`). Anything else raises NotImplementedError.
"""

from __future__ import annotations

import re
from typing import Any

from nftproxy.core.rules.fragment import SELECTORS

__all__ = ["parse_declarations"]

_TABLE = re.compile(
    r'^add table (?P<family>\S+) (?P<table>\S+)(?: \{ comment "(?P<comment>[^"]*)"; \})?$'
)
_SET = re.compile(
    r"^add (?P<kind>set|map) (?P<family>\S+) (?P<table>\S+) (?P<name>\S+) \{ (?P<body>.*) \}$"
)
_NUMBER = re.compile(r"^(?P<what>timeout|size) (?P<n>\d+)s?$")
_COMMENT = re.compile(r'^comment "(?P<text>[^"]*)"$')


def _selectors(text: str) -> list[str]:
    parts = [p.strip() for p in text.split(" . ")]
    for part in parts:
        if part not in SELECTORS:
            raise NotImplementedError(f"FakeBackend does not model typeof {part!r}")
    return parts


def _typeof(parts: list[str]) -> Any:
    exprs = [SELECTORS[p][0] for p in parts]
    return {"typeof": exprs[0] if len(exprs) == 1 else {"concat": exprs}}


def _declaration(match: re.Match[str], v11: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {k: match.group(k) for k in ("family", "table", "name")}
    for item in (i.strip() for i in match.group("body").split(";")):
        if item.startswith("typeof "):
            key, _, data = item[len("typeof ") :].partition(" : ")
            keys = _selectors(key)
            spec["type"] = _typeof(keys) if v11 else [SELECTORS[k][1] for k in keys]
            if data:
                values = _selectors(data)
                spec["map"] = (
                    _typeof(values) if v11 else " . ".join(SELECTORS[v][1] for v in values)
                )
        elif item.startswith("flags "):
            spec["flags"] = [f.strip() for f in item[len("flags ") :].split(",")]
        elif (number := _NUMBER.match(item)) is not None:
            spec[number["what"]] = int(number["n"])
        elif (comment := _COMMENT.match(item)) is not None:
            spec["comment"] = comment.group("text")
        elif item:
            raise NotImplementedError(f"FakeBackend does not model {item!r}")
    return {"add": {match.group("kind"): spec}}


def parse_declarations(texts: list[str] | tuple[str, ...], *, v11: bool) -> list[dict[str, Any]]:
    """The JSON commands of `texts` (each may hold several lines)."""
    out: list[dict[str, Any]] = []
    for line in (ln.strip() for text in texts for ln in text.splitlines()):
        if not line:
            continue
        if (table := _TABLE.match(line)) is not None:
            spec = {"family": table["family"], "name": table["table"]}
            if table["comment"]:
                spec["comment"] = table["comment"]
            out.append({"add": {"table": spec}})
        elif (decl := _SET.match(line)) is not None:
            out.append(_declaration(decl, v11))
        else:
            raise NotImplementedError(f"FakeBackend does not model nft text {line!r}")
    return out
