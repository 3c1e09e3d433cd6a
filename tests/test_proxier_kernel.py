"""The proxier against the real kernel, in throwaway network namespaces.

Aspects:
- a full sync programs both families; a restart's full sync and a no-change
  sync leave the table as it is (and the latter sends nothing);
- any sequence of partial syncs ends in exactly the table one full sync of
  the final state builds (property test, compared as listed by the kernel);
- a refused commit changes nothing in the kernel (both families), and the
  next sync is a full one that repairs the table;
- a foreign table in the same namespace is byte-identical before and after
  sync, partial sync and cleanup.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import kernel
import pytest
from feed import intake
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from k8s import endpoint_slice, node, service

from nftproxy.agent.proxier import Proxier
from nftproxy.cluster.events import KIND_ENDPOINT_SLICES, KIND_SERVICES
from nftproxy.core.config import ProxyConfig
from nftproxy.core.nft.errors import NftError
from nftproxy.core.nft.listing import list_family
from nftproxy.kernel.libnftables import NftBackend

NODE = "node-a"
CONFIG = ProxyConfig(
    node_name=NODE, cluster_cidrs=("10.244.0.0/16", "fd00:244::/48"), table_name="nftproxy"
)


def listing(backend: NftBackend) -> dict[str, Any]:
    return {
        f: kernel.canonical(
            list_family(backend.list_table, f, CONFIG.table_name)
        )
        for f in ("ip", "ip6")
    }


@pytest.fixture
def backend(netns: str) -> Iterator[NftBackend]:
    with NftBackend(netns=netns) as b:
        yield b


def fed(backend: NftBackend, objects: dict[str, dict[str, Any]], **proxier_args: Any) -> Proxier:
    proxier = Proxier(CONFIG, backend, **proxier_args)
    intake(proxier).on_node(node(NODE, ["192.168.50.1", "fd00:50::1"], pod_cidrs=["10.244.0.0/24"]))
    for key, obj in objects.items():
        if key.startswith("svc/"):
            intake(proxier).on_service(None, obj)
        else:
            intake(proxier).on_endpoint_slice(None, obj)
    intake(proxier).on_synced(KIND_SERVICES)
    intake(proxier).on_synced(KIND_ENDPOINT_SLICES)
    return proxier


def sample() -> dict[str, dict[str, Any]]:
    return {
        "svc/web": service(
            "web", ["10.96.0.10", "fd00:96::10"], type="NodePort", node_ports=[30080]
        ),
        "eps/web4": endpoint_slice("web", [("10.244.0.11", NODE), ("10.244.1.12", "node-b")]),
        "eps/web6": endpoint_slice("web", [("fd00:244::11", NODE)]),
        "svc/lb": service(
            "lb",
            "10.96.0.20",
            type="LoadBalancer",
            node_ports=[30081],
            lb_ips=["192.168.60.10"],
            source_ranges=["192.168.50.0/24"],
            etp="Local",
            health_check_node_port=30500,
        ),
        "eps/lb": endpoint_slice("lb", [("10.244.0.11", NODE), ("10.244.1.12", "node-b")]),
        "svc/sticky": service("sticky", "10.96.0.30", affinity_timeout=60),
        "eps/sticky": endpoint_slice("sticky", ["10.244.0.11", "10.244.0.12"]),
        "svc/empty": service("empty", "10.96.0.99", ports=[("dns", 53, "UDP")]),
    }


def test_full_sync_restart_and_no_change(backend: NftBackend) -> None:
    first = fed(backend, sample())
    report = first.sync()
    assert report.full and report.ops > 0
    programmed = listing(backend)
    assert programmed["ip"] is not None and programmed["ip6"] is not None
    assert "KUBE-SVC-" in json.dumps(programmed["ip"]["chains"])
    assert first.sync().ops == 0, "a sync with no change sends nothing"

    restarted = fed(backend, sample())
    assert restarted.sync().full
    assert listing(backend) == programmed


def test_refused_commit_changes_nothing_and_next_sync_repairs(
    backend: NftBackend, netns: str
) -> None:
    objects = sample()
    proxier = fed(backend, objects)
    proxier.sync()
    expected = listing(backend)
    kernel.nft(netns, "delete", "table", "ip", CONFIG.table_name)  # drift behind our back
    before = listing(backend)
    events = intake(proxier)
    events.on_endpoint_slice(objects["eps/web6"], endpoint_slice("web", [("fd00:244::12", NODE)]))
    intake(proxier).on_endpoint_slice(objects["eps/web6"], objects["eps/web6"])
    with pytest.raises(NftError):
        events.on_endpoint_slice(None, endpoint_slice("web", ["10.244.0.13"], name="extra"))
        proxier.sync()
    assert listing(backend) == before, "a refused transaction must not change either family"
    intake(proxier).on_endpoint_slice(endpoint_slice("web", ["10.244.0.13"], name="extra"), None)
    report = proxier.sync()
    assert report.full
    assert listing(backend) == expected


def test_foreign_table_is_untouched(backend: NftBackend, netns: str) -> None:
    kernel.nft(
        netns,
        "-f",
        "-",
        stdin=(
            "table ip foreign {\n set s { type ipv4_addr; elements = { 10.0.0.1 }; }\n"
            " chain input { type filter hook input priority 0; ip saddr @s counter accept; }\n}\n"
            "table inet nftproxy2 {\n chain c {\n }\n}\n"
        ),
    )
    before = kernel.nft(netns, "list", "table", "ip", "foreign")
    before_inet = kernel.nft(netns, "list", "table", "inet", "nftproxy2")
    objects = sample()
    proxier = fed(backend, objects)
    proxier.sync()
    intake(proxier).on_service(objects["svc/web"], None)
    proxier.sync()
    backend.delete_tables(CONFIG.table_name)
    assert kernel.nft(netns, "list", "table", "ip", "foreign") == before
    assert kernel.nft(netns, "list", "table", "inet", "nftproxy2") == before_inet
    tables = kernel.nft(netns, "list", "tables")
    assert "nftproxy\n" not in tables and "ip foreign" in tables


# ---- property: partial syncs == one full sync ---------------------------------------

_POOL_IPS = [f"10.244.{n}.{h}" for n in (0, 1) for h in (11, 12, 13)]


@st.composite
def _service_objects(draw: st.DrawFn, i: int) -> tuple[dict[str, Any], dict[str, Any]]:
    kind = draw(st.sampled_from(["ClusterIP", "NodePort", "LoadBalancer"]))
    svc = service(
        f"s{i}",
        f"10.96.1.{i}",
        type=kind,
        ports=[("p", 80, draw(st.sampled_from(["TCP", "UDP"])))],
        node_ports=[30100 + i] if kind != "ClusterIP" else [],
        lb_ips=[f"192.168.60.{i}"] if kind == "LoadBalancer" else [],
        source_ranges=draw(st.sampled_from([[], ["192.168.50.0/24"]]))
        if kind == "LoadBalancer"
        else [],
        etp=draw(st.sampled_from([None, "Local"])) if kind != "ClusterIP" else None,
        itp=draw(st.sampled_from([None, "Local"])),
        affinity_timeout=draw(st.sampled_from([None, 30, 60])),
    )
    ips = draw(st.lists(st.sampled_from(_POOL_IPS), max_size=3, unique=True))
    eps = endpoint_slice(
        f"s{i}",
        [
            {
                "ip": ip,
                "nodeName": NODE if ip.startswith("10.244.0.") else "node-b",
                "ready": draw(st.booleans()),
                "serving": True,
                "terminating": False,
            }
            for ip in ips
        ],
        ports=[("p", 8080, svc["spec"]["ports"][0]["protocol"])],
        family="IPv4",
    )
    return svc, eps


@st.composite
def _histories(draw: st.DrawFn) -> list[tuple[int, tuple[dict[str, Any], dict[str, Any]] | None]]:
    steps = draw(st.integers(min_value=1, max_value=8))
    return [
        (
            i := draw(st.integers(min_value=1, max_value=4)),
            draw(st.one_of(st.none(), _service_objects(i))),
        )
        for _ in range(steps)
    ]


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(history=_histories())
def test_partial_syncs_end_in_the_table_of_one_full_sync(
    history: list[tuple[int, tuple[dict[str, Any], dict[str, Any]] | None]],
) -> None:
    with (
        kernel.fresh_netns() as ns_a,
        kernel.fresh_netns() as ns_b,
        NftBackend(netns=ns_a) as a,
        NftBackend(netns=ns_b) as b,
    ):
        incremental = fed(a, {})
        incremental.sync()
        current: dict[str, dict[str, Any]] = {}
        for i, objs in history:
            old_svc, old_eps = current.pop(f"svc/{i}", None), current.pop(f"eps/{i}", None)
            new_svc, new_eps = objs if objs else (None, None)
            intake(incremental).on_service(old_svc, new_svc)
            intake(incremental).on_endpoint_slice(old_eps, new_eps)
            if objs:
                current[f"svc/{i}"], current[f"eps/{i}"] = objs
            incremental.sync()
        fed(b, current).sync()
        assert listing(a) == listing(b)
