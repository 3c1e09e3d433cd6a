"""`nftproxy trace`'s arguments, apart from the command.

Layer: tools. One job: declare the trace subcommand's flags for cli.py's
parser, which every `nftproxy` invocation builds: so that building it does
not import the trace interpreter (core/trace, tools/trace.py), which only
`nftproxy trace` runs, and whose memory the agent has no use for.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ["ORIGINS", "add_parser"]

ORIGINS = ("pod", "node", "external")
"""core/trace/packet.py `Origin`'s values (tests/test_trace_cli.py checks)."""


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    parents: Sequence[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """`nftproxy trace`'s arguments (the caller sets the handler)."""
    p = sub.add_parser(
        "trace",
        parents=list(parents),
        help="where a packet goes through the programmed rules (or a dry run's), and why",
    )
    p.add_argument("src", metavar="SRC", help="source address")
    p.add_argument(
        "dst",
        metavar="DST:PORT[/PROTO]",
        help="destination, e.g. 10.96.0.10:80, [fd00::10]:53/udp (default tcp)",
    )
    p.add_argument(
        "--from",
        dest="origin",
        choices=ORIGINS,
        help="where the packet comes from (default: node for the node's own "
        "addresses, pod inside --cluster-cidr, else external)",
    )
    p.add_argument("--sport", metavar="PORT", type=int, help="source port (if rules match it)")
    p.add_argument(
        "--iif", metavar="IFACE", help="input interface (default: the pod bridge/prefix for pods)"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument(
        "--source",
        metavar="FILE",
        action="append",
        help="trace what a sync from FILE would program (no root, no kernel); repeatable",
    )
    live = p.add_argument_group("--live: the kernel's own trace of real packets (root)")
    live.add_argument(
        "--live",
        action="store_true",
        help="mark the next packets of this 5-tuple with meta nftrace and print "
        "what the kernel did with them (the temporary rule is removed on exit)",
    )
    live.add_argument(
        "--count", metavar="N", type=int, default=10, help="stop after N packets (default 10)"
    )
    live.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=float,
        default=30.0,
        help="stop after SECONDS (default 30)",
    )
    return p
