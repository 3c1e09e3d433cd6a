"""Chains walked rule by rule: the interpreter proper.

Layer: core/trace (pure). One job: run one chain on one branch of the
packet with nftables' semantics -- statements left to right, a failed match
ends the rule, verdicts end it (`jump` returns to the next rule, `goto` does
not, `return` and the end of a chain go back to the last jump, `accept`
ends the base chain, `drop` and `reject` end the packet), `dnat` and
`masquerade` end their NAT chain with accept (`dnat ... map` with the
element the key finds), a map lookup that finds no element ends the
rule -- forking the branch wherever `numgen` makes the
outcome random, each fork carrying its probability. Every rule that acts is
recorded as a `Step` (in nft syntax, with its comment) and what matters for
the explanation as events on the `Flow`.
"""

from __future__ import annotations

import ipaddress
from collections import deque
from enum import Enum
from fractions import Fraction

from nftproxy.core.trace import syntax as sx
from nftproxy.core.trace.evaluate import MatchOutcome, evaluate, lookup, match
from nftproxy.core.trace.flow import Affinity, Dnat, ElementHit, Flow, MarkSet, Where
from nftproxy.core.trace.ruleset import Element, Rule, Ruleset
from nftproxy.core.trace.values import value_text

__all__ = ["MAX_DEPTH", "Outcome", "Signal", "run_chain"]

MAX_DEPTH = 16
"""The kernel's jump stack (NFT_JUMP_STACK_SIZE)."""

_ONE = Fraction(1)


class Signal(Enum):
    NEXT = "next rule"
    RETURN = "return"
    ACCEPT = "accept"
    DROP = "drop"


Outcome = tuple[Flow, Signal]


def run_chain(
    rs: Ruleset, name: str, flow: Flow, *, depth: int = 0, via: Where | None = None
) -> list[Outcome]:
    """Every way `name` can end for `flow` (RETURN: fell off its end or
    returned), in rule order. `via` is the rule that jumped here."""
    if depth > MAX_DEPTH:
        raise sx.Unsupported(f"jumps nested deeper than {MAX_DEPTH} at chain {name}")
    chain = rs.chain(name)
    out: list[Outcome] = []
    todo: deque[tuple[Flow, int]] = deque([(flow, 0)])
    while todo:
        current, index = todo.popleft()
        if index == len(chain.rules):
            out.append((current, Signal.RETURN))
            continue
        for nxt, signal in _Rule(rs, chain.rules[index], depth, via).run(current):
            if signal is Signal.NEXT:
                todo.append((nxt, index + 1))
            else:
                out.append((nxt, signal))
    return out


class _Rule:
    """One rule's statements run on one branch (forks multiply)."""

    def __init__(self, rs: Ruleset, rule: Rule, depth: int, via: Where | None) -> None:
        self.rs, self.rule, self.depth, self.via = rs, rule, depth, via
        self.where = Where(rule.chain, rule.index)

    def run(self, flow: Flow) -> list[Outcome]:
        return self._from(0, flow, _ONE)

    def _from(self, k: int, flow: Flow, share: Fraction, shown: bool = False) -> list[Outcome]:
        """Statements k.. of the rule; `share` is this branch's probability
        within the rule so far, shown with the rule once it acts."""
        if k == len(self.rule.statements):
            if self.rule.error is not None:
                raise sx.Unsupported(self.rule.error)
            return [(flow, Signal.NEXT)]
        statement = self.rule.statements[k]
        if isinstance(statement, sx.Match):
            return self._match(k, statement, flow, share, shown)
        if isinstance(statement, sx.Counter):
            return self._from(k + 1, flow, share, shown)
        if isinstance(statement, sx.Reject) and statement.type == "tcp reset" and flow.proto != 6:
            # `meta l4proto tcp` is implied (listings leave the dependency out)
            return [(flow, Signal.NEXT)]
        if not shown:
            flow = self._shown(flow, share)
        if isinstance(statement, sx.Vmap):
            return self._vmap(statement, flow)
        if isinstance(statement, sx.DnatMap):
            return self._dnat_map(statement, flow)
        if isinstance(statement, sx.Verdict):
            return self._verdict(statement, flow)
        if isinstance(statement, sx.Mangle):
            return self._mangle(k, statement, flow, share)
        return self._action(k, statement, flow, share)

    def _shown(self, flow: Flow, share: Fraction) -> Flow:
        """The rule as a step, with the branch's share when it forked."""
        return flow.step(self.rule.chain, self.rule.index, self.rule.text(), self.rule.comment,
                         share if share != 1 else None)

    def _match(
        self, k: int, statement: sx.Match, flow: Flow, share: Fraction, shown: bool
    ) -> list[Outcome]:
        out: list[Outcome] = []
        for o in match(statement, flow, self.rs):
            branch = flow.scaled(o.share)
            if not o.holds:
                if shown:  # the rule is on the screen: say why it stops here
                    branch = branch.step(self.rule.chain, self.rule.index, f"no match: {statement}")
                out.append((branch, Signal.NEXT))
                continue
            seen = shown
            if o.element is not None and isinstance(statement.right, sx.SetRef):
                branch = self._pinned(statement.right.name, o.element, branch)
                if o.element.comment:
                    branch, seen = self._named(statement, o, branch, share * o.share, shown), True
            out += self._from(k + 1, branch, share * o.share, seen)
        return out

    def _named(
        self, statement: sx.Match, o: MatchOutcome, flow: Flow, share: Fraction, shown: bool
    ) -> Flow:
        """A set element with a comment matched (`firewall-vips`: the
        KUBE-FW-<h> of the port): shown after the rule, kept for explain."""
        assert isinstance(statement.right, sx.SetRef) and o.element is not None
        name = statement.right.name
        key = "?" if o.key is None else value_text(o.key, sx.kinds_of(statement.left))
        if not shown:
            flow = self._shown(flow, share)
        hit = ElementHit(name, key, "", o.element.comment, self.where)
        return flow.with_(elements=(*flow.elements, hit)).step(
            self.rule.chain, self.rule.index, f"@{name}: {key}", o.element.comment
        )

    def _timeout(self, set_name: str, own: int | None) -> int | None:
        """An affinity entry's timeout: its own (the shared set's
        per-element timeout), else its set's."""
        return own if own is not None else self.rs.set_info(set_name).timeout

    def _pinned(self, name: str, element: Element, flow: Flow) -> Flow:
        """An element of an expiring set matched: the client is pinned (its
        timeout the element's own, else the set's)."""
        timeout = self._timeout(name, element.timeout)
        if timeout is None and element.expires is None:
            return flow
        note = Affinity(name, pinned=True, timeout=timeout, expires=element.expires)
        return flow.with_(affinity=(*flow.affinity, note))

    def _vmap(self, statement: sx.Vmap, flow: Flow) -> list[Outcome]:
        out: list[Outcome] = []
        name = str(statement.data) if isinstance(statement.data, sx.SetRef) else "vmap"
        kinds = sx.kinds_of(statement.key)
        for o in lookup(statement, flow, self.rs):
            branch = flow.scaled(o.share)
            key = "(no such header)" if o.key is None else value_text(o.key, kinds)
            if o.verdict is None:
                branch = branch.step(self.rule.chain, self.rule.index, f"{name}: no element {key}")
                out.append((branch, Signal.NEXT))
                continue
            comment = o.element.comment if o.element else None
            hit = ElementHit(name.lstrip("@"), key, str(o.verdict), comment, self.where)
            branch = branch.with_(elements=(*branch.elements, hit)).step(
                self.rule.chain,
                self.rule.index,
                f"{name}: {key} : {o.verdict}",
                comment,
                o.share if o.share != 1 else None,
            )
            out += self._verdict(o.verdict, branch)
        return out

    def _dnat_map(self, statement: sx.DnatMap, flow: Flow) -> list[Outcome]:
        """`dnat to KEY map @m`: per value of the key, DNAT to the element's
        address . port (named by its comment: the endpoint's KUBE-SEP-<h>),
        or no element: the rule does not match."""
        out: list[Outcome] = []
        name, kinds = f"@{statement.map}", sx.kinds_of(statement.key)
        for o in lookup(statement, flow, self.rs):
            branch = flow.scaled(o.share)
            key = "(no such header)" if o.key is None else value_text(o.key, kinds)
            share = o.share if o.share != 1 else None
            if o.element is None or o.element.target is None:
                branch = branch.step(
                    self.rule.chain, self.rule.index, f"{name}: no element {key}", None, share
                )
                out.append((branch, Signal.NEXT))
                continue
            addr, port = o.element.target
            comment = o.element.comment
            action = str(sx.Dnat(str(addr), port))
            hit = ElementHit(statement.map, key, "", comment, self.where)
            branch = branch.with_(elements=(*branch.elements, hit)).step(
                self.rule.chain, self.rule.index, f"{name}: {key} : {action}", comment, share
            )
            out.append((self._dnat(str(addr), port, comment, branch), Signal.ACCEPT))
        return out

    def _verdict(self, verdict: sx.Verdict, flow: Flow) -> list[Outcome]:
        kind = verdict.kind
        if kind is sx.VerdictKind.ACCEPT:
            return [(flow, Signal.ACCEPT)]
        if kind is sx.VerdictKind.DROP:
            return [(flow.ended("drop", self.where, self.via), Signal.DROP)]
        if kind is sx.VerdictKind.RETURN:
            return [(flow, Signal.RETURN)]
        if kind is sx.VerdictKind.CONTINUE:
            return [(flow, Signal.NEXT)]
        depth = self.depth + 1 if kind is sx.VerdictKind.JUMP else self.depth
        ends = run_chain(self.rs, verdict.target, flow, depth=depth, via=self.where)
        if kind is sx.VerdictKind.GOTO:
            return ends
        return [(f, Signal.NEXT if s is Signal.RETURN else s) for f, s in ends]

    def _mangle(self, k: int, statement: sx.Mangle, flow: Flow, share: Fraction) -> list[Outcome]:
        out: list[Outcome] = []
        for value, p in evaluate(statement.value, flow):
            if not isinstance(value, int):
                raise sx.Unsupported(f"{self.where}: mark value {value!r}")
            branch = flow.scaled(p)
            bits = value & ~flow.mark
            if bits:
                branch = branch.with_(marks=(*branch.marks, MarkSet(self.where, self.via, bits)))
            out += self._from(k + 1, branch.with_(mark=value), share * p, shown=True)
        return out

    def _action(
        self, k: int, statement: sx.Statement, flow: Flow, share: Fraction
    ) -> list[Outcome]:
        if isinstance(statement, sx.SetUpdate):
            timeout = self._timeout(statement.set, statement.timeout)
            if not any(a.set == statement.set for a in flow.affinity):
                note = Affinity(statement.set, pinned=False, timeout=timeout)
                flow = flow.with_(affinity=(*flow.affinity, note))
            return self._from(k + 1, flow, share, shown=True)
        if isinstance(statement, sx.Dnat):
            dnat = self._dnat(statement.addr, statement.port, self.rule.comment, flow)
            return [(dnat, Signal.ACCEPT)]
        if isinstance(statement, sx.Masquerade):
            status = flow.ct_status | {"snat"}
            return [(flow.with_(masquerade=self.where, ct_status=status), Signal.ACCEPT)]
        if isinstance(statement, sx.Reject):
            ended = flow.ended("reject", self.where, self.via, _reject_text(statement))
            return [(ended, Signal.DROP)]
        raise sx.Unsupported(f"unsupported statement {statement} at {self.where}")

    def _dnat(self, to: str, port: int | None, comment: str | None, flow: Flow) -> Flow:
        """DNAT to `to` (and `port`; None keeps it), the endpoint named by `comment`."""
        addr = ipaddress.ip_address(to)
        if addr.version != flow.daddr.version:
            raise sx.Unsupported(f"{self.where}: dnat to {addr} in an IPv{flow.daddr.version} flow")
        note = Dnat(str(addr), port, self.where, comment)
        dport = port if port is not None else flow.dport
        return flow.with_(daddr=addr, dport=dport, ct_status=flow.ct_status | {"dnat"}, dnat=note)


def _reject_text(statement: sx.Reject) -> str:
    if statement.type == "tcp reset":
        return "TCP reset"
    if statement.code:
        return f"{statement.type.upper()} {statement.code}"
    return "ICMP port unreachable (default)"
