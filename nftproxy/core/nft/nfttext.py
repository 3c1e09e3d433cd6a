"""A transaction in nft's own syntax: one of the two printers of commands.

Layer: nft (pure). One job: write a transaction's typed commands
(core/nft/commands.py) as the lines `nft -f` reads. Total: every command
has its line, set and map declarations included (by typeof, the form
both userspaces list cleanly; libnftables 1.0.6 can declare an integer key
only so). Comments are sayable by construction (names.comment), and names
are checked when a command is built; nft's syntax quotes no name, so a
table name that is one of nft's keywords is found at start-up
(kernel/libnftables.py) and the JSON printer is chosen instead.

Rule statements are core/rules/expr.py's libnftables JSON shapes; a shape
this module cannot spell raises `NoText` (a programming error: every shape
expr.py builds is spelled, tests/test_nfttext.py).

Why this printer is the default: libnftables parses and evaluates nft text
in less time than the same commands in JSON, elements and rules alike, on
both userspaces (bench/RESULTS.md, "What moved the numbers").
Both printers make the same kernel objects (tests/test_nfttext_kernel.py
lists both back and compares them).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
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
from nftproxy.core.rules import names
from nftproxy.core.rules.expr import prefix
from nftproxy.core.rules.fragment import NAME, Element, Key, Target, Verdict

__all__ = ["NoText", "command_text", "transaction_text"]


class NoText(ValueError):
    """A rule statement this module cannot write in nft's syntax."""


_SYMBOL = re.compile(r"[a-z][a-z0-9\-]*\Z")
_ADDRESS = re.compile(r"[0-9A-Fa-f.:]+(/[0-9]+)?\Z")


def transaction_text(commands: Sequence[Command]) -> str:
    """The commands as nft text, one per line."""
    return "".join([command_text(c) + "\n" for c in commands])


def _where(w: Where) -> str:
    return f"{w.family} {w.table}"


def _comment(text: str | None) -> str:
    return f' comment "{text}"' if text else ""


def command_text(command: Command) -> str:
    """One command's line."""
    match command:
        case AddElements(where, name, elements):
            items = ", ".join(_element_values(elements))
            return f"add element {_where(where)} {name} {{ {items} }}"
        case AddRule(where, chain, rule):
            statements = " ".join([_statement(s) for s in rule.expr])
            return f"add rule {_where(where)} {chain} {statements}{_comment(rule.comment)}"
        case DeleteElements(where, name, keys):
            items = ", ".join([_key(k) for k in keys])
            return f"delete element {_where(where)} {name} {{ {items} }}"
        case AddChain(where, name, hook, comment):
            body: list[str] = [] if hook is None else [
                f"type {_symbol(hook.type)} hook {_symbol(hook.hook)} priority {_int(hook.prio)}",
                f"policy {_symbol(hook.policy)}",
            ]
            body += [f'comment "{comment}"'] if comment else []
            text = f"add chain {_where(where)} {name}"
            return f"{text} {{ {'; '.join(body)}; }}" if body else text
        case FlushChain(where, name):
            return f"flush chain {_where(where)} {name}"
        case DeleteChain(where, name):
            return f"delete chain {_where(where)} {name}"
        case AddSet():
            return _declaration(command)
        case FlushSet(where, name, is_map):
            return f"flush {'map' if is_map else 'set'} {_where(where)} {name}"
        case DeleteSet(where, name, is_map):
            return f"delete {'map' if is_map else 'set'} {_where(where)} {name}"
        case AddTable(where, comment, create):
            said = f' {{ comment "{comment}"; }}' if comment else ""
            return f"{'create' if create else 'add'} table {_where(where)}{said}"
        case DeleteTable(where):
            return f"delete table {_where(where)}"
    raise TypeError(f"not a command: {command!r}")


def _declaration(command: AddSet) -> str:
    """`add set|map F T N { typeof KEY [: DATA]; flags ...; ... }`."""
    decl = command.decl
    typeof = " . ".join(decl.key)
    if decl.map:
        typeof += " : " + (" . ".join(decl.data) if decl.data else "verdict")
    body = [f"typeof {typeof}"]
    if decl.flags:
        body.append("flags " + ", ".join(_symbol(f) for f in decl.flags))
    if decl.timeout is not None:
        body.append(f"timeout {_int(decl.timeout)}s")
    if decl.size is not None:
        body.append(f"size {_int(decl.size)}")
    if decl.comment:
        body.append(f'comment "{decl.comment}"')
    where = _where(command.where)
    return f"add {command.kind} {where} {command.name} {{ {'; '.join(body)}; }}"


# --- elements --------------------------------------------------------------------------


def _key(key: Key) -> str:
    """A key's parts (fragment.check_key: addresses, CIDRs, protocols, numbers)."""
    return " . ".join([
        str(part) if isinstance(part, int) else part if "/" not in part
        else _value(prefix(part))
        for part in key
    ])  # fmt: skip


def _element_values(elements: Sequence[Element]) -> list[str]:
    """Elements as text, written from their values (the hot path of a full
    sync: ~180,000 of them at 10,000 x 10)."""
    items: list[str] = []
    verdicts: dict[Verdict, str] = {}
    comment_of = names.comment
    for e in elements:
        text = _key(e.key)
        if e.comment:
            text = f'{text} comment "{comment_of(e.comment)}"'
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
    return items


def _quoted(text: Any) -> str:
    if not isinstance(text, str) or '"' in text or "\\" in text or not text.isprintable():
        raise NoText(f"string {text!r}")
    return f'"{text}"'


def _elem(body: Mapping[str, Any]) -> str:
    """`VAL [timeout Ns]` (a set statement's element)."""
    if not set(body) <= {"val", "timeout"}:
        raise NoText(f"element options {sorted(body)}")
    text = _value(body["val"])
    return text + (f" timeout {_int(body['timeout'])}s" if "timeout" in body else "")


def _name(value: Any) -> str:
    if not isinstance(value, str) or not NAME.match(value):
        raise NoText(f"name {value!r}")
    return value


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
    if op == "in":  # flags: `ct state established,related` (a list in braces would be a set)
        flags = right if isinstance(right, list) else [right]
        return f"{left} {','.join(_symbol(f) for f in flags)}"
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
