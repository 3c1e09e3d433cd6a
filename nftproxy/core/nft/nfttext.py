"""A transaction in nft's own syntax, for the commands that have one here.

Layer: nft (pure). One job: write a transaction's commands (the JSON
objects core/nft/ops.py builds) as the lines `nft -f` reads, or say that
one of them has no text form here (`NoText`), so the JSON is sent instead.

Why: libnftables parses and evaluates nft text in less time than the same
commands in JSON, elements and rules alike, on both libnftables 1.0.6 and
1.1.3 (bench/RESULTS.md, "What moved the numbers"), and the text is
shorter to write. Both forms make the same kernel
objects (tests/test_nfttext_kernel.py lists both back and compares them).

What has a text form: tables; regular and base chains (add, flush,
delete); rules made of the statements core/rules/expr.py spells; elements
(add, delete); flushing and deleting sets and maps. Set and map
declarations have none (their two dialects stay in ops.py's JSON and
`declare_text`), nor has anything this module does not know: a shape it
cannot spell raises `NoText` rather than guess. Strings it would have to
quote (comments, interface names) must be printable and hold no double
quote or backslash, which nft's text cannot escape. Names cannot be quoted
at all (1.0.6 and 1.1.3 parse no quoted table, chain or set name), so a
name that is one of nft's keywords (a table called `filter`) is refused by
libnftables: kernel/libnftables.py then sends the JSON. An Element's key
parts and DNAT target are written unchecked (they are the model's
addresses, CIDRs, protocols and numbers, validated when a Service or
EndpointSlice is read: the hot path).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nftproxy.core.nft.jsontext import ElementList
from nftproxy.core.rules import names
from nftproxy.core.rules.expr import prefix
from nftproxy.core.rules.fragment import Element, Target, Verdict

__all__ = ["NoText", "command_text", "transaction_text"]


class NoText(ValueError):
    """A command this module cannot write in nft's syntax."""


_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]*\Z")
_SYMBOL = re.compile(r"[a-z][a-z0-9\-]*\Z")
_ADDRESS = re.compile(r"[0-9A-Fa-f.:]+(/[0-9]+)?\Z")


def transaction_text(commands: Sequence[Mapping[str, Any]]) -> str:
    """The commands as nft text, one per line; NoText if one has none."""
    return "".join([command_text(c) + "\n" for c in commands])


def command_text(command: Mapping[str, Any]) -> str:
    if len(command) != 1:
        raise NoText(f"not one verb: {sorted(command)}")
    ((verb, body),) = command.items()
    if not isinstance(body, Mapping) or len(body) != 1:
        raise NoText(f"{verb}: not one object")
    ((kind, spec),) = body.items()
    writer = _COMMANDS.get((verb, kind))
    if writer is None:
        raise NoText(f"no text for {verb} {kind}")
    try:
        return writer(verb, kind, spec)
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        if isinstance(exc, NoText):
            raise
        raise NoText(f"{verb} {kind}: malformed ({exc!r})") from exc


# --- objects ---------------------------------------------------------------------------


def _name(value: Any) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise NoText(f"name {value!r}")
    return value


def _where(spec: Mapping[str, Any]) -> str:
    """`FAMILY TABLE`."""
    family = spec.get("family")
    if family not in ("ip", "ip6", "inet"):
        raise NoText(f"family {family!r}")
    return f"{family} {_name(spec['table'])}"


def _quoted(text: Any) -> str:
    if not isinstance(text, str) or '"' in text or "\\" in text or not text.isprintable():
        raise NoText(f"string {text!r}")
    return f'"{text}"'


def _only(spec: Mapping[str, Any], *fields: str) -> None:
    """A field this module would not write (a rule's position, a chain's
    device ...) is one it cannot drop silently."""
    extra = set(spec) - {"family", "table", "name", *fields}
    if extra:
        raise NoText(f"fields {sorted(extra)}")


def _comment(spec: Mapping[str, Any]) -> str:
    comment = spec.get("comment")
    return f" comment {_quoted(comment)}" if comment else ""


def _table(verb: str, kind: str, spec: Mapping[str, Any]) -> str:
    _only(spec, "comment")
    text = f"{verb} table {_where({'family': spec.get('family'), 'table': spec['name']})}"
    if not spec.get("comment"):
        return text
    if verb != "add":
        raise NoText(f"{verb} of a table with a comment")
    return f"{text} {{ comment {_quoted(spec['comment'])}; }}"


def _chain(verb: str, kind: str, spec: Mapping[str, Any]) -> str:
    _only(spec, "type", "hook", "prio", "policy")
    text = f"{verb} chain {_where(spec)} {_name(spec['name'])}"
    if "hook" not in spec:
        return text
    if verb != "add":
        raise NoText(f"{verb} of a base chain")
    prio = spec["prio"]
    if type(prio) is not int:
        raise NoText(f"priority {prio!r}")
    hook = f"type {_symbol(spec['type'])} hook {_symbol(spec['hook'])} priority {prio};"
    # Only a policy the JSON names: the kernel refuses a policy where it ignores none.
    policy = f" policy {_symbol(spec['policy'])};" if "policy" in spec else ""
    return f"{text} {{ {hook}{policy} }}"


def _set(verb: str, kind: str, spec: Mapping[str, Any]) -> str:
    _only(spec)
    return f"{verb} {kind} {_where(spec)} {_name(spec['name'])}"


def _rule(verb: str, kind: str, spec: Mapping[str, Any]) -> str:
    _only(spec, "chain", "expr", "comment")
    statements = " ".join([_statement(s) for s in spec["expr"]])
    return f"add rule {_where(spec)} {_name(spec['chain'])} {statements}{_comment(spec)}"


def _element(verb: str, kind: str, spec: Mapping[str, Any]) -> str:
    _only(spec, "elem")
    elems = spec["elem"]
    if isinstance(elems, ElementList):
        items = _element_values(elems.elements, elems.with_comment)
    else:
        items = [_element_json(e) for e in elems]
    if not items:
        raise NoText("no elements")
    return f"{verb} element {_where(spec)} {_name(spec['name'])} {{ {', '.join(items)} }}"


_COMMANDS: Mapping[tuple[str, str], Callable[[str, str, Mapping[str, Any]], str]] = {
    ("add", "table"): _table,
    ("delete", "table"): _table,
    ("add", "chain"): _chain,
    ("flush", "chain"): _chain,
    ("delete", "chain"): _chain,
    ("flush", "set"): _set,
    ("flush", "map"): _set,
    ("delete", "set"): _set,
    ("delete", "map"): _set,
    ("add", "rule"): _rule,
    ("add", "element"): _element,
    ("delete", "element"): _element,
}


# --- elements --------------------------------------------------------------------------


def _element_values(elements: Sequence[Element], with_comment: bool) -> list[str]:
    """Elements as text, written from their values (the hot path of a full
    sync: ~180,000 of them at 10,000 x 10). Key parts are the model's
    addresses, CIDRs, protocols and numbers, written unchecked; the
    comments are checked once, all together."""
    items: list[str] = []
    comments: list[str] = []
    verdicts: dict[Verdict, str] = {}
    for e in elements:
        key = e.key
        text = " . ".join([
            str(part) if isinstance(part, int) else part if "/" not in part
            else _value(prefix(part))
            for part in key
        ])  # fmt: skip
        comment = e.comment
        if with_comment and comment:
            comment = names.comment(comment)
            comments.append(comment)
            text = f'{text} comment "{comment}"'
        value = e.value
        if value is None:
            items.append(text)
        elif isinstance(value, Target):
            items.append(f"{text} : {value.ip} . {value.port}")
        else:
            verdict = verdicts.get(value)
            if verdict is None:
                verdict = verdicts[value] = _verdict(value.to_json())
            items.append(f"{text} : {verdict}")
    _quotable(comments)
    return items


def _quotable(texts: list[str]) -> None:
    """NoText unless every one of `texts` can be written between quotes."""
    joined = "".join(texts)
    if '"' in joined or "\\" in joined or not joined.isprintable():
        for text in texts:
            _quoted(text)


def _element_json(elem: Any) -> str:
    """A JSON element: KEY, {"elem": {"val": KEY, ...}} or [KEY, DATA]."""
    if isinstance(elem, list):
        if len(elem) != 2:
            raise NoText(f"element {elem!r}")
        return f"{_element_json(elem[0])} : {_data(elem[1])}"
    if isinstance(elem, Mapping) and set(elem) == {"elem"}:
        return _elem(elem["elem"])
    return _value(elem)


def _elem(body: Mapping[str, Any]) -> str:
    """`VAL [timeout Ns] [comment "C"]`."""
    if not set(body) <= {"val", "timeout", "comment"}:
        raise NoText(f"element options {sorted(body)}")
    text = _value(body["val"])
    if "timeout" in body:
        text += f" timeout {_int(body['timeout'])}s"
    return text + _comment(body)


def _data(data: Any) -> str:
    """A map element's data: a verdict or a value."""
    if isinstance(data, Mapping) and len(data) == 1 and next(iter(data)) in _VERDICTS:
        return _verdict(data)
    return _value(data)


# --- expressions -----------------------------------------------------------------------


def _int(value: Any) -> int:
    if type(value) is not int:
        raise NoText(f"integer {value!r}")
    return value


def _symbol(value: Any) -> str:
    if not isinstance(value, str) or not _SYMBOL.match(value):
        raise NoText(f"symbol {value!r}")
    return value


def _literal(value: str) -> str:
    """An address or a symbolic constant (`tcp`, `local`, `new`)."""
    if _ADDRESS.match(value) or _SYMBOL.match(value):
        return value
    raise NoText(f"literal {value!r}")


def _payload(body: Mapping[str, Any]) -> str:
    return f"{_symbol(body['protocol'])} {_symbol(body['field'])}"


def _meta(body: Mapping[str, Any]) -> str:
    return f"meta {_symbol(body['key'])}"


def _ct(body: Mapping[str, Any]) -> str:
    return f"ct {_symbol(body['key'])}"


def _fib(body: Mapping[str, Any]) -> str:
    flags = " . ".join(_symbol(f) for f in body["flags"])
    return f"fib {flags} {_symbol(body['result'])}"


def _numgen(body: Mapping[str, Any]) -> str:
    if body.get("mode") != "random" or not set(body) <= {"mode", "mod", "offset"}:
        raise NoText(f"numgen {body!r}")
    text = f"numgen random mod {_int(body['mod'])}"
    return text + (f" offset {_int(body['offset'])}" if "offset" in body else "")


def _concat(parts: Sequence[Any]) -> str:
    return " . ".join(_value(p) for p in parts)


def _prefix(body: Mapping[str, Any]) -> str:
    return f"{_literal(body['addr'])}/{_int(body['len'])}"


def _anonymous(items: Any) -> str:
    items = items if isinstance(items, list) else [items]
    return "{ " + ", ".join(_value(i) for i in items) + " }"


def _map(body: Mapping[str, Any]) -> str:
    return f"{_value(body['key'])} map {_ref(body['data'])}"


_EXPRESSIONS: Mapping[str, Callable[[Any], str]] = {
    "payload": _payload,
    "meta": _meta,
    "ct": _ct,
    "fib": _fib,
    "numgen": _numgen,
    "concat": _concat,
    "prefix": _prefix,
    "set": _anonymous,
    "map": _map,
    "elem": _elem,
}
_BINOPS = ("&", "|", "^")


def _ref(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("@"):
        raise NoText(f"set reference {value!r}")
    return "@" + _name(value[1:])


def _value(node: Any) -> str:
    """An expression (JSON objects are dicts: checked as such, the ABC check
    costs a fifth of a full sync's rule text)."""
    if type(node) is dict and len(node) == 1:
        ((kind, body),) = node.items()
        writer = _EXPRESSIONS.get(kind)
        if writer is not None:
            return writer(body)
        if kind in _BINOPS and type(body) is list and len(body) == 2:
            return f"{_value(body[0])} {kind} {_value(body[1])}"
    elif type(node) is int:
        return str(node)
    elif type(node) is str:
        return _ref(node) if node.startswith("@") else _literal(node)
    elif type(node) is list:
        return _anonymous(node)
    raise NoText(f"expression {node!r}")


# --- statements ------------------------------------------------------------------------

_VERDICTS = ("accept", "drop", "return", "continue", "jump", "goto")


def _verdict(node: Mapping[str, Any]) -> str:
    ((kind, body),) = node.items()
    if kind in ("jump", "goto"):
        return f"{kind} {_name(body['target'])}"
    if body is not None or kind not in _VERDICTS:
        raise NoText(f"verdict {node!r}")
    return str(kind)


def _match(body: Mapping[str, Any]) -> str:
    op, left, right = body["op"], _value(body["left"]), body["right"]
    if body["left"] == {"meta": {"key": "iifname"}} and op in ("==", "!="):
        return f"{left} {op} {_quoted(right)}"  # a name, with nft's * wildcard
    if op == "in":
        return f"{left} {_value(right)}"
    if op not in ("==", "!="):
        raise NoText(f"operator {op!r}")
    if isinstance(right, str) and right.startswith("@"):
        return f"{left} {'!= ' if op == '!=' else ''}{_ref(right)}"
    return f"{left} {op} {_value(right)}"


def _vmap(body: Mapping[str, Any]) -> str:
    return f"{_value(body['key'])} vmap {_ref(body['data'])}"


def _mangle(body: Mapping[str, Any]) -> str:
    return f"{_value(body['key'])} set {_value(body['value'])}"


def _set_statement(body: Mapping[str, Any]) -> str:
    op = body["op"]
    if op not in ("add", "update"):
        raise NoText(f"set statement {op!r}")
    return f"{op} {_ref(body['set'])} {{ {_value(body['elem'])} }}"


def _dnat(body: Mapping[str, Any]) -> str:
    if not set(body) <= {"family", "addr", "port"}:
        raise NoText(f"dnat {sorted(body)}")
    family = f"{_symbol(body['family'])} " if "family" in body else ""
    addr = body["addr"]
    if isinstance(addr, Mapping):
        if "port" in body:
            raise NoText("dnat: a map and a port")
        return f"dnat {family}to {_value(addr)}"
    host = _literal(addr)
    if "port" not in body:
        return f"dnat {family}to {host}"
    host = f"[{host}]" if ":" in host else host
    return f"dnat {family}to {host}:{_int(body['port'])}"


def _masquerade(body: Mapping[str, Any] | None) -> str:
    flags = (body or {}).get("flags", [])
    flags = [flags] if isinstance(flags, str) else flags
    return " ".join(["masquerade", *(_symbol(f) for f in flags)])


def _reject(body: Mapping[str, Any] | None) -> str:
    body = body or {}
    kind = body.get("type")
    if kind is None:
        return "reject"
    if kind == "tcp reset":
        return "reject with tcp reset"
    return f"reject with {_symbol(kind)} {_symbol(body['expr'])}"


_STATEMENTS: Mapping[str, Callable[[Any], str]] = {
    "match": _match,
    "vmap": _vmap,
    "mangle": _mangle,
    "set": _set_statement,
    "dnat": _dnat,
    "masquerade": _masquerade,
    "reject": _reject,
}


def _statement(node: Any) -> str:
    if type(node) is not dict or len(node) != 1:
        raise NoText(f"statement {node!r}")
    ((kind, body),) = node.items()
    if kind in _VERDICTS:
        return _verdict(node)
    writer = _STATEMENTS.get(kind)
    if writer is None:
        raise NoText(f"statement {kind!r}")
    return writer(body)
