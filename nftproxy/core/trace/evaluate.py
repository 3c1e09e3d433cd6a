"""Expressions and lookups evaluated against one branch of the packet.

Layer: core/trace (pure). One job: the value of a left-hand expression for
a `Flow` -- as a distribution, because `numgen random` has many values,
each with its probability (everything else has one value, probability 1) --
and the outcomes of a match or a map lookup on it: which way each value
goes and with what probability. A header the packet does not have (`tcp
dport` of a UDP packet) matches nothing, as the implicit protocol
dependency nft adds. A field the trace was not told (the source port, the
input interface) raises `NeedsInput` instead of guessing. `dnat_element`
answers the other way round for the live trace: which element of a `dnat
... map` sent a packet where it was seen going (given the packet the rule
saw, for a key with its destination).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from fractions import Fraction

from nftproxy.core.trace import syntax as sx
from nftproxy.core.trace.flow import Flow
from nftproxy.core.trace.ruleset import Element, Ruleset
from nftproxy.core.trace.values import Address, Flags, Pattern, Value, matches, protocol_number

__all__ = [
    "Dist",
    "LookupOutcome",
    "MatchOutcome",
    "NeedsInput",
    "dnat_element",
    "evaluate",
    "lookup",
    "match",
]

Dist = list[tuple[Value | None, Fraction]]
"""Values with their probabilities; None: the packet has no such header."""

_ONE = Fraction(1)


class NeedsInput(ValueError):
    """The ruleset asks for a packet field the trace was not given."""


def evaluate(expr: sx.Lookup, flow: Flow) -> Dist:
    if isinstance(expr, sx.Concat):
        return _concat([evaluate(p, flow) for p in expr.parts])
    if isinstance(expr, sx.Numgen):
        share = Fraction(1, expr.mod)
        return [(expr.offset + i, share) for i in range(expr.mod)]
    if isinstance(expr, sx.BinOp):
        return [(_binop(expr.op, v, expr.right.value), p) for v, p in evaluate(expr.left, flow)]
    return [(_scalar(expr, flow), _ONE)]


def _concat(parts: list[Dist]) -> Dist:
    out: Dist = []
    for combo in itertools.product(*parts):
        values = tuple(v for v, _ in combo)
        share = _ONE
        for _, p in combo:
            share *= p
        out.append((None if None in values else values, share))
    return out


def _binop(op: str, value: Value | None, operand: int) -> Value | None:
    if not isinstance(value, int):
        return None
    if op == "&":
        return value & operand
    if op == "|":
        return value | operand
    return value ^ operand


def _scalar(expr: sx.Expr, flow: Flow) -> Value | None:
    if isinstance(expr, sx.Payload):
        return _payload(expr, flow)
    if isinstance(expr, sx.Key) and expr.source == "ct":
        return frozenset({flow.ct_state}) if expr.key == "state" else flow.ct_status
    if isinstance(expr, sx.Key):
        return _meta(expr.key, flow)
    if isinstance(expr, sx.Fib):
        return flow.host.fib_type(flow.saddr if expr.field == "saddr" else flow.daddr)
    if isinstance(expr, sx.Const):
        return expr.value
    raise sx.Unsupported(f"unsupported expression {expr}")


def _payload(expr: sx.Payload, flow: Flow) -> Value | None:
    if expr.protocol in ("ip", "ip6"):
        if flow.saddr.version != (4 if expr.protocol == "ip" else 6):
            return None
        return flow.saddr if expr.field == "saddr" else flow.daddr
    if expr.protocol != "th" and protocol_number(expr.protocol) != flow.proto:
        return None
    if expr.field == "dport":
        return flow.dport
    if flow.sport is None:
        raise NeedsInput(f"the ruleset matches the source port ({expr}): give it (--sport)")
    return flow.sport


def _meta(key: str, flow: Flow) -> Value | None:
    if key == "l4proto":
        return flow.proto
    if key == "mark":
        return flow.mark
    if flow.iifname is None:
        raise NeedsInput("the ruleset matches the input interface (meta iifname): give it (--iif)")
    return flow.iifname


# --- matches and lookups ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MatchOutcome:
    """Values of the left side that make the match `holds`, with their
    total probability; `element` is the named-set element that matched, for
    the key `key`."""

    holds: bool
    share: Fraction
    element: Element | None = None
    key: Value | None = None


@dataclass(frozen=True, slots=True)
class LookupOutcome:
    """A map lookup: the element found (None: no element for the key), and
    for a vmap its verdict."""

    element: Element | None
    verdict: sx.Verdict | None
    key: Value | None
    share: Fraction


def match(statement: sx.Match, flow: Flow, ruleset: Ruleset) -> list[MatchOutcome]:
    kinds = sx.kinds_of(statement.left)
    candidates: list[tuple[Pattern, Element | None]]
    if isinstance(statement.right, sx.SetRef):
        candidates = [(e.pattern, e) for e in ruleset.elements(statement.right.name, kinds)]
    else:
        candidates = [(p, None) for p in statement.right]
    grouped: dict[tuple[bool, Element | None], Fraction] = {}
    keys: dict[Element, Value] = {}
    for value, share in evaluate(statement.left, flow):
        found = _found(statement.op, candidates, value)
        holds = False if value is None else (found is not None) != (statement.op == "!=")
        element = found[1] if found is not None and holds else None
        if element is not None and value is not None:
            keys.setdefault(element, value)
        grouped[(holds, element)] = grouped.get((holds, element), Fraction(0)) + share
    return [MatchOutcome(h, s, e, keys.get(e) if e else None) for (h, e), s in grouped.items()]


def _found(
    op: str, candidates: list[tuple[Pattern, Element | None]], value: Value | None
) -> tuple[Pattern, Element | None] | None:
    if value is None:
        return None
    for pattern, element in candidates:
        exact_flags = op == "==" and isinstance(pattern, Flags)
        if (pattern.names == value) if exact_flags else matches(pattern, value):  # type: ignore[union-attr]
            return pattern, element
    return None


def lookup(statement: sx.Vmap | sx.DnatMap, flow: Flow, ruleset: Ruleset) -> list[LookupOutcome]:
    """Per value of the key, the element it finds (a vmap's verdict; a
    `dnat ... map` element's target)."""
    entries: list[tuple[Pattern, sx.Verdict | None, Element | None]]
    if isinstance(statement, sx.DnatMap):
        entries = [
            (e.pattern, None, e)
            for e in ruleset.elements(statement.map, sx.kinds_of(statement.key), targets=True)
        ]
    elif isinstance(statement.data, sx.SetRef):
        entries = [
            (e.pattern, e.verdict, e)
            for e in ruleset.elements(statement.data.name, sx.kinds_of(statement.key))
        ]
    else:
        entries = [(p, v, None) for p, v in statement.data]
    out: list[LookupOutcome] = []
    for value, share in evaluate(statement.key, flow):
        hit = (
            None
            if value is None
            else next(((v, e) for p, v, e in entries if matches(p, value)), None)
        )
        verdict, element = hit if hit is not None else (None, None)
        out.append(LookupOutcome(element, verdict, value, share))
    return out


def dnat_element(
    statement: sx.DnatMap, ruleset: Ruleset, addr: Address, port: int, before: Flow | None = None
) -> tuple[Value, Element] | None:
    """The key and element of `statement`'s map that DNAT to `addr`:`port`
    (None if none can): the key's numgens range over their values; its
    other parts (the destination, in a shared chooser's `ip daddr . tcp
    dport . numgen random mod N`) are `before`'s, the packet the rule saw
    (None: a key of numgens only)."""
    parts = statement.key.parts if isinstance(statement.key, sx.Concat) else (statement.key,)
    choices: list[list[Value | None]] = []
    for part in parts:
        if isinstance(part, sx.Numgen):
            choices.append(list(range(part.offset, part.offset + part.mod)))
        elif before is None:
            return None
        else:
            choices.append([v for v, _ in evaluate(part, before)])
    kinds = sx.kinds_of(statement.key)
    found = [
        e
        for e in ruleset.elements(statement.map, kinds, targets=True)
        if e.target is not None and e.target[0] == addr and e.target[1] in (None, port)
    ]
    for combo in itertools.product(*choices):
        known = [v for v in combo if v is not None]
        if len(known) < len(combo):
            continue
        value = tuple(known) if isinstance(statement.key, sx.Concat) else known[0]
        hit = next((e for e in found if matches(e.pattern, value)), None)
        if hit is not None:
            return value, hit
    return None
