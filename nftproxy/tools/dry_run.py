"""`nftproxy sync` from files: the Proxier fed once, and what --dry-run prints.

Layer: tools (below cli, its only caller; reads files through cluster.file,
feeds them through the agent's Intake). One job: turn manifests on disk into
what `sync` needs -- a Proxier fed once from them (`files_input`: the files
are read once; every invalid field is logged once, by the Intake, under the
caller's logger), and for --dry-run (`dry_run`) the model summary (node,
service CIDRs, one row per service port and family, on `summary`) and the
nftables commands of a full sync (on `commands`: nft text as `nft -f` reads
it, or with `as_json` one JSON object a line), touching nothing. Both come
from the one planned sync: the summary shows exactly the model the commands
were rendered from. Names in the summary are escaped (`printable`): a file's
names reach the terminal.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from nftproxy.agent.intake import DUPLICATE_DESTINATION, Intake, InvalidField
from nftproxy.agent.proxier import Proxier
from nftproxy.agent.report import SyncInput
from nftproxy.cluster.file import FileSource
from nftproxy.cluster.recorder import Recorded, Recorder
from nftproxy.core.config import ProxyConfig
from nftproxy.core.convert.names import printable
from nftproxy.core.model import Endpoint, IPFamily, ServicePort
from nftproxy.core.nft import jsontext, nfttext
from nftproxy.core.nft.seam import Backend
from nftproxy.kernel.fake import FakeBackend

__all__ = ["dry_run", "files_input", "proxier_from_files"]

_log = logging.getLogger(__name__)


def proxier_from_files(
    paths: Sequence[str], config: ProxyConfig, backend: Backend, *, log: logging.Logger = _log
) -> Proxier:
    """A Proxier fed once from the files (SourceError if one is missing or
    malformed); invalid fields are logged on `log`."""
    return files_input(paths, config, backend, log=log)[0]


def files_input(
    paths: Sequence[str], config: ProxyConfig, backend: Backend, *, log: logging.Logger
) -> tuple[Proxier, Recorded]:
    """Read the files once into a Recorder, then replay them through the
    Intake into a new Proxier; also what was read. The node name must be
    known before the Intake sees endpoints (is_local): with none given, the
    files' only Node names it (AmbiguousNode if they hold several).
    Invalid fields are logged on `log`: the caller's, who speaks."""
    recorder = Recorder()
    source = FileSource(paths, recorder, node_name=config.node_name)
    source.load()
    if not config.node_name and source.chosen_node_name:
        config = replace(config, node_name=source.chosen_node_name)
    proxier = Proxier(config, backend)

    def warn(invalid: InvalidField) -> None:
        said = "duplicate destination" if invalid.reason == DUPLICATE_DESTINATION else (
            "skipped invalid field")
        log.warning("%s: %s", said, invalid)

    recorder.replay(
        Intake(
            proxier,
            node_name=config.node_name,
            report=warn,
            allow_external_ips=config.allow_service_external_ips,
        )
    )
    return proxier, recorder.snapshot()


def dry_run(
    paths: Sequence[str],
    config: ProxyConfig,
    *,
    summary: Any,
    commands: Any,
    as_json: bool = False,
) -> None:
    """Print the model summary on `summary` and the commands of a full sync
    on `commands` (nft text; `as_json`: one JSON object a line), from one
    reading of the files; touch nothing. Raises SourceError if a file is
    missing or malformed."""
    # Never started: planning must not reach it, and any call would raise.
    proxier, recorded = files_input(paths, config, FakeBackend(), log=_log)
    planned = proxier.plan_full()
    lines = [
        f"dry run: {len(recorded.services)} services, {len(recorded.slices)} "
        f"endpoint slices from {', '.join(map(printable, paths))}; nothing was programmed"
    ]
    lines += _node_lines(planned.input, known=recorded.node is not None)
    lines += _table([_HEADER, *_rows(planned.input)])
    print("\n".join(lines), file=summary)
    printer = jsontext.command_text if as_json else nfttext.command_text
    for command in planned.commands:
        print(printer(command), file=commands)


def _node_lines(planned: SyncInput, *, known: bool) -> list[str]:
    node = planned.node
    if not known:
        name = printable(node.name) or "?"
        lines = [f"node {name}: no Node object (every endpoint counts as remote)"]
    else:
        ips = ", ".join([*node.ipv4, *node.ipv6]) or "no addresses"
        zone = f"; zone {node.zone}" if node.zone else ""
        pods = f"; podCIDRs {', '.join(node.pod_cidrs)}" if node.pod_cidrs else ""
        lines = [printable(f"node {node.name}: {ips}{zone}{pods}")]
    if planned.service_cidrs:
        lines.append(f"service CIDRs: {', '.join(planned.service_cidrs)}")
    return lines


def _rows(planned: SyncInput) -> list[tuple[str, ...]]:
    """One row per service port and family: by service, then family, then port."""
    found = [
        (sp, set(inp.state.endpoints.get(spn, ())))
        for inp in planned.families.values()
        for spn, sp in inp.state.services.items()
    ]
    order = list(IPFamily)
    found.sort(key=lambda r: (r[0].name.service, order.index(r[0].family), r[0].name))
    return [_row(sp, endpoints) for sp, endpoints in found]


_HEADER = ("SERVICE PORT", "FAMILY", "CLUSTER IP", "PORT", "EXTERNAL", "POLICY", "ENDPOINTS")


def _row(sp: ServicePort, endpoints: set[Endpoint]) -> tuple[str, ...]:
    external = []
    if sp.node_port:
        external.append(f"nodePort {sp.node_port}")
    external += [f"externalIP {ip}" for ip in sp.external_ips]
    external += [f"LB {ip}" for ip in sp.load_balancer_vips]
    if sp.load_balancer_source_ranges:
        external.append(f"from {','.join(sp.load_balancer_source_ranges)}")
    policy = []
    if sp.externally_accessible:
        policy.append(f"eTP={sp.external_traffic_policy.value}")
    policy.append(f"iTP={sp.internal_traffic_policy.value}")
    if sp.affinity:
        policy.append(f"affinity=ClientIP/{sp.affinity_timeout}s")
    if sp.health_check_node_port:
        policy.append(f"healthCheck={sp.health_check_node_port}")
    return (
        str(sp.name),
        sp.family.value,
        sp.cluster_ip,
        f"{sp.port}/{sp.protocol.value}",
        " ".join(external) or "-",
        " ".join(policy),
        _endpoint_summary(endpoints),
    )


def _endpoint_summary(endpoints: set[Endpoint]) -> str:
    if not endpoints:
        return "0 (rejects)"
    ready = sum(e.ready for e in endpoints)
    terminating = sum(e.serving and e.terminating and not e.ready for e in endpoints)
    local = sum(e.is_local for e in endpoints)
    detail = [f"{ready} ready"]
    if terminating:
        detail.append(f"{terminating} serving-terminating")
    detail.append(f"{local} local")
    return f"{len(endpoints)} ({', '.join(detail)})"


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        printable("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        for row in rows
    ]
