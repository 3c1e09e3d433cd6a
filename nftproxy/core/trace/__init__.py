"""`nftproxy trace`'s interpreter: where a packet goes through nftproxy's table, and why.

Layer: core/trace (pure: libnftables JSON in, values out; no kernel). One
job: `trace(ruleset, packet, host)` walks the hooks of one family's table
(ruleset.py reads a listing) for the first packet of a new connection and
returns every path it can take with its probability (trace/result.py).
Modules, bottom up: values (literals and patterns), expressions, syntax
(statements),
ruleset (the table), packet (inputs), flow (one branch's state), evaluate
(expressions, matches, lookups), walk (chains), hooks (the way through
netfilter), identity (kube-proxy's KUBE-SEP / KUBE-FW names, and the
KUBE-SVC / KUBE-SVL / KUBE-EXT a shared chooser stands in for, kept in
comments),
explain (kube-proxy's words), result (output values).
"""

from __future__ import annotations

from nftproxy.core.trace.evaluate import NeedsInput
from nftproxy.core.trace.explain import explain
from nftproxy.core.trace.hooks import journey
from nftproxy.core.trace.packet import Host, Origin, Packet
from nftproxy.core.trace.result import Endpoint, Path, Trace
from nftproxy.core.trace.ruleset import Ruleset
from nftproxy.core.trace.values import Unsupported

__all__ = [
    "Endpoint",
    "Host",
    "NeedsInput",
    "Origin",
    "Packet",
    "Path",
    "Ruleset",
    "Trace",
    "Unsupported",
    "trace",
]


def trace(rs: Ruleset, packet: Packet, host: Host) -> Trace:
    """Every path of `packet` through `rs` (the table of the packet's
    family). Raises Unsupported for a rule on the way the interpreter does
    not understand, NeedsInput (evaluate.py) for a field it was not given."""
    flows = journey(rs, packet, host)
    return Trace(packet, f"{rs.family} {rs.table}", tuple(explain(f, rs) for f in flows))
