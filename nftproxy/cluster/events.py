"""The interface every cluster source feeds: raw object events.

Layer: sources (imports nothing but typing). Sources (file, kube) deliver
Kubernetes objects as plain JSON dicts to a `ClusterEvents` handler -- the
proxier. Handlers only record; they never program the kernel.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = ["KIND_ENDPOINT_SLICES", "KIND_SERVICES", "ClusterEvents", "Obj"]

Obj = Mapping[str, Any]
KIND_SERVICES = "services"
KIND_ENDPOINT_SLICES = "endpointslices"


class ClusterEvents(Protocol):
    def on_service(self, previous: Obj | None, current: Obj | None) -> None:
        """Add (previous None), update, or delete (current None) of a v1 Service."""

    def on_endpoint_slice(self, previous: Obj | None, current: Obj | None) -> None:
        """Add, update or delete of a discovery.k8s.io/v1 EndpointSlice.
        `previous` may be only its kind, apiVersion and metadata (the API
        source keeps no more of a slice: cluster/store.py)."""

    def on_node(self, node: Obj | None) -> None:
        """This node's v1 Node object changed (None: deleted or not found)."""

    def on_service_cidrs(self, cidrs: Sequence[Obj]) -> None:
        """The complete current list of networking.k8s.io ServiceCIDR objects."""

    def on_synced(self, kind: str) -> None:
        """The initial list of `kind` (KIND_SERVICES / KIND_ENDPOINT_SLICES) is complete."""
