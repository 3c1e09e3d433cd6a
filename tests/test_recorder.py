"""The Recorder: a ClusterEvents handler keeping the latest raw objects.

Aspects: adds and updates keep the latest object per namespace/name, a
delete forgets it; the Node, the ServiceCIDRs and the synced kinds are
kept; replay() hands everything to another handler as a fresh source would
(Node first, then ServiceCIDRs, Services, EndpointSlices, synced kinds);
with `forward` every event is passed on unchanged; marker() counts changes
(not on_synced) and keeps `stamp()` as it was at the last change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from k8s import endpoint_slice, node, service

from nftproxy.cluster.events import KIND_ENDPOINT_SLICES, KIND_SERVICES, Obj
from nftproxy.cluster.recorder import Recorder

WEB = service("web", "10.96.0.10")
WEB_V2 = service("web", "10.96.0.11")
DB = service("db", "10.96.0.20", ports=[("pg", 5432, "TCP")])
WEB_SLICE = endpoint_slice("web", [("10.244.1.2", "node-a")], name="web-1")
NODE = node("node-a", ["192.168.50.1"])
CIDR: Obj = {"kind": "ServiceCIDR", "metadata": {"name": "kubernetes"},
             "spec": {"cidrs": ["10.96.0.0/16"]}}


class Log:
    """A ClusterEvents handler writing down every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def on_service(self, previous: Obj | None, current: Obj | None) -> None:
        self.calls.append(("service", previous, current))

    def on_endpoint_slice(self, previous: Obj | None, current: Obj | None) -> None:
        self.calls.append(("slice", previous, current))

    def on_node(self, node: Obj | None) -> None:
        self.calls.append(("node", node))

    def on_service_cidrs(self, cidrs: Sequence[Obj]) -> None:
        self.calls.append(("cidrs", tuple(cidrs)))

    def on_synced(self, kind: str) -> None:
        self.calls.append(("synced", kind))


def fed(recorder: Recorder) -> Recorder:
    recorder.on_service(None, WEB)
    recorder.on_service(None, DB)
    recorder.on_service(WEB, WEB_V2)
    recorder.on_service(DB, None)
    recorder.on_endpoint_slice(None, WEB_SLICE)
    recorder.on_node(NODE)
    recorder.on_service_cidrs([CIDR])
    recorder.on_synced(KIND_SERVICES)
    recorder.on_synced(KIND_ENDPOINT_SLICES)
    return recorder


def test_keeps_the_latest_object_of_each_name_and_forgets_deleted_ones() -> None:
    recorded = fed(Recorder()).snapshot()
    assert recorded.services == {("ns", "web"): WEB_V2}
    assert recorded.slices == {("ns", "web-1"): WEB_SLICE}
    assert recorded.node == NODE
    assert recorded.cidrs == (CIDR,)
    assert recorded.synced == {KIND_SERVICES, KIND_ENDPOINT_SLICES}


def test_replay_delivers_what_was_recorded_as_a_fresh_source_would() -> None:
    log = Log()
    fed(Recorder()).replay(log)
    assert log.calls == [
        ("node", NODE),
        ("cidrs", (CIDR,)),
        ("service", None, WEB_V2),
        ("slice", None, WEB_SLICE),
        ("synced", KIND_ENDPOINT_SLICES),
        ("synced", KIND_SERVICES),
    ]


def test_forward_passes_every_event_on_unchanged() -> None:
    log = Log()
    fed(Recorder(log))
    assert log.calls == [
        ("service", None, WEB),
        ("service", None, DB),
        ("service", WEB, WEB_V2),
        ("service", DB, None),
        ("slice", None, WEB_SLICE),
        ("node", NODE),
        ("cidrs", (CIDR,)),
        ("synced", KIND_SERVICES),
        ("synced", KIND_ENDPOINT_SLICES),
    ]


def test_marker_counts_changes_and_keeps_the_stamp_of_the_last_one() -> None:
    syncs = [0]
    recorder = Recorder(stamp=lambda: syncs[0])
    assert recorder.marker() == (0, 0)
    recorder.on_service(None, WEB)
    syncs[0] = 3
    recorder.on_node(NODE)
    syncs[0] = 5
    recorder.on_synced(KIND_SERVICES)  # not a change: the stamp stays
    assert recorder.marker() == (2, 3)
