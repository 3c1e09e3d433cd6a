"""A transaction in nft's syntax, read into the JSON commands FakeBackend applies.

Layer: kernel edge's test double (no kernel). One job: read exactly what
core/nft/nfttext.py writes, one command per line, into the libnftables JSON
command objects core/nft/jsontext.py writes for the same commands
(`command_json`), so that the fake applies what was sent. Tables, chains
(base chains with their hook), rules (the statements core/rules/expr.py
builds), flushes and deletes, and elements (keys, comments, verdicts and
`addr . port` data) read as JSON prints them.

Set and map declarations (`add set|map F T NAME { typeof KEY [: DATA];
[flags ...;] [timeout Ns;] [size N;] [comment "...";] }`) read in the
shape each libnftables lists them, as kernel/fake_txn.py `_add_set` takes
them from text: 1.1.x keeps the typeof expressions, 1.0.6 their datatypes
(`"type": ["integer", ...]`, `"map": "ipv4_addr . inet_service"`); a
verdict map's data is "verdict" on both.

Where nft's text is ambiguous, it reads as the JSON expr.py builds:
`LEFT a,b` is an "in" match against a list of flags, `LEFT == { a, b }` a
match against an anonymous set, `LEFT @s` an "==" lookup, `LEFT VALUE`
(`ct status dnat`) an "in" match against the value; `{ VAL }` in a set
statement is the bare value, `{ VAL timeout Ns }` an "elem"; a bare
`masquerade` or `reject` has no options (null); a number is an integer
(ports, priorities, marks), an address or a symbol a string. Anything
else raises NotImplementedError naming the text: nothing is accepted
silently.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from nftproxy.core.rules.fragment import SELECTORS

__all__ = ["parse_transaction"]

_TOKEN = re.compile(r'\s*(?:("[^"]*")|([{},;])|([^\s{},;"]+))')
"""A quoted string (kept with its quotes), a brace, comma or semicolon, or a word."""
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]*\Z")
_SYMBOL = re.compile(r"[a-z][a-z0-9\-]*\Z")
_ADDRESS = re.compile(r"[0-9A-Fa-f.:]+\Z")
_PREFIX = re.compile(r"(?P<addr>[0-9A-Fa-f.:]+)/(?P<len>[0-9]+)\Z")
_NUMBER = re.compile(r"[0-9]+\Z")
_SIGNED = re.compile(r"-?[0-9]+\Z")
_FAMILIES = ("ip", "ip6", "inet")
_NAT_FAMILIES = ("ip", "ip6")
_PROTOCOLS = ("ip", "ip6", "tcp", "udp", "sctp", "th")
_FIELDS = ("saddr", "daddr", "sport", "dport")
_KEY_PROTOCOLS = ("tcp", "udp", "sctp")
_BINOPS = ("&", "|", "^")
_VERDICTS = ("accept", "drop", "return", "continue")
_JUMPS = ("jump", "goto")
_NAT_FLAGS = ("random", "fully-random", "persistent")


class _Line:
    """The tokens of one command line, read front to back."""

    def __init__(self, line: str) -> None:
        self.line = line
        self.tokens: list[str] = []
        pos = 0
        while pos < len(line):
            m = _TOKEN.match(line, pos)
            if m is None or m.end() == pos:
                if line[pos:].strip():
                    raise self.unknown(line[pos:])
                break
            self.tokens.append(m.group(m.lastindex or 0))
            pos = m.end()
        self.pos = 0

    def unknown(self, what: str) -> NotImplementedError:
        return NotImplementedError(f"FakeBackend does not read nft text {what!r} in {self.line!r}")

    def peek(self, ahead: int = 0) -> str | None:
        i = self.pos + ahead
        return self.tokens[i] if i < len(self.tokens) else None

    def next(self) -> str:
        if self.pos >= len(self.tokens):
            raise self.unknown("<end of line>")
        self.pos += 1
        return self.tokens[self.pos - 1]

    def at_end(self) -> bool:
        return self.pos >= len(self.tokens)

    def accept(self, token: str) -> bool:
        if self.peek() == token:
            self.pos += 1
            return True
        return False

    def expect(self, token: str) -> None:
        got = self.next()
        if got != token:
            raise self.unknown(got)

    def end(self) -> None:
        if not self.at_end():
            raise self.unknown(" ".join(self.tokens[self.pos :]))

    def matching(self, pattern: re.Pattern[str]) -> str:
        token = self.next()
        if not pattern.match(token):
            raise self.unknown(token)
        return token

    def name(self) -> str:
        return self.matching(_NAME)

    def symbol(self) -> str:
        return self.matching(_SYMBOL)

    def number(self) -> int:
        return int(self.matching(_NUMBER))

    def seconds(self) -> int:
        token = self.next()
        if not token.endswith("s") or not _NUMBER.match(token[:-1]):
            raise self.unknown(token)
        return int(token[:-1])

    def quoted(self) -> str:
        token = self.next()
        if not token.startswith('"'):
            raise self.unknown(token)
        return token[1:-1]

    def ref(self) -> str:
        token = self.next()
        if not token.startswith("@") or not _NAME.match(token[1:]):
            raise self.unknown(token)
        return token


def parse_transaction(text: str, *, v11: bool) -> list[dict[str, Any]]:
    """The JSON commands of an nft-syntax transaction, one per non-empty line."""
    return [_command(_Line(line), v11) for line in text.splitlines() if line.strip()]


# --- commands --------------------------------------------------------------------------


def _command(p: _Line, v11: bool) -> dict[str, Any]:
    verb, what = p.next(), p.next()
    if verb == "add" and what in ("set", "map"):
        out = _declaration(p, what, v11)
    elif (verb, what) in (("add", "table"), ("create", "table"), ("delete", "table")):
        out = {verb: {"table": _table(p, verb != "delete")}}
    elif (verb, what) in (("add", "chain"), ("flush", "chain"), ("delete", "chain")):
        spec = _where(p, "name")
        if verb == "add" and p.accept("{"):
            spec.update(_chain_body(p))
        out = {verb: {"chain": spec}}
    elif verb in ("flush", "delete") and what in ("set", "map"):
        out = {verb: {what: _where(p, "name")}}
    elif verb in ("add", "delete") and what == "element":
        spec = _where(p, "name")
        spec["elem"] = _elements(p, with_values=verb == "add")
        out = {verb: {"element": spec}}
    elif (verb, what) == ("add", "rule"):
        out = {"add": {"rule": _rule(p)}}
    else:
        raise p.unknown(f"{verb} {what}")
    p.end()
    return out


def _family(p: _Line) -> str:
    family = p.next()
    if family not in _FAMILIES:
        raise p.unknown(family)
    return family


def _where(p: _Line, key: str) -> dict[str, Any]:
    """`F T NAME`: {"family": F, "table": T, key: NAME}."""
    family = _family(p)
    table = p.name()
    return {"family": family, "table": table, key: p.name()}


def _table(p: _Line, add: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {"family": _family(p), "name": p.name()}
    if add and p.accept("{"):
        p.expect("comment")
        spec["comment"] = p.quoted()
        p.expect(";")
        p.expect("}")
    return spec


def _chain_body(p: _Line) -> dict[str, Any]:
    """`[type T hook H priority N; policy P;] [comment "C";] }` (after the brace)."""
    spec: dict[str, Any] = {}
    if p.accept("type"):
        spec["type"] = p.symbol()
        p.expect("hook")
        spec["hook"] = p.symbol()
        p.expect("priority")
        spec["prio"] = int(p.matching(_SIGNED))
        p.expect(";")
        p.expect("policy")
        spec["policy"] = p.symbol()
        p.expect(";")
    if p.accept("comment"):
        spec["comment"] = p.quoted()
        p.expect(";")
    if not spec:
        raise p.unknown("an empty chain body")
    p.expect("}")
    return spec


def _rule(p: _Line) -> dict[str, Any]:
    spec = _where(p, "chain")
    statements: list[Any] = []
    while not p.at_end():
        if p.accept("comment"):
            spec["comment"] = p.quoted()
            break
        statements.append(_statement(p))
    if not statements:
        raise p.unknown("a rule without statements")
    spec["expr"] = statements
    return spec


# --- declarations ----------------------------------------------------------------------


def _selectors(p: _Line, words: list[str]) -> list[str]:
    """`ip daddr . meta l4proto . numgen random mod 1` as SELECTORS keys."""
    parts: list[list[str]] = [[]]
    for word in words:
        if word == ".":
            parts.append([])
        else:
            parts[-1].append(word)
    selectors = [" ".join(part) for part in parts]
    for selector in selectors:
        if selector not in SELECTORS:
            raise p.unknown(f"typeof {selector}")
    return selectors


def _typeof(parts: list[str]) -> Any:
    exprs = [SELECTORS[p][0] for p in parts]
    return {"typeof": exprs[0] if len(exprs) == 1 else {"concat": exprs}}


def _declaration(p: _Line, kind: str, v11: bool) -> dict[str, Any]:
    spec = _where(p, "name")
    p.expect("{")
    while not p.accept("}"):
        item = p.next()
        if item == "typeof" and "type" not in spec:
            words: list[str] = []
            while p.peek() not in (";", ":", None):
                words.append(p.next())
            keys = _selectors(p, words)
            spec["type"] = _typeof(keys) if v11 else [SELECTORS[k][1] for k in keys]
            if p.accept(":"):
                data: list[str] = []
                while p.peek() not in (";", None):
                    data.append(p.next())
                if kind != "map":
                    raise p.unknown(f"data of set {spec['name']}")
                if data == ["verdict"]:
                    spec["map"] = "verdict"
                else:
                    values = _selectors(p, data)
                    spec["map"] = (
                        _typeof(values) if v11 else " . ".join(SELECTORS[v][1] for v in values)
                    )
            elif kind == "map":
                raise p.unknown(f"map {spec['name']} without data")
        elif item == "flags" and "flags" not in spec:
            spec["flags"] = [p.symbol()]
            while p.accept(","):
                spec["flags"].append(p.symbol())
        elif item == "timeout" and "timeout" not in spec:
            spec["timeout"] = p.seconds()
        elif item == "size" and "size" not in spec:
            spec["size"] = p.number()
        elif item == "comment" and "comment" not in spec:
            spec["comment"] = p.quoted()
        else:
            raise p.unknown(item)
        p.expect(";")
    if "type" not in spec:
        raise p.unknown(f"{kind} {spec['name']} without typeof")
    return {"add": {kind: spec}}


# --- elements --------------------------------------------------------------------------


def _key_part(p: _Line) -> Any:
    """An address, a CIDR (as jsontext.key_json: a prefix), a protocol or a number."""
    token = p.next()
    if (value := _number_or_address(token)) is not None:
        return value
    if token in _KEY_PROTOCOLS:
        return token
    raise p.unknown(token)


def _number_or_address(token: str) -> Any:
    """A number (an integer), a CIDR (a prefix) or an address; else None."""
    if _NUMBER.match(token):
        return int(token)
    if (cidr := _PREFIX.match(token)) is not None and _is_address(cidr["addr"]):
        return {"prefix": {"addr": cidr["addr"], "len": int(cidr["len"])}}
    return token if _is_address(token) else None


def _is_address(text: str) -> bool:
    if not _ADDRESS.match(text):
        return False
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _key(p: _Line) -> Any:
    parts = [_key_part(p)]
    while p.accept("."):
        parts.append(_key_part(p))
    return parts[0] if len(parts) == 1 else {"concat": parts}


def _verdict(p: _Line) -> Any:
    kind = p.next()
    if kind in _JUMPS:
        return {kind: {"target": p.name()}}
    if kind in _VERDICTS:
        return {kind: None}
    raise p.unknown(kind)


def _element(p: _Line, with_values: bool) -> Any:
    key = _key(p)
    if not with_values:
        return key
    if p.accept("comment"):
        key = {"elem": {"val": key, "comment": p.quoted()}}
    if not p.accept(":"):
        return key
    if p.peek() in (*_JUMPS, *_VERDICTS):
        return [key, _verdict(p)]
    return [key, _key(p)]


def _elements(p: _Line, *, with_values: bool) -> list[Any]:
    p.expect("{")
    items = [_element(p, with_values)]
    while p.accept(","):
        items.append(_element(p, with_values))
    p.expect("}")
    return items


# --- expressions -----------------------------------------------------------------------


def _numgen(p: _Line) -> Any:
    p.expect("random")
    p.expect("mod")
    body: dict[str, Any] = {"mode": "random", "mod": p.number()}
    if p.accept("offset"):
        body["offset"] = p.number()
    return {"numgen": body}


def _fib(p: _Line) -> Any:
    flags = [p.symbol()]
    while p.accept("."):
        flags.append(p.symbol())
    return {"fib": {"result": p.symbol(), "flags": flags}}


def _anonymous(p: _Line) -> list[Any]:
    """`{ a, b }` (after the brace) as the list of its items."""
    items = [_expr(p)]
    while p.accept(","):
        items.append(_expr(p))
    p.expect("}")
    return items


def _primary(p: _Line) -> Any:
    token = p.next()
    if token == "{":
        return {"set": _anonymous(p)}
    if token.startswith("@"):
        p.pos -= 1
        return p.ref()
    if token == "numgen":
        return _numgen(p)
    if token == "fib":
        return _fib(p)
    if token in ("meta", "ct"):
        return {token: {"key": p.symbol()}}
    if token in _PROTOCOLS and p.peek() in _FIELDS:
        return {"payload": {"protocol": token, "field": p.next()}}
    if (value := _number_or_address(token)) is not None:
        return value
    if _SYMBOL.match(token):
        return token
    raise p.unknown(token)


def _basic(p: _Line) -> Any:
    """Binary operations, left to right (nft's text has no parentheses)."""
    value = _primary(p)
    while (op := p.peek()) in _BINOPS:
        p.next()
        value = {op: [value, _primary(p)]}
    return value


def _expr(p: _Line) -> Any:
    """A concatenation, and a map lookup of it (`KEY map @m`)."""
    parts = [_basic(p)]
    while p.accept("."):
        parts.append(_basic(p))
    value = parts[0] if len(parts) == 1 else {"concat": parts}
    if p.accept("map"):
        value = {"map": {"key": value, "data": p.ref()}}
    return value


# --- statements ------------------------------------------------------------------------


def _match(p: _Line, left: Any) -> Any:
    token = p.peek()
    if token in ("==", "!="):
        p.next()
        if left == {"meta": {"key": "iifname"}}:
            right: Any = p.quoted()
        elif (p.peek() or "").startswith("@") and token == "==":
            raise p.unknown("== @")  # nfttext writes `LEFT @set`
        else:
            right = _expr(p)
        return {"match": {"op": token, "left": left, "right": right}}
    if token is not None and token.startswith("@"):
        return {"match": {"op": "==", "left": left, "right": p.ref()}}
    if p.accept("vmap"):
        return {"vmap": {"key": left, "data": p.ref()}}
    if p.accept("set"):
        return {"mangle": {"key": left, "value": _expr(p)}}
    if token is None or token in ("}", ",", ";", "comment"):
        raise p.unknown(token or "<end of line>")
    flags = [_expr(p)]  # `ct status dnat`, `ct state established,related`
    while p.accept(","):
        flags.append(_expr(p))
    return {"match": {"op": "in", "left": left, "right": flags[0] if len(flags) == 1 else flags}}


def _dnat(p: _Line) -> Any:
    body: dict[str, Any] = {}
    if p.peek() in _NAT_FAMILIES:
        body["family"] = p.next()
    p.expect("to")
    target = p.peek() or ""
    host, _, port = target.rpartition(":")
    if target.startswith("[") and host.endswith("]") and _NUMBER.match(port):
        if not _is_address(host[1:-1]) or "." in host:
            raise p.unknown(target)
        p.next()
        body.update(addr=host[1:-1], port=int(port))
    elif _is_address(target):
        p.next()
        body["addr"] = target
    elif "." in host and _is_address(host) and _NUMBER.match(port):
        p.next()
        body.update(addr=host, port=int(port))
    else:
        body["addr"] = _expr(p)
        if not isinstance(body["addr"], dict) or "map" not in body["addr"]:
            raise p.unknown(target)
    return {"dnat": body}


def _reject(p: _Line) -> Any:
    if not p.accept("with"):
        return {"reject": None}
    kind = p.symbol()
    if kind == "tcp":
        p.expect("reset")
        return {"reject": {"type": "tcp reset"}}
    return {"reject": {"type": kind, "expr": p.symbol()}}


def _set_statement(p: _Line, op: str) -> Any:
    name = p.ref()
    p.expect("{")
    value = _expr(p)
    if p.accept("timeout"):
        value = {"elem": {"val": value, "timeout": p.seconds()}}
    p.expect("}")
    return {"set": {"op": op, "set": name, "elem": value}}


def _statement(p: _Line) -> Any:
    token = p.peek()
    if token in _VERDICTS or token in _JUMPS:
        return _verdict(p)
    if token == "dnat":
        p.next()
        return _dnat(p)
    if token == "masquerade":
        p.next()
        flags: list[str] = []
        while p.peek() in _NAT_FLAGS:
            flags.append(p.next())
        return {"masquerade": {"flags": flags} if flags else None}
    if token == "reject":
        p.next()
        return _reject(p)
    if token in ("add", "update") and (p.peek(1) or "").startswith("@"):
        p.next()
        return _set_statement(p, token)
    return _match(p, _expr(p))
