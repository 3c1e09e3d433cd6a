"""What a sync works from and what it did: frozen values.

Layer: agent (imports the core only). One job: name the values that cross
the proxier's boundary. `SyncInput` is the snapshot a sync renders from
(taken under the proxier's lock); `SyncReport` is what the hooks, the
agent's metrics and health, the conntrack cleanup and the CLI are told --
plain values and read-only snapshots, never live state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from nftproxy.core.model import IPFamily, NamespacedName, NodeInfo, ServicePortName
from nftproxy.core.nft.commands import Command
from nftproxy.core.tracker import StateSnapshot, UpdateResult

__all__ = [
    "FamilyInput",
    "FamilySync",
    "PlannedSync",
    "PostCommitHook",
    "SyncInput",
    "SyncReport",
    "TableSizes",
]


@dataclass(frozen=True, slots=True)
class TableSizes:
    """What one family's table holds, as last committed."""

    chains: int = 0
    rules: int = 0
    sets: int = 0
    elements: int = 0


@dataclass(frozen=True, slots=True)
class FamilySync:
    """What one sync did in one family."""

    family: IPFamily
    update: UpdateResult
    state: StateSnapshot
    no_local_internal: int = 0
    no_local_external: int = 0
    table: TableSizes = TableSizes()


@dataclass(frozen=True, slots=True)
class SyncReport:
    """What one sync did, for logs, metrics, conntrack and health: values only.

    health_check_ports: healthCheckNodePort per service needing a server.
    local_endpoints: per service needing a server, its local ready endpoints
        (a dual-stack pod counts once: the larger of the two families).
    """

    full: bool
    ops: int
    families: tuple[FamilySync, ...] = ()
    render_seconds: float = 0.0
    commit_seconds: float = 0.0
    total_seconds: float = 0.0
    skipped: str = ""
    health_check_ports: Mapping[NamespacedName, int] = field(default_factory=dict)
    local_endpoints: Mapping[NamespacedName, int] = field(default_factory=dict)

    @property
    def updated(self) -> frozenset[ServicePortName]:
        out: set[ServicePortName] = set()
        for f in self.families:
            out |= f.update.updated
        return frozenset(out)


@dataclass(frozen=True, slots=True)
class FamilyInput:
    update: UpdateResult
    state: StateSnapshot


@dataclass(frozen=True, slots=True)
class SyncInput:
    """Everything one sync renders from, taken under the lock (step 1)."""

    full: bool
    node: NodeInfo
    service_cidrs: tuple[str, ...]
    families: Mapping[IPFamily, FamilyInput]


@dataclass(frozen=True, slots=True)
class PlannedSync:
    """A full sync planned and not sent (`sync --dry-run`): what it was
    rendered from and the commands it would commit."""

    input: SyncInput
    commands: tuple[Command, ...]


PostCommitHook = Callable[[SyncReport], None]
"""Runs after every successful commit, in the sync thread."""
