"""`nftproxy trace SRC DST:PORT[/PROTO]`: where a packet goes, and why, in text or JSON.

Layer: tools (below cli, its only caller; runs the core's interpreter,
core/trace, on tables it is given). One job: the command's pieces --
read the target ("10.96.0.10:80/tcp", "[fd00:96::10]:53/udp"); build the
`Packet` (`--from pod|node|external`, the input interface a pod's packet
has under the configured local-traffic detector); get the tables, either
from a backend (the live tables, as `nftproxy dump` reads them) or from
manifests (`planned_tables`: the transaction `sync --dry-run` would commit,
applied to an in-memory FakeBackend and listed back: no root, no kernel);
and print the trace: the service port with its KUBE-FW/EXT/SVC/SVL names
(and the shared chooser that stands in for its KUBE-SVC/SVL/EXT), a
summary line per path (probability, endpoint and its KUBE-SEP-<h> --
kube-proxy's names, which nftproxy's ruleset keeps in comments --
masquerade or not and why, or the drop / reject and why), then every hook,
chain and rule on the way -- the part all paths share once, then each
path's own part. `--live` hands over to
tools/trace_live.py (the kernel's own trace of real packets).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from nftproxy.cluster.file import SourceError
from nftproxy.core.address import parse_address
from nftproxy.core.config import DetectLocalMode, ProxyConfig
from nftproxy.core.convert.names import printable
from nftproxy.core.nft.errors import NftError
from nftproxy.core.nft.listing import list_family, live_name
from nftproxy.core.nft.seam import Backend
from nftproxy.core.trace import (
    Host,
    NeedsInput,
    Origin,
    Packet,
    Path,
    Ruleset,
    Trace,
    Unsupported,
    trace,
)
from nftproxy.core.trace.flow import Step
from nftproxy.kernel.addresses import AddressesUnavailable, read_host_addresses
from nftproxy.kernel.fake import FakeBackend
from nftproxy.kernel.libnftables import NftBackend
from nftproxy.tools.dry_run import proxier_from_files
from nftproxy.tools.trace_live import LiveError, LiveTrace

_log = logging.getLogger(__name__)

__all__ = [
    "Tables",
    "command",
    "infer_origin",
    "live_tables",
    "make_packet",
    "parse_target",
    "planned_tables",
    "render_text",
    "run",
]

_PROTOCOLS = ("tcp", "udp", "sctp")
_DONE = {"drop": "dropped", "reject": "rejected"}


@dataclass(frozen=True)
class Tables:
    """Listings of the table per nft family ("ip", "ip6"), and the node's
    own addresses (for `fib ... type local` and routing)."""

    name: str
    listings: Mapping[str, Mapping[str, Any]]
    host: Host
    pod_cidrs: tuple[str, ...] = ()
    """The Node's podCIDRs when known (files): pods for `infer_origin`."""


def parse_target(text: str) -> tuple[str, int, str]:
    """'10.96.0.10:80' -> ('10.96.0.10', 80, 'tcp'); '[fd00::1]:53/udp' ->
    ('fd00::1', 53, 'udp'). ValueError naming the problem otherwise."""
    address, _, proto = text.partition("/")
    proto = (proto or "tcp").lower()
    if proto not in _PROTOCOLS:
        raise ValueError(f"{text!r}: protocol {proto!r} is not one of {', '.join(_PROTOCOLS)}")
    host, port = parse_address(address, min_port=1, require_host=True)
    return host, port, proto


def make_packet(
    src: str,
    target: str,
    origin: Origin,
    config: ProxyConfig,
    *,
    sport: int | None = None,
    iif: str | None = None,
) -> Packet:
    """The packet to trace (ValueError for a bad address, port or
    protocol). Its input interface, unless given: none for the node's own
    packets; for a pod's, the configured pod bridge or interface prefix
    (what the local-traffic detector matches); unknown otherwise."""
    dst, dport, proto = parse_target(target)
    if iif is None:
        iif = _default_iif(origin, config)
    return Packet(src, dst, dport, proto, sport, origin, iif)


def infer_origin(src: str, tables: Tables, config: ProxyConfig) -> Origin:
    """Where `src` is, when --from is not given: one of the node's own
    addresses -> node; inside the cluster CIDRs (or the Node's podCIDRs) ->
    pod; else external."""
    addr = ipaddress.ip_address(src)
    if tables.host.is_local(addr):
        return Origin.NODE
    cidrs = (*config.cluster_cidrs, *tables.pod_cidrs)
    pods = (ipaddress.ip_network(c, strict=False) for c in cidrs)
    return (
        Origin.POD
        if any(addr.version == n.version and addr in n for n in pods)
        else (Origin.EXTERNAL)
    )


def _default_iif(origin: Origin, config: ProxyConfig) -> str | None:
    if origin is Origin.NODE:
        return ""
    if origin is Origin.POD:
        if config.detect_local_mode is DetectLocalMode.BRIDGE_INTERFACE:
            return config.bridge_interface or None
        if config.detect_local_mode is DetectLocalMode.INTERFACE_NAME_PREFIX:
            return config.interface_name_prefix or None
    return None


def kernel_tables(config: ProxyConfig) -> Tables | None:
    """The tables programmed on this host, and its addresses (the Node's
    configured ones when the host's cannot be read). Needs root."""
    try:
        host = read_host_addresses()
        addresses: Sequence[str] = (*host.ipv4, *host.ipv6)
    except AddressesUnavailable:
        addresses = config.node_ips
    with NftBackend() as backend:
        return live_tables(backend, live_name(backend.list_table_objects, config.table_name),
                           addresses)


def live_tables(backend: Backend, name: str, addresses: Sequence[str]) -> Tables | None:
    """The programmed tables (None when neither family has one)."""
    read = backend.list_table
    listings = {f: doc for f in ("ip", "ip6") if (doc := list_family(read, f, name)) is not None}
    return Tables(name, listings, Host.of(addresses)) if listings else None


def planned_tables(paths: Sequence[str], config: ProxyConfig) -> Tables:
    """What a sync from `paths` would program, as listings, without a
    kernel: the dry run's transaction committed to a FakeBackend. The
    node's addresses are the Node object's (SourceError for bad files)."""
    fake = FakeBackend()
    fake.start()
    try:
        planned = proxier_from_files(paths, config, fake, log=_log).plan_full()
        fake.commit(list(planned.commands))
        listings = {
            f: doc
            for f in ("ip", "ip6")
            if (doc := list_family(fake.list_table, f, config.table_name)) is not None
        }
    finally:
        fake.close()
    node = planned.input.node
    return Tables(config.table_name, listings, Host.of((*node.ipv4, *node.ipv6)), node.pod_cidrs)


def run(tables: Tables, packet: Packet) -> Trace:
    """Trace `packet` through its family's table (LookupError if there is
    none; Unsupported / NeedsInput from the interpreter)."""
    family = packet.family.nft_family
    listing = tables.listings.get(family)
    if listing is None:
        raise LookupError(
            f"no table {family} {tables.name}: nothing is programmed for {packet.family.value}"
        )
    return trace(Ruleset.from_listing(listing, family, tables.name), packet, tables.host)


# --- text --------------------------------------------------------------------------------


def render_text(result: Trace) -> str:
    lines = [f"{result.packet.text()}  (table {result.table})"]
    lines += _services(result.paths)
    for path in result.paths:
        lines += _summary(path)
    lines.append("")
    lines += _steps(result.paths)
    return "\n".join(lines)


def _services(paths: Sequence[Path]) -> list[str]:
    """Per service port, kube-proxy's chain names in the order a packet
    meets them (KUBE-FW-<h>: the source-range check, then the chains), and
    the shared chooser that stood in for its KUBE-SVC/SVL/EXT."""
    seen: dict[str, tuple[list[str], list[str]]] = {}
    for p in paths:
        if p.service:
            chains, shared = seen.setdefault(p.service, ([], []))
            named = (p.firewall, *p.chains) if p.firewall else p.chains
            chains += [c for c in named if c not in chains]
            shared += [p.chooser] if p.chooser and p.chooser not in shared else []
    return [
        f"  service {s}: {' -> '.join(c) if c else 'no service chain'}"
        + "".join(f" (shared chooser {d})" for d in shared)
        for s, (c, shared) in seen.items()
    ] or ["  no service matched"]


def _summary(path: Path) -> list[str]:
    share = f"  {float(path.probability):>7.2%}  "
    why = "; ".join(path.reasons)
    if path.verdict != "accept":
        how = f" ({path.reject_with})" if path.reject_with else ""
        return [f"{share}{_DONE[path.verdict]}{how}: {why}"]
    if path.endpoint is None:
        return [f"{share}{path.delivery} ({path.destination}): {why}"]
    nat = "masqueraded" if path.masquerade else "source kept"
    name = path.endpoint.identity or path.endpoint.chain
    out = [f"{share}{path.endpoint.text():<24} {name}  {path.delivery}, {nat}: {why}"]
    if path.affinity:
        out.append(f"           {path.affinity}")
    return out


def _steps(paths: Sequence[Path]) -> list[str]:
    """The steps all paths share, then each path's own; a path whose last
    steps take the same rules as path 1's says so instead of repeating them."""
    if not paths:
        return []
    shared = _common_prefix([p.steps for p in paths])
    lines = ["  steps" + (" (shared by every path)" if len(paths) > 1 else "") + ":"]
    lines += [s.line() for s in paths[0].steps[:shared]]
    if len(paths) == 1:
        return lines
    first = paths[0].steps[shared:]
    for i, path in enumerate(paths, 1):
        target = path.endpoint.text() if path.endpoint else path.verdict
        lines.append(f"  path {i} ({float(path.probability):.2%}, {target}):")
        own = path.steps[shared:]
        same = _same_tail(own, first) if i > 1 else 0
        lines += [s.line() for s in own[: len(own) - same]]
        if same:
            lines.append(f"    ... then the same {same} rules as path 1")
    return lines


def _common_prefix(runs: Sequence[Sequence[Step]]) -> int:
    n = 0
    while all(len(r) > n and r[n] == runs[0][n] for r in runs):
        n += 1
    return n


def _same_tail(a: Sequence[Step], b: Sequence[Step]) -> int:
    """How many last steps of `a` and `b` are the same hook, chain and rule
    with the same comment (one rule's map elements differ by theirs: the
    endpoints map's name each path's KUBE-SEP-<h>)."""
    n = 0
    while n < min(len(a), len(b)) and _where(a[-1 - n]) == _where(b[-1 - n]):
        n += 1
    return n if n > 1 else 0


def _where(step: Step) -> tuple[str, str, int, str]:
    return step.hook, step.chain, step.rule, step.comment


# --- the command -------------------------------------------------------------------------


def command(args: argparse.Namespace, config: ProxyConfig, out: TextIO | None = None) -> int:
    """Run `nftproxy trace`: 0 traced, 1 no table / unreadable files /
    a rule it cannot interpret, 2 bad arguments."""
    try:  # the packet is checked before any file or table is read
        make_packet(args.src, args.dst, Origin.EXTERNAL, config, sport=args.sport)
    except ValueError as exc:
        print(f"nftproxy: trace: {exc}", file=sys.stderr)
        return 2
    if args.live:
        return _live(args, config, out or sys.stdout)
    try:
        tables = planned_tables(args.source, config) if args.source else kernel_tables(config)
        if tables is None:
            raise LookupError(
                f"no table named {config.table_name!r} (ip or ip6): "
                "nftproxy has not programmed this node"
            )
        origin = Origin(args.origin) if args.origin else infer_origin(args.src, tables, config)
        packet = make_packet(args.src, args.dst, origin, config, sport=args.sport, iif=args.iif)
        result = run(tables, packet)
    except (SourceError, NftError, LookupError, Unsupported, NeedsInput) as exc:
        print(f"nftproxy: trace: {exc}", file=sys.stderr)
        return 1
    text = (
        json.dumps(result.to_json(), indent=2)
        if args.json
        else "\n".join(map(printable, render_text(result).split("\n")))  # names from files
    )
    print(text, file=out or sys.stdout)
    return 0


def _live(args: argparse.Namespace, config: ProxyConfig, out: TextIO) -> int:
    if args.source:
        print(
            "nftproxy: trace: --live traces the programmed tables; drop --source", file=sys.stderr
        )
        return 2
    packet = make_packet(args.src, args.dst, Origin.EXTERNAL, config, sport=args.sport)
    try:
        with NftBackend() as backend:
            live = LiveTrace(
                backend,
                live_name(backend.list_table_objects, config.table_name),
                packet,
                out,
                count=max(1, args.count),
                seconds=max(0.1, args.timeout),
            )
            return live.run()
    except (LiveError, NftError, OSError) as exc:
        print(f"nftproxy: trace: {exc}", file=sys.stderr)
        return 1
