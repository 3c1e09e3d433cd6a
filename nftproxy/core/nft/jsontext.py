"""The JSON of set elements, and the JSON text of whole commands.

Layer: nft (pure). One job: say an element in libnftables JSON, as objects
(`element_json`) or directly as text (`element_text`, the same bytes
`json.dumps` makes of the objects), and make a transaction's text.

Why text: a full sync of 10,000 services x 10 endpoints sends ~180,000
elements, and the sync is bound by the interpreter's one core; writing the
text straight from the Element values costs that core much less than
building their dicts and encoding them (bench/RESULTS.md, "What moved the
numbers"). So an add-element command carries an `ElementList`:
the Element values themselves, read as their JSON objects by whoever
iterates them (the fake backend, tests, error messages), and turned straight
into text by `command_text` when the command is sent.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from json.encoder import encode_basestring_ascii
from typing import Any, overload

from nftproxy.core.rules import names
from nftproxy.core.rules.expr import prefix
from nftproxy.core.rules.fragment import Element, Json, Key, Target, Verdict

__all__ = [
    "ElementList",
    "command_text",
    "element_json",
    "element_text",
    "key_json",
    "transaction_text",
]

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


def _part_text(part: str | int) -> str:
    if type(part) is int:
        return str(part)
    if type(part) is str and "/" not in part:
        return encode_basestring_ascii(part)
    return _DUMPS(_key_part(part))


def _value_text(value: Verdict | Target) -> str:
    if type(value) is Target and type(value.port) is int:
        return '{"concat":[' + encode_basestring_ascii(value.ip) + "," + str(value.port) + "]}"
    return _DUMPS(value.to_json())


def element_text(e: Element, *, with_comment: bool) -> str:
    """`_DUMPS(element_json(e, ...))`, written without the objects."""
    key = e.key
    if len(key) == 1:
        text = _part_text(key[0])
    else:
        text = '{"concat":[' + ",".join([_part_text(p) for p in key]) + "]}"
    if with_comment and e.comment:
        comment = encode_basestring_ascii(names.comment(e.comment))
        text = '{"elem":{"val":' + text + ',"comment":' + comment + "}}"
    if e.value is None:
        return text
    return "[" + text + "," + _value_text(e.value) + "]"


class ElementList(Sequence[Any]):
    """The `elem` of a command: `elements` as their JSON objects, made when
    read; `text()` is the JSON text of the whole list, made without them."""

    __slots__ = ("_elements", "_with_comment")

    def __init__(self, elements: Iterable[Element], *, with_comment: bool) -> None:
        self._elements = tuple(elements)
        self._with_comment = with_comment

    @property
    def elements(self) -> tuple[Element, ...]:
        return self._elements

    @property
    def with_comment(self) -> bool:
        return self._with_comment

    def __len__(self) -> int:
        return len(self._elements)

    @overload
    def __getitem__(self, index: int) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...
    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self._json(e) for e in self._elements[index]]
        return self._json(self._elements[index])

    def __iter__(self) -> Iterator[Any]:
        return map(self._json, self._elements)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ElementList | list | tuple):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # a list's equality: unhashable

    def __repr__(self) -> str:
        return repr(list(self))

    def _json(self, e: Element) -> Any:
        return element_json(e, with_comment=self._with_comment)

    def text(self) -> str:
        comments = self._with_comment
        texts = [element_text(e, with_comment=comments) for e in self._elements]
        return "[" + ",".join(texts) + "]"


def command_text(command: Mapping[str, Any]) -> str:
    """The compact JSON text of one command (`{"add": {"element": ...}}`
    and friends); an ElementList's text is written directly."""
    if len(command) == 1:
        ((verb, body),) = command.items()
        spec = body.get("element") if isinstance(body, Mapping) and len(body) == 1 else None
        elems = spec.get("elem") if isinstance(spec, Mapping) else None
        if isinstance(spec, Mapping) and isinstance(elems, ElementList):
            head = _DUMPS({k: v for k, v in spec.items() if k != "elem"})[:-1]
            head += ',"elem":' if len(head) > 1 else '"elem":'
            return "{" + _DUMPS(verb) + ':{"element":' + head + elems.text() + "}}}"
    return _DUMPS(command)


def transaction_text(commands: Sequence[Mapping[str, Any]], *, head: Json | None = None) -> str:
    """`{"nftables": [head, *commands]}` as compact JSON text."""
    parts = [] if head is None else [_DUMPS(head)]
    parts += [command_text(c) for c in commands]
    return '{"nftables":[' + ",".join(parts) + "]}"
