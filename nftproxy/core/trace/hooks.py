"""The packet's journey through netfilter's hooks, and routing between them.

Layer: core/trace (pure). One job: run the table's base chains hook after
hook, in priority order, for the first packet of a new connection:
  from a pod or an external client: prerouting, then -- by the destination
  after DNAT -- input (the node's own address) or forward + postrouting;
  from the node: output, postrouting, and, for a destination on the node,
  the loopback way back in (prerouting and input; NAT is not run again).
NAT chains run once per direction, as conntrack does ("dst" NAT on
prerouting/output, "src" NAT on postrouting/input): the nat chains of one
hook run in priority order until one of them NATs (the main table's, then
the affinity table's). A base chain that ends without a verdict applies
its policy; `accept` ends only that chain.
"""

from __future__ import annotations

from nftproxy.core.address import format_address
from nftproxy.core.trace.flow import Flow, Where
from nftproxy.core.trace.packet import Host, Origin, Packet
from nftproxy.core.trace.ruleset import Ruleset
from nftproxy.core.trace.walk import Signal, run_chain

__all__ = ["journey"]

_DST_NAT_HOOKS = ("prerouting", "output")


def journey(rs: Ruleset, packet: Packet, host: Host) -> list[Flow]:
    """Every branch of the packet's way through `rs`, each ended: verdict
    "accept" (with where it went), "drop" or "reject"."""
    start = Flow.start(packet, host)
    if packet.origin is Origin.NODE:
        moving, done = _hooks(rs, ["output", "postrouting"], [start])
        looped = [f for f in moving if host.is_local(f.daddr)]
        out = [_arrived(f, "sent out of the node") for f in moving if not host.is_local(f.daddr)]
        moving, more = _hooks(rs, ["prerouting", "input"], [_routed(f, "loopback") for f in looped])
        out += [_arrived(f, "delivered to the node (loopback)") for f in moving]
        return done + more + out
    moving, done = _hooks(rs, ["prerouting"], [start])
    local = [_routed(f, "input") for f in moving if host.is_local(f.daddr)]
    forward = [_routed(f, "forward") for f in moving if not host.is_local(f.daddr)]
    inbound, more = _hooks(rs, ["input"], local)
    outbound, rest = _hooks(rs, ["forward", "postrouting"], forward)
    arrived = [_arrived(f, "delivered to the node") for f in inbound]
    arrived += [_arrived(f, "forwarded") for f in outbound]
    return done + more + rest + arrived


def _routed(flow: Flow, way: str) -> Flow:
    where = format_address(str(flow.daddr), flow.dport)
    text = {"input": f"{where} is this node's: input",
            "forward": f"{where} is not this node's: forward",
            "loopback": f"{where} is this node's: back in through loopback"}[way]
    return flow.with_(hook="routing").step("", 0, text)


def _arrived(flow: Flow, how: str) -> Flow:
    return flow.with_(verdict="accept", delivery=how)


def _hooks(rs: Ruleset, hooks: list[str], flows: list[Flow]) -> tuple[list[Flow], list[Flow]]:
    """(still moving, ended) after `hooks` in order."""
    ended: list[Flow] = []
    for hook in hooks:
        flows, stopped = _hook(rs, hook, flows)
        ended += stopped
    return flows, ended


def _hook(rs: Ruleset, hook: str, flows: list[Flow]) -> tuple[list[Flow], list[Flow]]:
    manip = "dst" if hook in _DST_NAT_HOOKS else "src"
    ended: list[Flow] = []
    nat_here = False
    for chain in rs.base_chains(hook):
        assert chain.base is not None
        if chain.base.type == "nat":
            nat_here = True
        moving: list[Flow] = []
        for flow in flows:
            if chain.base.type == "nat" and manip in flow.nat_done:
                moving.append(flow)
                continue
            entered = flow.with_(hook=hook).step(
                chain.name, 0, f"{chain.base.type} {hook} priority {chain.base.prio}"
            )
            for end, signal in run_chain(rs, chain.name, entered):
                if signal is Signal.DROP:
                    ended.append(end)
                elif signal is Signal.RETURN and chain.base.policy == "drop":
                    where = Where(chain.name)
                    ended.append(end.step(chain.name, 0, "policy drop").ended("drop", where))
                elif chain.base.type == "nat" and manip == "dst" and end.dnat is not None:
                    # a later nat chain of this hook no longer runs for it
                    moving.append(end.with_(nat_done=end.nat_done | {manip}))
                else:
                    moving.append(end)
        flows = moving
    if nat_here:
        flows = [f.with_(nat_done=f.nat_done | {manip}) for f in flows]
    return flows, ended
