"""The left-hand expressions the tracer understands, as typed values.

Layer: core/trace (pure). One job: read the expressions of nft JSON that
nftproxy's rules compare, look up or compute -- payload fields (addresses,
ports), `meta` / `ct` keys, `fib ... type`, `numgen random`, bit operations
on the mark, constants and concatenations -- into typed values with the
`Kind` their literals are read as, and print them as nft does. Anything
else raises `Unsupported`. Statements are syntax.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nftproxy.core.trace.values import Kind, Unsupported

__all__ = [
    "BinOp",
    "Concat",
    "Const",
    "Expr",
    "Fib",
    "Key",
    "Lookup",
    "Numgen",
    "Payload",
    "kinds_of",
    "parse_expr",
    "parse_key",
    "short",
]

# --- expressions -------------------------------------------------------------------

_PAYLOAD_FIELDS = {
    ("ip", "saddr"): Kind.ADDR,
    ("ip", "daddr"): Kind.ADDR,
    ("ip6", "saddr"): Kind.ADDR,
    ("ip6", "daddr"): Kind.ADDR,
    **{(p, f): Kind.PORT for p in ("th", "tcp", "udp", "sctp") for f in ("sport", "dport")},
}
_KEYS = {
    ("meta", "l4proto"): Kind.PROTO,
    ("meta", "mark"): Kind.MARK,
    ("meta", "iifname"): Kind.IFNAME,
    ("ct", "state"): Kind.CT_STATE,
    ("ct", "status"): Kind.CT_STATUS,
}


@dataclass(frozen=True, slots=True)
class Payload:
    protocol: str
    field: str

    @property
    def kind(self) -> Kind:
        return _PAYLOAD_FIELDS[(self.protocol, self.field)]

    def __str__(self) -> str:
        return f"{self.protocol} {self.field}"


@dataclass(frozen=True, slots=True)
class Key:
    """`meta KEY` or `ct KEY` (`source` "meta" / "ct")."""

    source: str
    key: str

    @property
    def kind(self) -> Kind:
        return _KEYS[(self.source, self.key)]

    def __str__(self) -> str:
        return f"{self.source} {self.key}"


@dataclass(frozen=True, slots=True)
class Fib:
    """`fib saddr type` / `fib daddr type`: the routing type of an address."""

    field: str

    @property
    def kind(self) -> Kind:
        return Kind.FIB_TYPE

    def __str__(self) -> str:
        return f"fib {self.field} type"


@dataclass(frozen=True, slots=True)
class Numgen:
    """`numgen random mod N offset O`: uniform over O..O+N-1."""

    mod: int
    offset: int = 0

    @property
    def kind(self) -> Kind:
        return Kind.INT

    def __str__(self) -> str:
        offset = f" offset {self.offset}" if self.offset else ""
        return f"numgen random mod {self.mod}{offset}"


@dataclass(frozen=True, slots=True)
class Const:
    value: int

    @property
    def kind(self) -> Kind:
        return Kind.INT

    def __str__(self) -> str:
        return hex(self.value) if self.value > 9 else str(self.value)


@dataclass(frozen=True, slots=True)
class BinOp:
    """`meta mark & 0x4000` and friends (&, |, ^ with a constant)."""

    op: str
    left: Expr
    right: Const

    @property
    def kind(self) -> Kind:
        return self.left.kind

    def __str__(self) -> str:
        return f"{self.left} {self.op} {self.right}"


@dataclass(frozen=True, slots=True)
class Concat:
    parts: tuple[Expr, ...]

    @property
    def kinds(self) -> tuple[Kind, ...]:
        return tuple(p.kind for p in self.parts)

    def __str__(self) -> str:
        return " . ".join(str(p) for p in self.parts)


Expr = Payload | Key | Fib | Numgen | Const | BinOp
Lookup = Expr | Concat


def kinds_of(key: Lookup) -> tuple[Kind, ...]:
    """The kinds of a lookup key's components (one for a plain expression)."""
    return key.kinds if isinstance(key, Concat) else (key.kind,)


_Parser = Callable[[Any, Any], "Expr"]


def parse_expr(node: Any) -> Expr:
    """A single (not concatenated) left-hand expression."""
    if isinstance(node, int) and not isinstance(node, bool):
        return Const(node)
    if not isinstance(node, Mapping) or len(node) != 1:
        raise Unsupported(f"unsupported expression {short(node)}")
    ((name, body),) = node.items()
    parser: _Parser | None = _EXPR_PARSERS.get(name)
    if parser is None:
        raise Unsupported(f"unsupported expression {name!r}: {short(node)}")
    return parser(body, node)


def parse_key(node: Any) -> Lookup:
    """A lookup key: one expression or a concatenation of them."""
    if isinstance(node, Mapping) and set(node) == {"concat"}:
        return Concat(tuple(parse_expr(p) for p in node["concat"]))
    return parse_expr(node)


def _payload(body: Any, node: Any) -> Expr:
    if not isinstance(body, Mapping) or (body.get("protocol"), body.get("field")) not in (
        _PAYLOAD_FIELDS
    ):
        raise Unsupported(f"unsupported payload expression {short(node)}")
    return Payload(body["protocol"], body["field"])


def _keyed(source: str) -> _Parser:
    """`{"meta": {"key": K}}` / `{"ct": {"key": K}}` (no ct direction)."""

    def parse(body: Any, node: Any) -> Expr:
        if (not isinstance(body, Mapping) or set(body) != {"key"}
                or (source, body["key"]) not in _KEYS):
            raise Unsupported(f"unsupported {source} expression {short(node)}")
        return Key(source, body["key"])

    return parse


def _fib(body: Any, node: Any) -> Expr:
    flags = body.get("flags") if isinstance(body, Mapping) else None
    flags = [flags] if isinstance(flags, str) else flags
    if body.get("result") != "type" or flags not in (["saddr"], ["daddr"]):
        raise Unsupported(f"unsupported fib expression {short(node)}")
    return Fib(flags[0])


def _numgen(body: Any, node: Any) -> Expr:
    if not isinstance(body, Mapping) or body.get("mode") != "random":
        raise Unsupported(f"unsupported numgen expression {short(node)}")
    mod, offset = body.get("mod"), body.get("offset", 0)
    if not isinstance(mod, int) or mod < 1 or not isinstance(offset, int):
        raise Unsupported(f"unsupported numgen expression {short(node)}")
    return Numgen(mod, offset)


def _binop(op: str) -> _Parser:
    def parse(body: Any, node: Any) -> Expr:
        if not isinstance(body, Sequence) or len(body) != 2:
            raise Unsupported(f"unsupported expression {short(node)}")
        left, right = parse_expr(body[0]), parse_expr(body[1])
        if not isinstance(right, Const) or left.kind not in (Kind.MARK, Kind.INT):
            raise Unsupported(f"unsupported expression {short(node)}")
        return BinOp(op, left, right)

    return parse


_EXPR_PARSERS = {
    "payload": _payload,
    "meta": _keyed("meta"),
    "ct": _keyed("ct"),
    "fib": _fib,
    "numgen": _numgen,
    "&": _binop("&"),
    "|": _binop("|"),
    "^": _binop("^"),
}


def short(node: Any) -> str:
    text = repr(node)
    return text if len(text) <= 160 else text[:157] + "..."
