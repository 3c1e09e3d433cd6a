"""The packet as it moves through the hooks: one branch of a trace.

Layer: core/trace (pure). One job: the state the walk carries and changes
-- header fields after DNAT, the mark, ct state/status, which NAT decisions
are taken, the branch's probability -- and the record of what happened on
the way (`Step`s for the reader, events for the explanation: marks with the
rule that asked for them, map elements matched, DNAT, masquerade, affinity,
the final verdict). Frozen: a numgen fork copies the branch.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, replace
from fractions import Fraction

from nftproxy.core.trace.packet import Host, Packet
from nftproxy.core.trace.values import Address

__all__ = ["Affinity", "Dnat", "ElementHit", "Flow", "MarkSet", "Step", "Where"]


@dataclass(frozen=True, slots=True)
class Where:
    """A rule of a chain (rule 0: the chain itself, e.g. its policy)."""

    chain: str
    rule: int = 0


@dataclass(frozen=True, slots=True)
class Step:
    """One thing the reader sees: a base chain entered, a rule that acted,
    a map element that matched, a policy applied, a routing decision."""

    hook: str
    chain: str
    rule: int
    text: str
    comment: str = ""
    share: Fraction | None = None
    """The probability of this branch at a numgen rule (None: no fork)."""

    def line(self) -> str:
        """As `nftproxy trace` prints it: hook, chain #rule, the rule, the
        branch's share, the comment (unless the rule's text has it)."""
        where = f"{self.chain} #{self.rule}" if self.rule else self.chain
        share = f" [{self.share}]" if self.share is not None else ""
        note = f"  ({self.comment})" if self.comment and self.comment not in self.text else ""
        return f"    {self.hook:<11} {where:<34} {self.text}{share}{note}"


@dataclass(frozen=True, slots=True)
class MarkSet:
    """`meta mark set ...` at `at`, reached from the rule `caller` jumped at."""

    at: Where
    caller: Where | None
    bits: int
    """The bits this statement turned on."""


@dataclass(frozen=True, slots=True)
class ElementHit:
    set: str
    key: str
    verdict: str
    comment: str | None
    at: Where


@dataclass(frozen=True, slots=True)
class Dnat:
    addr: str
    port: int | None
    at: Where
    comment: str | None
    """The rule's comment, or the map element's for `dnat ... map`."""


@dataclass(frozen=True, slots=True)
class Affinity:
    """A ClientIP affinity set on the path: `pinned` when the source is in
    it (the lookup decided), else the update that would pin later ones."""

    set: str
    pinned: bool
    timeout: int | None = None
    expires: int | None = None


@dataclass(frozen=True, slots=True)
class Flow:
    saddr: Address
    daddr: Address
    proto: int
    dport: int
    sport: int | None
    iifname: str | None
    host: Host
    hook: str = ""
    mark: int = 0
    ct_state: str = "new"
    ct_status: frozenset[str] = frozenset()
    nat_done: frozenset[str] = frozenset()
    """"dst" once prerouting/output NAT ran, "src" once postrouting/input did."""
    probability: Fraction = Fraction(1)
    steps: tuple[Step, ...] = ()
    marks: tuple[MarkSet, ...] = ()
    elements: tuple[ElementHit, ...] = ()
    dnat: Dnat | None = None
    masquerade: Where | None = None
    affinity: tuple[Affinity, ...] = ()
    verdict: str = ""
    """"" while moving; then "accept", "drop" or "reject"."""
    verdict_at: Where | None = None
    verdict_via: Where | None = None
    """The rule that jumped (or went) to the chain of `verdict_at`."""
    reject_with: str = ""
    delivery: str = ""

    @classmethod
    def start(cls, packet: Packet, host: Host) -> Flow:
        return cls(
            saddr=ipaddress.ip_address(packet.src),
            daddr=ipaddress.ip_address(packet.dst),
            proto=packet.protocol_number,
            dport=packet.dport,
            sport=packet.sport,
            iifname=packet.iifname,
            host=host,
        )

    def step(
        self,
        chain: str,
        rule: int,
        text: str,
        comment: str | None = None,
        share: Fraction | None = None,
    ) -> Flow:
        new = Step(self.hook, chain, rule, text, comment or "", share)
        return replace(self, steps=(*self.steps, new))

    def scaled(self, share: Fraction) -> Flow:
        return self if share == 1 else replace(self, probability=self.probability * share)

    def ended(
        self, verdict: str, at: Where | None, via: Where | None = None, reject_with: str = ""
    ) -> Flow:
        return replace(
            self, verdict=verdict, verdict_at=at, verdict_via=via, reject_with=reject_with
        )

    def with_(self, **changes: object) -> Flow:
        return replace(self, **changes)  # type: ignore[arg-type]
