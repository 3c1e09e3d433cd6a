"""Feeding raw Kubernetes objects to a Proxier, as the agent does.

The Proxier takes model values; the agent's `Intake` converts raw objects
when their events arrive. Tests that build objects as dicts (k8s.py) feed
them through an Intake too: `intake(proxier).on_service(None, obj)`; tracker
tests record raw events with update_service / update_slice.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from nftproxy.agent.intake import Intake, InvalidField, ProxierEvents, service_info
from nftproxy.cluster.events import KIND_ENDPOINT_SLICES, KIND_SERVICES
from nftproxy.core import convert
from nftproxy.core.tracker import EndpointSliceChangeTracker, ServiceChangeTracker

__all__ = ["initial_list", "intake", "update_service", "update_slice"]

Obj = dict[str, Any]


def intake(
    proxier: ProxierEvents, node_name: str = "", problems: list[InvalidField] | None = None
) -> Intake:
    """An Intake in front of `proxier`; invalid fields go to `problems` (or nowhere).
    `node_name` defaults to the proxier's config.node_name."""
    name = node_name or getattr(getattr(proxier, "config", None), "node_name", "")
    return Intake(proxier, node_name=name, report=(problems.append if problems is not None
                                                   else lambda _: None))


def initial_list(events: Intake, objects: Iterable[Obj]) -> None:
    """Deliver `objects` (Nodes, Services, EndpointSlices) as the initial
    lists, then the end of both lists."""
    for obj in objects:
        if obj["kind"] == "Node":
            events.on_node(obj)
        elif obj["kind"] == "Service":
            events.on_service(None, obj)
        else:
            events.on_endpoint_slice(None, obj)
    events.on_synced(KIND_SERVICES)
    events.on_synced(KIND_ENDPOINT_SLICES)


def update_service(
    tracker: ServiceChangeTracker, previous: Obj | None, current: Obj | None
) -> bool:
    """Record a raw Service event in one family's tracker, converted as the
    Intake converts it; False for an object without usable metadata."""
    obj = current if current is not None else previous
    name = convert.service_name(obj) if obj is not None else None
    if name is None:
        return False
    before, after = service_info(name, previous)[0], service_info(name, current)[0]
    family = tracker.family
    return tracker.update(
        name,
        before.ports(family) if before is not None else {},
        after.ports(family) if after is not None else {},
    )


def update_slice(
    tracker: EndpointSliceChangeTracker, previous: Obj | None, current: Obj | None, node_name: str
) -> bool:
    """Record a raw EndpointSlice event in one family's tracker, as the Intake does."""
    obj = current if current is not None else previous
    key = convert.service_name(obj) if obj is not None else None
    if key is None:
        return False
    info = convert.slice_info(current, node_name)[0] if current is not None else None
    return tracker.update(key, info)
