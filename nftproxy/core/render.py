"""One family's desired table, or the changed part of it, from a state snapshot.

Layer: core, above rules and nft (pure). One job: the render step of a sync. Given the service
and endpoints maps of one family (a `StateSnapshot`), the node and the
config, render the skeleton plus one fragment per service port (full), or
only the fragments of the service ports a sync updated (partial; None for a
port that is gone). Alongside, per rendered port, whether its internal and external traffic
policies left it without a local endpoint (the
sync_proxy_rules_no_local_endpoints_total gauge): a value, kept by the caller.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from nftproxy.core.config import ProxyConfig
from nftproxy.core.model import IPFamily, NodeInfo, ServicePortName, family_of
from nftproxy.core.nft.plan import SKELETON, Owner
from nftproxy.core.rules.detect import local_detector
from nftproxy.core.rules.fragment import Fragment
from nftproxy.core.rules.service import RenderContext, render_service_port
from nftproxy.core.rules.skeleton import choosers, render_skeleton
from nftproxy.core.tracker import StateSnapshot

__all__ = [
    "MAX_CHUNKS",
    "NoLocal",
    "RenderedFamily",
    "chunks",
    "render_changed",
    "render_fresh",
    "render_full",
    "render_skeleton_only",
]

NoLocal = tuple[bool, bool]
"""(internal, external) traffic policy Local left without a local endpoint."""


@dataclass(frozen=True, slots=True)
class RenderedFamily:
    """The render step's output for one family.

    fragments: full -- every owner's fragment; partial -- each updated port's
        fragment, None where the port is gone.
    no_local: per rendered port its NoLocal, None where the port is gone.
    """

    family: IPFamily
    full: bool
    fragments: Mapping[Owner, Fragment | None] = field(default_factory=dict)
    no_local: Mapping[ServicePortName, NoLocal | None] = field(default_factory=dict)

    def desired(self) -> dict[Owner, Fragment]:
        """A full render's fragments (none is None)."""
        return {owner: f for owner, f in self.fragments.items() if f is not None}


def _context(family: IPFamily, config: ProxyConfig, node: NodeInfo) -> RenderContext:
    detector = local_detector(family, config, node)
    return RenderContext(family, config, node, detector, choosers(family, config, node))


def _render_ports(
    state: StateSnapshot, ctx: RenderContext, ports: Iterable[ServicePortName]
) -> tuple[dict[Owner, Fragment | None], dict[ServicePortName, NoLocal | None]]:
    fragments: dict[Owner, Fragment | None] = {}
    no_local: dict[ServicePortName, NoLocal | None] = {}
    for spn in ports:
        port = state.services.get(spn)
        if port is None:
            fragments[spn], no_local[spn] = None, None
            continue
        rendered = render_service_port(port, state.endpoints.get(spn, ()), ctx)
        fragments[spn] = rendered.fragment
        no_local[spn] = (rendered.internal_dropped, rendered.external_dropped)
    return fragments, no_local


def render_full(
    state: StateSnapshot,
    config: ProxyConfig,
    node: NodeInfo,
    service_cidrs: Iterable[str],
) -> RenderedFamily:
    """The whole table of `state.family`: skeleton first, then every port."""
    family = state.family
    cidrs = tuple(c for c in service_cidrs if family_of(c) is family)
    fragments: dict[Owner, Fragment | None] = {
        SKELETON: render_skeleton(family, config, node, cidrs)
    }
    ctx = _context(family, config, node)
    # Sorted: the persistent map iterates in hash order, which varies per process.
    ports, no_local = _render_ports(state, ctx, sorted(state.services))
    fragments.update(ports)
    return RenderedFamily(family, True, fragments, no_local)


def render_skeleton_only(
    state: StateSnapshot,
    config: ProxyConfig,
    node: NodeInfo,
    service_cidrs: Iterable[str],
) -> RenderedFamily:
    """The skeleton of `state.family`'s table alone (a full render whose
    ports come later, chunk by chunk, as `render_changed`)."""
    family = state.family
    cidrs = tuple(c for c in service_cidrs if family_of(c) is family)
    fragments: dict[Owner, Fragment | None] = {
        SKELETON: render_skeleton(family, config, node, cidrs)
    }
    return RenderedFamily(family, True, fragments)


MAX_CHUNKS = 50
"""At most this many chunks: each one pays a little for the whole table built
so far (the kernel's validation, libnftables' cache), so their count, not
only their size, sets the time."""


def chunks(
    states: Iterable[StateSnapshot], min_endpoints: int
) -> Iterator[frozenset[ServicePortName]]:
    """The service ports of `states` (every family) in sorted groups of
    about `min_endpoints` endpoints (a port counts at least 1), larger where
    that would make more than MAX_CHUNKS groups: the size of a transaction
    follows its endpoints (one rule and one hairpin element each)."""
    weight: dict[ServicePortName, int] = {}
    for state in states:
        for spn in state.services:
            weight[spn] = weight.get(spn, 0) + max(1, len(state.endpoints.get(spn, ())))
    max_endpoints = max(min_endpoints, -(-sum(weight.values()) // MAX_CHUNKS))
    group: list[ServicePortName] = []
    total = 0
    for spn in sorted(weight):
        group.append(spn)
        total += weight[spn]
        if total >= max_endpoints:
            yield frozenset(group)
            group, total = [], 0
    if group:
        yield frozenset(group)


def render_changed(
    state: StateSnapshot,
    config: ProxyConfig,
    node: NodeInfo,
    updated: Iterable[ServicePortName],
) -> RenderedFamily:
    """The fragments of the `updated` ports only (sorted; None: gone)."""
    ctx = _context(state.family, config, node)
    fragments, no_local = _render_ports(state, ctx, sorted(updated))
    return RenderedFamily(state.family, False, fragments, no_local)


def render_fresh(
    states: Mapping[IPFamily, StateSnapshot],
    config: ProxyConfig,
    node: NodeInfo,
    service_cidrs: Iterable[str],
    min_endpoints: int,
) -> Iterator[dict[IPFamily, RenderedFamily]]:
    """A full sync as steps, each one transaction: the skeletons, then the
    service ports in `chunks` (both families' fragments of a port in the
    same step). Lazy: a step is rendered when it is taken."""
    cidrs = tuple(service_cidrs)
    yield {f: render_skeleton_only(s, config, node, cidrs) for f, s in states.items()}
    for chunk in chunks(states.values(), min_endpoints):
        yield {
            f: render_changed(s, config, node, chunk & s.services.keys())
            for f, s in states.items()
        }
