"""The nft JSON statements the tracer understands, as typed values.

Layer: core/trace (pure). One job: turn one rule's libnftables JSON
statements (as `list table` returns them, or as the planner's commands spell
them) into typed statements over the expressions of expressions.py
(re-exported here, so walkers import one vocabulary), and print them back
in nft's own syntax for the trace. Everything nftproxy emits is here (the shapes of
core/rules/expr.py, as the kernel canonicalises them: `ct state` as a string
or a list, masquerade flags as a string or a list, numgen with an offset);
anything else raises `Unsupported`, so the tracer can never give a silently
wrong answer for a rule it does not understand.

Every left-hand expression has a `Kind`, which says how the literals it is
compared with are read (an address, a port, a protocol, a flag set ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from nftproxy.core.trace.expressions import BinOp as BinOp
from nftproxy.core.trace.expressions import Concat as Concat
from nftproxy.core.trace.expressions import Const as Const
from nftproxy.core.trace.expressions import Expr as Expr
from nftproxy.core.trace.expressions import Fib as Fib
from nftproxy.core.trace.expressions import Key as Key
from nftproxy.core.trace.expressions import Lookup as Lookup
from nftproxy.core.trace.expressions import Numgen as Numgen
from nftproxy.core.trace.expressions import Payload as Payload
from nftproxy.core.trace.expressions import kinds_of as kinds_of
from nftproxy.core.trace.expressions import parse_expr as parse_expr
from nftproxy.core.trace.expressions import parse_key, short
from nftproxy.core.trace.values import Kind, Pattern, Unsupported, parse_pattern, pattern_text

__all__ = [
    "BinOp",
    "Concat",
    "Const",
    "Counter",
    "Dnat",
    "DnatMap",
    "Expr",
    "Fib",
    "Key",
    "Lookup",
    "Mangle",
    "Masquerade",
    "Match",
    "Numgen",
    "Payload",
    "Reject",
    "Rhs",
    "SetRef",
    "SetUpdate",
    "Statement",
    "Unsupported",
    "Verdict",
    "VerdictKind",
    "Vmap",
    "kinds_of",
    "parse_expr",
    "parse_statement",
    "parse_verdict",
]


# --- right-hand sides -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SetRef:
    """`@name`: a named set or map, looked up in the ruleset."""

    name: str

    def __str__(self) -> str:
        return "@" + self.name


Rhs = SetRef | tuple[Pattern, ...]
"""A named set, or the patterns of a literal / anonymous set (any may match)."""


def parse_rhs(node: Any, kinds: tuple[Kind, ...]) -> Rhs:
    if isinstance(node, str) and node.startswith("@"):
        return SetRef(node[1:])
    if isinstance(node, Mapping) and set(node) == {"set"}:
        items = node["set"] if isinstance(node["set"], list) else [node["set"]]
        return tuple(parse_pattern(item, kinds) for item in items)
    return (parse_pattern(node, kinds),)


def rhs_text(rhs: Rhs) -> str:
    if isinstance(rhs, SetRef):
        return str(rhs)
    if len(rhs) == 1:
        return pattern_text(rhs[0])
    return "{ " + ", ".join(pattern_text(p) for p in rhs) + " }"


# --- statements -----------------------------------------------------------------------

_OPS = ("==", "!=", "in")
_VERDICTS = ("accept", "drop", "return", "continue", "jump", "goto")


@dataclass(frozen=True, slots=True)
class Match:
    op: str
    left: Lookup
    right: Rhs

    def __str__(self) -> str:
        implicit = self.op == "in" or (
            self.op == "==" and not isinstance(self.left, (Numgen, BinOp))
        )
        return f"{self.left} {'' if implicit else self.op + ' '}{rhs_text(self.right)}"


class VerdictKind(str, Enum):
    ACCEPT = "accept"
    DROP = "drop"
    RETURN = "return"
    CONTINUE = "continue"
    JUMP = "jump"
    GOTO = "goto"


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: VerdictKind
    target: str = ""

    def __str__(self) -> str:
        return f"{self.kind.value} {self.target}".strip()


@dataclass(frozen=True, slots=True)
class Vmap:
    """`KEY vmap @map` or `KEY vmap { k : verdict, ... }`."""

    key: Lookup
    data: SetRef | tuple[tuple[Pattern, Verdict], ...]

    def __str__(self) -> str:
        if isinstance(self.data, SetRef):
            return f"{self.key} vmap {self.data}"
        inner = ", ".join(f"{pattern_text(p)} : {v}" for p, v in self.data)
        return f"{self.key} vmap {{ {inner} }}"


@dataclass(frozen=True, slots=True)
class Mangle:
    """`meta mark set VALUE`."""

    value: Expr

    def __str__(self) -> str:
        return f"meta mark set {self.value}"


@dataclass(frozen=True, slots=True)
class SetUpdate:
    """`update @set { ELEM [timeout Ns] }` / `add @set { ... }` (session
    affinity: `ip saddr . K1 . K2 timeout N` in the shared set, with the
    element's own timeout; or a bare `ip saddr`, with the set's)."""

    op: str
    set: str
    elem: Lookup
    timeout: int | None = None

    def __str__(self) -> str:
        timeout = "" if self.timeout is None else f" timeout {self.timeout}s"
        return f"{self.op} @{self.set} {{ {self.elem}{timeout} }}"


@dataclass(frozen=True, slots=True)
class Dnat:
    addr: str
    port: int | None

    def __str__(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr and self.port is not None else self.addr
        return f"dnat to {host}" + (f":{self.port}" if self.port is not None else "")


@dataclass(frozen=True, slots=True)
class DnatMap:
    """`dnat ip to KEY map @name`: the address (and port) is the data of the
    map's element for the key (the endpoint choice: the key is two
    constant numgens, the chain's, and `numgen random mod N`)."""

    key: Lookup
    map: str
    family: str = ""

    def __str__(self) -> str:
        family = f"{self.family} " if self.family else ""
        return f"dnat {family}to {self.key} map @{self.map}"


@dataclass(frozen=True, slots=True)
class Masquerade:
    flags: tuple[str, ...] = ()

    def __str__(self) -> str:
        return " ".join(("masquerade", *self.flags))


@dataclass(frozen=True, slots=True)
class Reject:
    """`reject with tcp reset` / `reject with icmp(v6) port-unreachable`."""

    type: str = ""
    code: str = ""

    def __str__(self) -> str:
        if self.type == "tcp reset":
            return "reject with tcp reset"
        return f"reject with {self.type} {self.code}".strip() if self.type else "reject"


@dataclass(frozen=True, slots=True)
class Counter:
    packets: int | None = None

    def __str__(self) -> str:
        return "counter" if self.packets is None else f"counter packets {self.packets}"


Statement = (
    Match | Vmap | Verdict | Mangle | SetUpdate | Dnat | DnatMap | Masquerade | Reject | Counter
)


def parse_statement(node: Any) -> Statement:
    """One statement of a rule's `expr` list (Unsupported for anything else)."""
    if not isinstance(node, Mapping) or len(node) != 1:
        raise Unsupported(f"unsupported statement {short(node)}")
    ((name, body),) = node.items()
    if name in _VERDICTS:
        return parse_verdict(node)
    parser = _STATEMENT_PARSERS.get(name)
    if parser is None:
        raise Unsupported(f"unsupported statement {name!r}: {short(node)}")
    return parser(body, node)


def parse_verdict(node: Any) -> Verdict:
    """`{"goto": {"target": C}}`, `{"drop": null}` ... (statement or map value)."""
    if isinstance(node, Mapping) and len(node) == 1:
        ((name, body),) = node.items()
        if name in ("jump", "goto") and isinstance(body, Mapping) and "target" in body:
            return Verdict(VerdictKind(name), str(body["target"]))
        if name in _VERDICTS[:4]:
            return Verdict(VerdictKind(name))
    raise Unsupported(f"unsupported verdict {short(node)}")


def _match(body: Any, node: Any) -> Statement:
    if not isinstance(body, Mapping) or body.get("op") not in _OPS:
        raise Unsupported(f"unsupported match {short(node)}")
    left = parse_key(body["left"])
    return Match(body["op"], left, parse_rhs(body["right"], kinds_of(left)))


def _vmap(body: Any, node: Any) -> Statement:
    key = parse_key(body["key"])
    data = body["data"]
    if isinstance(data, str) and data.startswith("@"):
        return Vmap(key, SetRef(data[1:]))
    if isinstance(data, Mapping) and set(data) == {"set"}:
        kinds = kinds_of(key)
        pairs = tuple(
            (parse_pattern(k, kinds), parse_verdict(v)) for k, v in _pairs(data["set"], node)
        )
        return Vmap(key, pairs)
    raise Unsupported(f"unsupported vmap {short(node)}")


def _pairs(items: Any, node: Any) -> list[tuple[Any, Any]]:
    if not isinstance(items, list) or not all(isinstance(i, list) and len(i) == 2 for i in items):
        raise Unsupported(f"unsupported map elements {short(node)}")
    return [(i[0], i[1]) for i in items]


def _mangle(body: Any, node: Any) -> Statement:
    if not isinstance(body, Mapping) or body.get("key") != {"meta": {"key": "mark"}}:
        raise Unsupported(f"unsupported mangle {short(node)}")
    value = parse_expr(body["value"])
    if value.kind not in (Kind.MARK, Kind.INT):
        raise Unsupported(f"unsupported mangle {short(node)}")
    return Mangle(value)


def _set(body: Any, node: Any) -> Statement:
    name = body.get("set", "") if isinstance(body, Mapping) else ""
    if body.get("op") not in ("add", "update") or not str(name).startswith("@"):
        raise Unsupported(f"unsupported set statement {short(node)}")
    elem = body["elem"]
    if isinstance(elem, Mapping) and set(elem) == {"set"} and len(elem["set"]) == 1:
        elem = elem["set"][0]
    timeout = None
    if isinstance(elem, Mapping) and set(elem) == {"elem"}:
        elem, timeout = _timed(elem["elem"], node)
    return SetUpdate(body["op"], str(name)[1:], parse_key(elem), timeout)


def _timed(inner: Any, node: Any) -> tuple[Any, int | None]:
    """`{"val": KEY, "timeout": N}`, an element with its own timeout: the
    key and the timeout (anything else on the element is not understood)."""
    if not isinstance(inner, Mapping) or "val" not in inner or set(inner) - {"val", "timeout"}:
        raise Unsupported(f"unsupported set element {short(node)}")
    timeout = inner.get("timeout")
    if timeout is not None and (not isinstance(timeout, int) or isinstance(timeout, bool)):
        raise Unsupported(f"unsupported element timeout {short(node)}")
    return inner["val"], timeout


def _dnat(body: Any, node: Any) -> Statement:
    if isinstance(body, Mapping) and isinstance(body.get("addr"), Mapping):
        return _dnat_map(body, node)
    if not isinstance(body, Mapping) or not isinstance(body.get("addr"), str):
        raise Unsupported(f"unsupported dnat {short(node)}")
    if set(body) - {"addr", "port", "family"}:
        raise Unsupported(f"unsupported dnat {short(node)}")
    port = body.get("port")
    if port is not None and not isinstance(port, int):
        raise Unsupported(f"unsupported dnat port {short(node)}")
    return Dnat(body["addr"], port)


def _dnat_map(body: Mapping[str, Any], node: Any) -> Statement:
    """`{"dnat": {"family": F, "addr": {"map": {"key": K, "data": "@m"}}}}`."""
    lookup = body["addr"].get("map")
    if (
        set(body) - {"addr", "family"}
        or set(body["addr"]) != {"map"}
        or not (isinstance(lookup, Mapping) and set(lookup) == {"key", "data"})
    ):
        raise Unsupported(f"unsupported dnat {short(node)}")
    data = lookup["data"]
    if not isinstance(data, str) or not data.startswith("@"):
        raise Unsupported(f"unsupported dnat map {short(node)}")
    return DnatMap(parse_key(lookup["key"]), data[1:], str(body.get("family", "")))


def _masquerade(body: Any, node: Any) -> Statement:
    flags = (body or {}).get("flags", ()) if isinstance(body, Mapping) or body is None else None
    if flags is None or (isinstance(body, Mapping) and set(body) - {"flags"}):
        raise Unsupported(f"unsupported masquerade {short(node)}")
    return Masquerade((flags,) if isinstance(flags, str) else tuple(flags))


def _reject(body: Any, node: Any) -> Statement:
    body = body or {}
    if not isinstance(body, Mapping) or set(body) - {"type", "expr"}:
        raise Unsupported(f"unsupported reject {short(node)}")
    return Reject(str(body.get("type", "")), str(body.get("expr", "")))


def _counter(body: Any, node: Any) -> Statement:
    packets = body.get("packets") if isinstance(body, Mapping) else None
    return Counter(packets if isinstance(packets, int) else None)


_STATEMENT_PARSERS = {
    "match": _match,
    "vmap": _vmap,
    "mangle": _mangle,
    "set": _set,
    "dnat": _dnat,
    "masquerade": _masquerade,
    "reject": _reject,
    "counter": _counter,
}
