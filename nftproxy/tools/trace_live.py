"""`nftproxy trace --live`: the kernel's own trace of real packets, in trace's words.

Layer: tools (below cli; talks to nftables through the Backend seam and runs
`nft -a monitor trace` as a subprocess). One job: for the next N packets (or
T seconds) of one 5-tuple, print what the kernel did with them, rule by
rule, as `nftproxy trace` prints a prediction -- hook, chain, rule number,
the rule in nft syntax, the element of a named verdict map that sent it on
(its comment names the service port, and for a shared chooser the
KUBE-SVC/SVL/EXT-<h> it stands for) and the endpoints map element that DNATed
it (its KUBE-SEP-<h>) -- and per packet the outcome (accepted, DNAT target,
masqueraded; or dropped / rejected).

How: two temporary base chains in nftproxy's table, `trace-<pid>-prerouting`
and `trace-<pid>-output` (filter, priority -350: before conntrack and every
nftproxy chain), each with one rule matching the 5-tuple that sets `meta
nftrace`. The kernel then reports every rule the packet meets (in every
table) on NFNLGRP_NFTRACE, which `nft -a monitor trace` prints with rule
handles; handles are mapped back to nftproxy's rules through a listing of
the table. The chains are removed on every way out: the count or the time
reached, an error, Ctrl-C (SIGINT) and SIGTERM (signals are ignored while
removing). If the agent runs a full sync meanwhile it deletes the chains as
unknown (the trace then just sees no more packets); a SIGKILLed tracer
leaves them until that next full sync.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from ipaddress import ip_address
from types import FrameType
from typing import Any, TextIO

from nftproxy.core.address import format_address
from nftproxy.core.convert.names import printable
from nftproxy.core.nft.commands import AddChain, AddRule, Command, DeleteChain, FlushChain, Where
from nftproxy.core.nft.errors import NftError, NftNotFound
from nftproxy.core.nft.seam import Backend
from nftproxy.core.rules import fragment, names
from nftproxy.core.rules.fragment import BaseHook, affinity_table_name
from nftproxy.core.trace import Host, NeedsInput, Packet, Ruleset, Unsupported
from nftproxy.core.trace import syntax as sx
from nftproxy.core.trace.evaluate import dnat_element, lookup, match
from nftproxy.core.trace.flow import Flow, Step
from nftproxy.core.trace.identity import ENDPOINT, identity
from nftproxy.core.trace.ruleset import Rule
from nftproxy.core.trace.values import value_text

__all__ = ["Event", "LiveTrace", "parse_event", "trace_chains"]

_UNREADABLE = (Unsupported, NeedsInput, ValueError)
"""What reading an element back from a packet line may raise: then it is
left out of the output."""

PRIORITY = -350
_EVENT = re.compile(
    r"^trace id (?P<id>[0-9a-f]+) (?P<family>\S+) (?P<table>\S+) (?P<chain>\S+) "
    r"(?P<kind>packet|rule|policy|verdict|unknown):? ?(?P<rest>.*?)\s*$"
)
_RULE = re.compile(r"^(?P<text>.*?)(?: # handle (?P<handle>\d+))? \(verdict (?P<verdict>[^)]*)\)$")
_DADDR = re.compile(r"\bip6? daddr (?P<addr>\S+)")
_DPORT = re.compile(r"\b(?:tcp|udp|sctp) dport (?P<port>\d+)")


class LiveError(Exception):
    """--live cannot run (no nft binary, no table); one line."""


@dataclass(frozen=True)
class Event:
    """One line of `nft -a monitor trace`."""

    id: str
    family: str
    table: str
    chain: str
    kind: str
    """"packet", "rule", "policy", "verdict"."""
    text: str = ""
    handle: int | None = None
    verdict: str = ""


def parse_event(line: str) -> Event | None:
    """One `nft monitor trace` line as an Event (None: not a trace line);
    its names and text with control characters escaped, as they go to a
    terminal (another tool's rule comment may hold any byte)."""
    m = _EVENT.match(line)
    if m is None:
        return None
    d = m.groupdict()
    rest, handle, verdict = d["rest"], None, ""
    if d["kind"] == "rule":
        r = _RULE.match(rest)
        if r is not None:
            rest, verdict = r["text"], r["verdict"]
            handle = int(r["handle"]) if r["handle"] else None
    elif d["kind"] in ("policy", "verdict"):
        verdict = rest.split()[0] if rest else ""
    table, chain, rest = printable(d["table"]), printable(d["chain"]), printable(rest)
    return Event(d["id"], d["family"], table, chain, d["kind"], rest, handle, verdict)


def trace_chains(packet: Packet, table: str, pid: int) -> list[Command]:
    """The commands adding the two tracing base chains for `packet`'s 5-tuple."""
    family = packet.family.nft_family

    def match(left: Any, right: Any) -> dict[str, Any]:
        return {"match": {"op": "==", "left": left, "right": right}}

    exprs = [
        match({"payload": {"protocol": family, "field": "saddr"}}, packet.src),
        match({"payload": {"protocol": family, "field": "daddr"}}, packet.dst),
        match({"meta": {"key": "l4proto"}}, packet.proto),
        match({"payload": {"protocol": "th", "field": "dport"}}, packet.dport),
    ]
    if packet.sport is not None:
        exprs.append(match({"payload": {"protocol": "th", "field": "sport"}}, packet.sport))
    exprs.append({"mangle": {"key": {"meta": {"key": "nftrace"}}, "value": 1}})
    where = Where(family, table)
    rule = fragment.Rule(tuple(exprs), comment=f"nftproxy trace --live (pid {pid})")
    out: list[Command] = []
    for hook in ("prerouting", "output"):
        name = f"trace-{pid}-{hook}"
        out += [
            AddChain(where, name, BaseHook("filter", hook, PRIORITY, "accept")),
            AddRule(where, name, rule),
        ]
    return out


@dataclass
class _Packet:
    """What one traced packet met so far."""

    number: int
    hook: str = ""
    dnat: str = ""
    masquerade: bool = False
    end: str = ""
    headers: str = ""
    """The packet as the running base chain saw it (its `packet:` line)."""
    chooser: tuple[Rule, sx.DnatMap, str] | None = None
    """A `dnat ... map` that accepted, with the headers it saw: its element
    is known from the packet's next headers (the next base chain's
    `packet:` line)."""


@dataclass
class LiveTrace:
    """One --live run: add the chains, follow the events, remove the chains."""

    backend: Backend
    table: str
    packet: Packet
    out: TextIO
    count: int = 10
    seconds: float = 30.0
    pid: int = field(default_factory=os.getpid)
    _rs: dict[str, Ruleset] = field(default_factory=dict)
    """The listed rules of each of our tables the packet met, by table name."""
    _seen: dict[str, _Packet] = field(default_factory=dict)

    @property
    def family(self) -> str:
        return self.packet.family.nft_family

    @property
    def chains(self) -> list[str]:
        return [f"trace-{self.pid}-{hook}" for hook in ("prerouting", "output")]

    def run(self) -> int:
        """Trace until `count` packets or `seconds`; SIGTERM/SIGINT stop it.
        The chains are gone when this returns (or raises)."""
        nft = shutil.which("nft")
        if nft is None:
            raise LiveError("--live needs the nft command (nftables) on PATH")
        if self.backend.list_table(self.family, self.table) is None:
            raise LiveError(
                f"no table {self.family} {self.table}: nftproxy has not programmed this node"
            )
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        monitor = subprocess.Popen(
            [nft, "-a", "monitor", "trace"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            lines = _reader(monitor)
            time.sleep(0.2)  # let nft subscribe before packets are marked
            self.backend.commit(trace_chains(self.packet, self.table, self.pid))
            self._say_start()
            self._follow(lines)
        except KeyboardInterrupt:
            self.out.write("interrupted\n")
        finally:
            self._cleanup(monitor, previous)
        return 0

    def _say_start(self) -> None:
        self.out.write(
            f"tracing {self.packet.text().rsplit(' from ', 1)[0]} in table "
            f"{self.family} {self.table} (chains {', '.join(self.chains)}); up to "
            f"{self.count} packets or {self.seconds:g} s; Ctrl-C stops\n"
        )
        self.out.flush()

    def _follow(self, lines: queue.Queue[str | None]) -> None:
        deadline = time.monotonic() + self.seconds
        quiet_until: float | None = None
        while True:
            now = time.monotonic()
            stop_at = min(deadline, quiet_until) if quiet_until is not None else deadline
            if now >= stop_at:
                break
            try:
                line = lines.get(timeout=min(0.1, stop_at - now))
            except queue.Empty:
                continue
            if line is None:
                raise LiveError("nft monitor trace ended unexpectedly")
            self._event(line)
            if len(self._seen) >= self.count and quiet_until is None:
                quiet_until = time.monotonic() + 0.5  # the last packet's remaining events
        self._finish_last()
        self.out.write(f"{len(self._seen)} packet(s) traced\n")

    def _event(self, line: str) -> None:
        event = parse_event(line)
        if event is None:
            return
        mine = event.table == self.table and event.chain in self.chains
        if event.id not in self._seen:
            if not mine or len(self._seen) >= self.count:
                return  # marked by someone else, or beyond the count
            self._finish_last()
            self._seen[event.id] = _Packet(len(self._seen) + 1)
            self.out.write(f"packet {len(self._seen)} (trace id {event.id}):\n")
        if mine:
            return
        self._show(self._seen[event.id], event)
        self.out.flush()

    def _ours(self, event: Event) -> bool:
        """An event of our main table or of its affinity table."""
        mine = (self.table, names.affinity_table(self.table))
        return event.family == self.family and event.table in mine

    def _chain_label(self, event: Event) -> str:
        """The chain as `nftproxy trace` names it: the affinity table's
        objects that the main table has too as "affinity:<name>"."""
        if not self._ours(event):
            return f"{event.family} {event.table} {event.chain}"
        if event.table != self.table and event.chain in self._ruleset(self.table).chains:
            return affinity_table_name(event.chain)
        return event.chain

    def _show(self, pk: _Packet, event: Event) -> None:
        ours = self._ours(event)
        if event.kind == "packet" and pk.chooser is not None:
            self._chosen(pk, event.text)
        rs = self._ruleset(event.table) if ours else None
        base = rs.chains.get(event.chain) if rs is not None else None
        if base is not None and base.base is not None:
            pk.hook = base.base.hook
        if event.kind == "packet":
            pk.headers = event.text
            self.out.write(f"    {pk.hook:<11} {event.chain:<34} packet: {event.text}\n")
            return
        rule = self._rule(event) if ours else None
        chain = self._chain_label(event)
        text = rule.text() if rule is not None else event.text
        verdict = f"  => {event.verdict}" if event.verdict and event.kind == "rule" else ""
        if event.kind in ("policy", "verdict"):
            text = f"{event.kind} {event.text}"
        self.out.write(Step(pk.hook, chain, rule.index if rule else 0, text + verdict).line())
        self.out.write("\n")
        if rule is not None and rs is not None:
            self._element(pk, rule, event.verdict, self._ruleset(event.table))
            _record(pk, rule, event.verdict)
        if event.verdict == "drop":
            where = f"{chain} #{rule.index}" if rule else f"{chain} ({event.kind})"
            pk.end = pk.end or f"dropped by {where}"

    def _element(self, pk: _Packet, rule: Rule, verdict: str, rs: Ruleset) -> None:
        """The element of a named verdict map that gave the rule's verdict
        (printed as `nftproxy trace` prints it, with its comment: the
        service port, and the KUBE-SVC/SVL/EXT-<h> of a shared chooser,
        whose `continue` leads to the pick tree), or
        the commented element of a named set the rule matched before it
        jumped (`masquerade-vips`: the KUBE-EXT-<h> whose mark it sets)."""
        if not verdict.startswith(("jump ", "goto ", "continue")):
            return
        for statement in rule.statements:
            if isinstance(statement, sx.Match) and isinstance(statement.right, sx.SetRef):
                self._matched(pk, rule, statement, rs)
                continue
            if not isinstance(statement, sx.Vmap) or not isinstance(statement.data, sx.SetRef):
                continue
            try:
                outcomes = lookup(statement, self._flow(pk.headers), rs)
            except _UNREADABLE:
                continue
            for o in outcomes:
                if o.element is None or o.key is None or str(o.verdict) != verdict:
                    continue
                key = value_text(o.key, sx.kinds_of(statement.key))
                text = f"{statement.data}: {key} : {verdict}"
                step = Step(pk.hook, rule.chain, rule.index, text, o.element.comment or "")
                self.out.write(step.line() + "\n")
                return

    def _matched(self, pk: _Packet, rule: Rule, statement: sx.Match, rs: Ruleset) -> None:
        """The commented element of `statement`'s set the packet matched."""
        assert isinstance(statement.right, sx.SetRef)
        try:
            outcomes = match(statement, self._flow(pk.headers), rs)
        except _UNREADABLE:
            return
        for o in outcomes:
            if o.holds and o.element is not None and o.element.comment and o.key is not None:
                key = value_text(o.key, sx.kinds_of(statement.left))
                text = f"@{statement.right.name}: {key}"
                step = Step(pk.hook, rule.chain, rule.index, text, o.element.comment)
                self.out.write(step.line() + "\n")
                return

    def _flow(self, headers: str) -> Flow:
        """The traced packet as `headers` (a `packet:` line) show it: its
        destination after any DNAT so far."""
        addr, port = _DADDR.search(headers), _DPORT.search(headers)
        packet = self.packet
        if addr is not None and port is not None:
            packet = replace(packet, dst=addr["addr"], dport=int(port["port"]))
        return Flow.start(packet, Host.of(()))

    def _chosen(self, pk: _Packet, headers: str) -> None:
        """The endpoints map element the chooser took, from where the packet
        goes now (printed as `nftproxy trace` prints it)."""
        assert pk.chooser is not None
        (rule, statement, seen), pk.chooser = pk.chooser, None
        addr, port = _DADDR.search(headers), _DPORT.search(headers)
        rs = self._rs.get(self.table)  # the shared choosers' maps are the main table's
        if addr is None or port is None or rs is None:
            return
        try:
            to = ip_address(addr["addr"])
            found = dnat_element(statement, rs, to, int(port["port"]), self._flow(seen))
        except _UNREADABLE:
            return
        if found is None:
            return
        key, element = found
        dnat = format_address(addr["addr"], int(port["port"]))
        text = f"@{statement.map}: {value_text(key)} : dnat to {dnat}  => accept"
        step = Step(pk.hook, rule.chain, rule.index, text, element.comment or "")
        self.out.write(step.line() + "\n")
        pk.dnat = f"{dnat} ({identity(element.comment, ENDPOINT) or rule.chain})"

    def _rule(self, event: Event) -> Rule | None:
        if event.handle is None:
            return None
        rule = self._ruleset(event.table).rule_by_handle(event.chain, event.handle)
        if rule is None:  # re-programmed since: read the table again, once
            self._rs.pop(event.table, None)
            rule = self._ruleset(event.table).rule_by_handle(event.chain, event.handle)
        return rule

    def _ruleset(self, table: str) -> Ruleset:
        """The rules of our `table` (main or affinity: handles are per table)."""
        rs = self._rs.get(table)
        if rs is None:
            doc = self.backend.list_table(self.family, table) or {"nftables": []}
            rs = self._rs[table] = Ruleset.from_listing(doc, self.family, table)
        return rs

    def _finish_last(self) -> None:
        if not self._seen:
            return
        pk = list(self._seen.values())[-1]
        if pk.end:
            outcome = pk.end
        else:
            nat = f"DNAT to {pk.dnat}" if pk.dnat else "not translated"
            outcome = f"accepted, {nat}, {'masqueraded' if pk.masquerade else 'source kept'}"
        self.out.write(f"  packet {pk.number}: {outcome}\n")
        pk.end = pk.end or "reported"

    def _cleanup(self, monitor: subprocess.Popen[str], previous: Any) -> None:
        """Remove the chains (each on its own: one may be gone already) with
        SIGINT/SIGTERM ignored meanwhile, then stop the monitor."""
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            for command in removal(self.family, self.table, self.chains):
                try:
                    self.backend.commit(command)
                except NftNotFound:
                    pass
                except NftError as exc:
                    self.out.write(f"could not remove {command}: {exc}\n")
            self.out.write(f"removed {', '.join(self.chains)}\n")
            self.out.flush()
        finally:
            monitor.terminate()
            try:
                monitor.wait(timeout=5)
            except subprocess.TimeoutExpired:
                monitor.kill()
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, previous)


def _record(pk: _Packet, rule: Rule, verdict: str) -> None:
    """What a rule the packet met did to it: DNAT, masquerade, reject."""
    for statement in rule.statements:
        if isinstance(statement, sx.Dnat) and verdict == "accept":
            name = identity(rule.comment, ENDPOINT) or rule.chain
            pk.dnat = f"{str(statement).removeprefix('dnat to ')} ({name})"
        elif isinstance(statement, sx.DnatMap) and verdict == "accept":
            pk.dnat = f"an element of @{statement.map} ({rule.chain})"
            pk.chooser = (rule, statement, pk.headers)
        elif isinstance(statement, sx.Masquerade) and verdict == "accept":
            pk.masquerade = True
        elif isinstance(statement, sx.Reject):
            pk.end = f"rejected by {rule.chain} #{rule.index}"


def removal(family: str, table: str, chains: Sequence[str]) -> Iterator[list[Command]]:
    """One transaction per chain: flush it and delete it."""
    where = Where(family, table)
    for name in chains:
        yield [FlushChain(where, name), DeleteChain(where, name)]


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _reader(proc: subprocess.Popen[str]) -> queue.Queue[str | None]:
    """The monitor's lines on a queue (None at its end), read by a thread."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=read, name="nft-monitor", daemon=True).start()
    return lines
