"""The `nftproxy` command line: run | sync | dump | trace | cleanup | demo.

Layer: cli (top; the one place that builds real edges). One job: parse
flags, load the configuration (flags override the KubeProxyConfiguration
file), set up logging, and hand a ProxyConfig to one `_cmd_<name>(args,
config) -> int` per subcommand. Exit codes: 0 ok, 1 failure (including "needs
root"), 2 usage or configuration error. `run` is the long-running agent;
`sync` programs the table once from files and exits (`--once`, which it used
to require, is still accepted and does nothing). What `sync` reads and
prints lives in tools/dry_run.py; the flag groups each subcommand combines
(so its --help lists only what it reads) live in tools/cli_flags.py.

Node name: --node-name, else the file's hostnameOverride, else $NODE_NAME.
Commands that talk to the API server fall back to the hostname; file sources
instead use the single Node object in the files when no name was given.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

from nftproxy import __version__
from nftproxy.agent.agent import (
    Agent,
    ConntrackEdge,
    Source,
    SourceFactory,
    SyncFailureCallback,
)
from nftproxy.agent.heap import AgentHeapPolicy
from nftproxy.agent.intake import InvalidField
from nftproxy.agent.marker import KubeProxyMarker
from nftproxy.agent.proxier import Proxier
from nftproxy.cluster.events import ClusterEvents
from nftproxy.cluster.file import AmbiguousNode, FileSource, SourceError, WatchedFiles
from nftproxy.cluster.recorder import Recorder
from nftproxy.core.config import ProxyConfig
from nftproxy.core.convert.names import printable
from nftproxy.core.model import NamespacedName
from nftproxy.core.nft.errors import NftError
from nftproxy.core.nft.listing import list_family, live_name
from nftproxy.core.nft.ownership import foreign_table, our_tables, refusal
from nftproxy.kernel.addresses import AddressesUnavailable, AddressWatch, read_host_addresses
from nftproxy.kernel.libnftables import NftBackend, malloc_trim, tune_malloc
from nftproxy.kernel.sysctl import HostFS, enable_route_localnet
from nftproxy.serving.health import BindErrorCallback
from nftproxy.tools.cli_flags import (
    agent_flags,
    flag_overrides,
    marker_flags,
    ruleset_flags,
    table_flags,
)
from nftproxy.tools.config_load import build_config, config_notes, load_config_file
from nftproxy.tools.config_values import ConfigError
from nftproxy.tools.dry_run import dry_run, files_input
from nftproxy.tools.log import setup_logging
from nftproxy.tools.trace_flags import add_parser as add_trace_parser

__all__ = ["build_parser", "main"]

_Command = Callable[[argparse.Namespace, ProxyConfig], int]
_log = logging.getLogger("nftproxy.tools.cli")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `nftproxy` and `python -m nftproxy`; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    command: _Command | None = getattr(args, "handler", None)
    if command is None:
        parser.print_help(sys.stderr)
        return 2
    handler = setup_logging(args.verbose)
    try:
        try:
            config = _load_config(args)
        except ConfigError as exc:
            print(f"nftproxy: config: {exc}", file=sys.stderr)
            return 2
        try:
            rc = command(args, config)
            sys.stdout.flush()  # here, where a closed pipe can still be caught
        except BrokenPipeError:
            return _closed_pipe()
        return rc
    finally:
        logging.getLogger().removeHandler(handler)


def _closed_pipe() -> int:
    """The reader of stdout went away (`| head`): stop quietly, as a process
    killed by SIGPIPE would, and keep the interpreter's last flush from raising."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 128 + signal.SIGPIPE


# -- parser ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """Each subcommand lists only the flags it reads (tests/test_cli.py)."""
    table, ruleset, agent = table_flags(), ruleset_flags(), agent_flags()
    marker = marker_flags()
    parser = argparse.ArgumentParser(
        prog="nftproxy",
        description="Kubernetes service proxy for nft-native nodes: kube-proxy's KUBE-* "
        "semantics, programmed with nftables in one atomic transaction per sync.",
    )
    parser.add_argument("--version", action="version", version=f"nftproxy {__version__}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")

    run = sub.add_parser(
        "run", parents=[ruleset, agent, marker, table],
        help="run the proxy agent (watch the cluster, keep rules in sync)",
    )
    run.add_argument("--kubeconfig", metavar="FILE",
                     help="kubeconfig to use (default: in-cluster config, then ~/.kube/config)")
    run.add_argument("--source", metavar="FILE", action="append",
                     help="read Services/EndpointSlices/Node from FILE instead of the API "
                     "server; repeatable; edits are picked up")
    run.add_argument("--allow-empty", action="store_true",
                     help="with --source: let files without any Service remove every "
                     "programmed service (refused by default: the previous state is kept)")
    run.set_defaults(handler=_cmd_run)

    sync = sub.add_parser("sync", parents=[ruleset, marker, table],
                          help="program the rules once from files and exit")
    # `sync` always syncs once; --once stays accepted for scripts written when it was required
    sync.add_argument("--once", action="store_true", help=argparse.SUPPRESS)
    sync.add_argument("--source", metavar="FILE", action="append", required=True,
                      help="YAML/JSON manifests (e.g. kubectl get svc,endpointslices -A -o yaml); "
                      "repeatable")
    sync.add_argument("--dry-run", action="store_true",
                      help="print what would be programmed (the plan as nft text on stdout, "
                      "a summary on stderr); touch nothing")
    sync.add_argument("--json", action="store_true",
                      help="with --dry-run: print the plan as libnftables JSON, one command "
                      "a line")
    sync.add_argument("--allow-empty", action="store_true",
                      help="let files without any Service remove every programmed service "
                      "(refused by default)")
    sync.set_defaults(handler=_cmd_sync)

    dump = sub.add_parser("dump", parents=[table],
                          help="show the programmed table per service port")
    dump.add_argument("--json", action="store_true", help="print JSON instead of text")
    dump.add_argument("--service", metavar="NS/NAME", help="only this service")
    dump.set_defaults(handler=_cmd_dump)

    trace = add_trace_parser(sub, [ruleset, table])
    trace.set_defaults(handler=_cmd_trace)

    cleanup = sub.add_parser("cleanup", parents=[table],
                             help="delete nftproxy's tables and exit")
    cleanup.set_defaults(handler=_cmd_cleanup)

    demo = sub.add_parser("demo", parents=[ruleset, agent, table],
                          help="run on the embedded sample cluster in network namespaces")
    demo.add_argument("--once", action="store_true", help="sync and check once, then exit")
    demo.add_argument("--source", metavar="FILE",
                      help="cluster file to use and watch (default: a temporary copy of the "
                      "embedded sample)")
    demo.set_defaults(handler=_cmd_demo)
    return parser


# -- configuration --------------------------------------------------------------------


def _load_config(args: argparse.Namespace) -> ProxyConfig:
    file_overrides: dict[str, Any] = {}
    path = getattr(args, "config", None)
    if path:
        file_overrides, warnings = load_config_file(
            path, hard_fail=getattr(args, "config_hard_fail", None)
        )
        for warning in warnings:
            _log.warning("%s: %s", path, warning)
    flags, flag_warnings = flag_overrides(args)
    config = build_config(file_overrides, flags)
    for warning in (*flag_warnings, *config_notes(config)):
        _log.warning("%s", warning)
    env_name = os.environ.get("NODE_NAME", "").strip().lower()
    if not config.node_name and env_name:
        config = replace(config, node_name=env_name)
    return config


def _with_hostname(config: ProxyConfig) -> ProxyConfig:
    """The node name for API-server commands: as configured, else the hostname."""
    if config.node_name:
        return config
    return replace(config, node_name=socket.gethostname().lower())


def _needs_root(command: str, what: str = "program") -> int | None:
    """1 (after saying why: root is needed to `what` nftables) unless
    running as root; None when root."""
    if os.geteuid() == 0:
        return None
    print(f"nftproxy: {command}: needs root (CAP_NET_ADMIN) to {what} nftables",
          file=sys.stderr)
    return 1


# -- subcommands ----------------------------------------------------------------------


def _cmd_run(args: argparse.Namespace, config: ProxyConfig) -> int:
    """Run the agent until SIGTERM/SIGINT; the rules stay in place after."""
    if (rc := _needs_root("run")) is not None:
        return rc
    events = _ApiEvents()
    heap = AgentHeapPolicy(malloc_trim)
    services = -1  # the API source: never refused as empty
    try:
        if args.source:
            config, source_factory, services = _file_source(
                args.source, config, allow_empty=args.allow_empty
            )
        else:
            config = _with_hostname(config)
            source_factory, events = _kube_source(args.kubeconfig, config.node_name, heap.bulk)
    except AmbiguousNode as exc:
        print(f"nftproxy: config: {exc}", file=sys.stderr)
        return 2
    except (SourceError, _StartError) as exc:
        print(f"nftproxy: run: {exc}", file=sys.stderr)
        return 1
    tune_malloc()  # before a libnftables context exists
    with NftBackend() as probe:
        if (rc := _unsayable_table_name(probe, config)) is not None:
            return rc
        if (rc := _not_our_table(probe, config)) is not None:
            return rc
        if (rc := _refuse_emptying("run", probe, config, services, args.allow_empty)) is not None:
            return rc
    backend = NftBackend()
    agent = Agent(
        config,
        backend=backend,
        marker=backend,  # the kube-proxy marker goes through the agent's own context
        source_factory=source_factory,
        sysctl_fs=HostFS(),
        conntrack=_conntrack(),
        host_addresses=AddressWatch(),
        on_bind_error=events.on_bind_error,
        on_sync_failure=events.on_sync_failure,
        on_invalid_field=events.on_invalid_field,
        heap=heap,
    )
    stop = threading.Event()
    def on_signal(*_: object) -> None:
        # Not stop.set() here: the handler may run while this thread holds
        # the Event's lock inside stop.wait(), and the lock is not reentrant.
        threading.Thread(target=stop.set, name="run-stop", daemon=True).start()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        agent.run(stop)
    except (SourceError, NftError, OSError) as exc:
        print(f"nftproxy: run: {exc}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _unsayable_table_name(backend: NftBackend, config: ProxyConfig) -> int | None:
    """2, with a config error, when nft's syntax cannot say the table's name
    (one of nft's keywords: libnftables 1.0.6 could never program it)."""
    if backend.parses_table_name(config.table_name):
        return None
    print(f"nftproxy: config: tableName {config.table_name!r} is a word of nft's own syntax, "
          "which libnftables cannot parse as a table name; choose another", file=sys.stderr)
    return 2


def _not_our_table(backend: NftBackend, config: ProxyConfig) -> int | None:
    """2, with a config error, when a table of this name exists that
    nftproxy did not create (core/nft/ownership.py): it is left untouched."""
    try:
        found = foreign_table(backend.find_tables(config.table_name))
    except NftError as exc:
        print(f"nftproxy: {exc}", file=sys.stderr)
        return 1
    if found is None:
        return None
    print(f"nftproxy: config: {refusal(found)}", file=sys.stderr)
    return 2


class _StartError(Exception):
    """`run` cannot start (no API client, kube source unavailable)."""


def _file_source(
    paths: Sequence[str], config: ProxyConfig, *, allow_empty: bool
) -> tuple[ProxyConfig, SourceFactory, int]:
    """The files, read once, now (SourceError here, before anything starts),
    and how many Services they hold. With no node name given, the files'
    only Node names this node: the Intake needs the name before the first
    endpoint arrives. The agent's start() delivers this reading, then the
    files are watched."""
    source = FileSource(paths, Recorder(), node_name=config.node_name, allow_empty=allow_empty)
    chosen = source.read()
    if not config.node_name:
        config = replace(config, node_name=chosen)
        source.node_name = chosen

    def source_factory(handler: ClusterEvents) -> Source:
        source.handler = handler  # the Recorder above only stood in until now
        return WatchedFiles(source)

    return config, source_factory, source.service_count


def _refuse_emptying(
    command: str, backend: NftBackend, config: ProxyConfig, services: int, allow_empty: bool
) -> int | None:
    """1, after saying why, when the files hold no Service (`services` 0)
    while the table holds some: an emptied or truncated file must not
    silently remove every service (--allow-empty does it on purpose)."""
    if services != 0 or allow_empty:
        return None
    from nftproxy.tools.dump import parse_table  # read only when the files are empty

    held: set[str] = set()
    table = live_name(backend.list_table_objects, config.table_name)
    for family in ("ip", "ip6"):
        doc = list_family(backend.list_table, family, table)
        if doc is not None:
            view = parse_table(doc, family=family, table=table)
            held.update(printable(v.service) for v in view.services)
    if not held:
        return None
    shown = ", ".join(sorted(held)[:3]) + (", ..." if len(held) > 3 else "")
    print(f"nftproxy: {command}: the source files hold no Service, and table "
          f"{config.table_name} holds {len(held)} service ports ({shown}); refusing to "
          "remove them all (--allow-empty does)", file=sys.stderr)
    return 1


@dataclass(frozen=True)
class _ApiEvents:
    """What `run` reports as Kubernetes Events (none without the API source)."""

    on_bind_error: BindErrorCallback | None = None
    on_sync_failure: SyncFailureCallback | None = None
    on_invalid_field: Callable[[InvalidField], None] | None = None


def _kube_source(
    kubeconfig: str | None,
    node_name: str,
    listing: Callable[[], AbstractContextManager[object]] = nullcontext,
) -> tuple[SourceFactory, _ApiEvents]:
    """The API source, and the callbacks that post Events: a health-check
    port that cannot be bound (about the Service), a refused sync (about
    this Node), an invalid field skipped (about the object it is in).
    `listing` brackets each complete list (the agent's heap policy)."""
    try:  # imported lazily: the kubernetes client is slow to import, and a file needs none
        from nftproxy.cluster.kube import KubeSource, from_config
        from nftproxy.cluster.kube_events import EventRecorder
    except ImportError as exc:
        raise _StartError(f"the API server source is unavailable ({exc}); "
                          "use --source FILE") from None
    try:
        api_client = from_config(kubeconfig)
    except Exception as exc:  # the client's ConfigException and I/O errors
        raise _StartError(f"no API server configuration: {exc}") from None
    recorder = EventRecorder(api_client, host=node_name)

    def source_factory(handler: ClusterEvents) -> Source:
        return KubeSource(api_client, handler, node_name=node_name, listing=listing)

    def post(**event: str) -> None:
        threading.Thread(  # the recorder calls the API synchronously: not in the sync
            target=recorder.record, name="event", daemon=True, kwargs=event
        ).start()

    def on_bind_error(service: NamespacedName, port: int, error: OSError) -> None:
        message = (f"node {node_name} failed to start healthcheck \"{service}\" "
                   f"on port {port}: {error}")
        post(namespace=service.namespace, name=service.name,
             reason="FailedToStartServiceHealthcheck", message=message)

    def on_sync_failure(error: Exception) -> None:
        text = " ".join(str(error).split())  # libnftables' text spans lines
        post(namespace="default", name=node_name, uid=node_name, kind="Node",
             reason="SyncProxyRulesFailed",
             message=f"syncing proxy rules failed, retrying: {text}"[:1024])

    def on_invalid_field(invalid: InvalidField) -> None:
        kind = invalid.problem.kind
        post(namespace=invalid.namespace or "default", name=invalid.name, uid=invalid.uid,
             kind=kind, reason=invalid.reason, message=str(invalid.problem)[:1024])

    return source_factory, _ApiEvents(on_bind_error, on_sync_failure, on_invalid_field)


def _conntrack() -> ConntrackEdge | None:
    try:
        from nftproxy.kernel.conntrack import Conntrack
    except ImportError as exc:
        _log.warning("conntrack cleanup unavailable: %s", exc)
        return None
    return Conntrack()


def _cmd_sync(args: argparse.Namespace, config: ProxyConfig) -> int:
    """Program the table once from the files and exit (`run` keeps syncing)."""
    if args.dry_run:
        try:
            dry_run(args.source, config, summary=sys.stderr, commands=sys.stdout,
                    as_json=args.json)
        except AmbiguousNode as exc:
            print(f"nftproxy: config: {exc}", file=sys.stderr)
            return 2
        except SourceError as exc:
            print(f"nftproxy: sync: {exc}", file=sys.stderr)
            return 1
        return 0
    if (root := _needs_root("sync")) is not None:
        return root
    with NftBackend() as backend:
        if (rc := _unsayable_table_name(backend, config)) is not None:
            return rc
        if (rc := _not_our_table(backend, config)) is not None:
            return rc
        try:
            proxier, read = files_input(args.source, config, backend, log=_log)
            services = len(read.services)
            if (rc := _refuse_emptying("sync", backend, config, services,
                                       args.allow_empty)) is not None:
                return rc
            _read_host_addresses(proxier)
            if (rc := _route_localnet("sync", config)) is not None:
                return rc
            report = proxier.sync()
            if config.kube_proxy_marker:
                KubeProxyMarker(backend, log=_log).ensure()
        except AmbiguousNode as exc:
            print(f"nftproxy: config: {exc}", file=sys.stderr)
            return 2
        except (SourceError, NftError) as exc:
            print(f"nftproxy: sync: {exc}", file=sys.stderr)
            return 1
    print(f"synced: {'full' if report.full else 'partial'}, {report.ops} commands, "
          f"{report.total_seconds * 1000:.1f} ms", file=sys.stderr)
    return 0


def _route_localnet(command: str, config: ProxyConfig) -> int | None:
    """1 (after saying why) when localhost node ports are on and
    route_localnet cannot be set: the rules would serve nothing without it."""
    if not config.localhost_nodeports:
        return None
    try:
        enable_route_localnet(HostFS(), log=_log)
    except OSError as exc:
        print(f"nftproxy: {command}: localhost node ports need "
              f"net.ipv4.conf.all.route_localnet=1: {exc}", file=sys.stderr)
        return 1
    return None


def _read_host_addresses(proxier: Proxier) -> None:
    """Node ports restricted by nodePortAddresses: this host's addresses, once."""
    if not proxier.config.nodeport_addresses_restricted:
        return
    try:
        proxier.on_host_addresses(read_host_addresses())
    except AddressesUnavailable as exc:
        _log.error("%s; node ports use the Node's addresses", exc)


def _cmd_dump(args: argparse.Namespace, config: ProxyConfig) -> int:
    if (rc := _needs_root("dump", "read")) is not None:
        return rc
    from nftproxy.tools.dump import parse_table, render_text  # only `dump` reads a table

    views = []
    with NftBackend() as backend:
        table = live_name(backend.list_table_objects, config.table_name)
        for family in ("ip", "ip6"):
            doc = list_family(backend.list_table, family, table)
            if doc is not None:
                views.append(parse_table(doc, family=family, table=table,
                                         service=args.service))
    if not views:
        print(f"nftproxy: dump: no table named {config.table_name!r} (ip or ip6): "
              "nftproxy has not programmed this node", file=sys.stderr)
        return 1
    if args.service is not None and not any(v.services for v in views):
        print(f"nftproxy: dump: no service {printable(args.service)!r} in table "
              f"{config.table_name!r} (ip or ip6)", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([v.to_json() for v in views], indent=2))
    else:
        print("\n".join(render_text(v) for v in views))
    return 0


def _cmd_trace(args: argparse.Namespace, config: ProxyConfig) -> int:
    """tools/trace.py; the live tables need root, --source FILE does not."""
    if not args.source and (rc := _needs_root("trace")) is not None:
        return rc
    from nftproxy.tools.trace import command  # the interpreter: only `trace` runs it

    return command(args, config)


def _cmd_cleanup(args: argparse.Namespace, config: ProxyConfig) -> int:
    if (rc := _needs_root("cleanup")) is not None:
        return rc
    with NftBackend() as backend:
        if (rc := _not_our_table(backend, config)) is not None:
            return rc
        backend.delete_tables(config.table_name)
        deleted = ", ".join(sorted({name for _, name in our_tables(config.table_name)}))
        print(f"deleted tables ip/ip6 {deleted} (if present)", file=sys.stderr)
        try:  # whatever --kube-proxy-marker says: a marker left by an earlier run goes too
            removal = KubeProxyMarker(backend, log=_log).remove()
        except NftError as exc:
            print(f"nftproxy: cleanup: the kube-proxy marker: {exc}", file=sys.stderr)
            return 1
    for line in removal.lines():
        print(line, file=sys.stderr)
    return 0


def _cmd_demo(args: argparse.Namespace, config: ProxyConfig) -> int:
    """The sandboxed demo (nftproxy.tools.demo) until Ctrl-C/SIGTERM, or once.
    The node is --node-name, else the source file's only Node ($NODE_NAME
    and hostnameOverride name the host, not the sample's node). The agent's
    logs are shown from WARNING up unless -v."""
    if (rc := _needs_root("demo")) is not None:
        return rc
    from nftproxy.tools.demo import run_demo  # the sandbox is only needed here

    if args.node_name is None:
        config = replace(config, node_name="")
    stop = threading.Event()

    def on_signal(*_: object) -> None:
        # set() from another thread: the handler runs in the main thread,
        # which may hold stop's lock at that moment (inside stop.wait)
        threading.Thread(target=stop.set, name="demo-stop", daemon=True).start()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    logger = logging.getLogger("nftproxy")
    level = logger.level
    if not args.verbose:
        logger.setLevel(logging.WARNING)
    try:
        return run_demo(config, source=args.source, once=args.once, stop=stop)
    finally:
        logger.setLevel(level)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
