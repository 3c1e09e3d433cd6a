"""cluster/store.py: the informers' store of packed objects.

Aspects: pack/unpack round-trips every JSON value json.loads gives (lone
surrogates included) and packs ASCII bytes; equal objects built in
different key orders pack equal, different ones do not; the store keeps
bytes and its view is a read-only Mapping that decodes on access and
follows the store; `difference` gives deletes, adds and only real updates;
`Changes` decodes its pairs when read (index, slice, iteration); a
metadata-only store (EndpointSlices) keeps a digest and the head (kind,
apiVersion, metadata), a fraction of the object, still tells a change by its
bytes, and gives the head back as the previous object.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest

from nftproxy.cluster.store import Changes, PackedStore, difference, head, pack, unpack


def service(name: str, port: int = 80, **labels: str) -> dict[str, Any]:
    return {
        "kind": "Service",
        "apiVersion": "v1",
        "metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}", "labels": labels},
        "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": port, "protocol": "TCP"}]},
    }


def reversed_keys(obj: Any) -> Any:
    """`obj` with every dict's keys in reverse order: equal, built differently."""
    if isinstance(obj, dict):
        return {k: reversed_keys(obj[k]) for k in reversed(obj)}
    if isinstance(obj, list):
        return [reversed_keys(v) for v in obj]
    return obj


def endpoint_slice(name: str, endpoints: int = 10, first: int = 0) -> dict[str, Any]:
    return {
        "kind": "EndpointSlice",
        "apiVersion": "discovery.k8s.io/v1",
        "metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}",
                     "labels": {"kubernetes.io/service-name": name[:-6]}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [f"10.128.0.{first + i}"], "conditions": {"ready": True},
                       "nodeName": f"node-{i}"} for i in range(endpoints)],
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    }


def store_of(*objs: dict[str, Any], metadata_only: bool = False) -> PackedStore:
    store = PackedStore(metadata_only=metadata_only)
    for obj in objs:
        store.put(obj["metadata"]["name"], store.value(obj, pack(obj)))
    return store


def packed_of(*objs: dict[str, Any]) -> dict[str, bytes]:
    """A list's packed objects by key (`difference`'s `current`)."""
    return {obj["metadata"]["name"]: pack(obj) for obj in objs}


# -- pack / unpack -----------------------------------------------------------------------


def test_pack_round_trips_what_the_api_sends() -> None:
    obj = json.loads(
        '{"metadata": {"name": "sv\\u00e9", "labels": {"odd": "\\ud800", "e": ""}},'
        ' "spec": {"n": 1, "big": 123456789012345678901234567890, "f": 0.1, "t": true,'
        ' "z": null, "l": [], "d": {}, "u": "\\u65e5\\u672c"}}'
    )
    data = pack(obj)
    assert isinstance(data, bytes)
    assert data.isascii()
    assert b" " not in data  # compact
    assert unpack(data) == obj


def test_equal_objects_in_different_key_orders_pack_equal() -> None:
    obj = service("web", app="web", tier="front")
    other = reversed_keys(obj)
    assert list(other) != list(obj)  # really built in another order
    assert list(other["metadata"]["labels"]) != list(obj["metadata"]["labels"])
    assert pack(other) == pack(obj)
    assert pack(service("web", port=8080)) != pack(obj)
    assert pack(service("web", app="web")) != pack(obj)


# -- the store and its view --------------------------------------------------------------


def test_the_store_keeps_the_packed_bytes_and_returns_what_it_replaced() -> None:
    store = PackedStore()
    assert store.put("a", pack(service("a"))) is None
    assert store.put("a", pack(service("a", port=81))) == pack(service("a"))
    assert store.packed("a") == pack(service("a", port=81))
    assert store.packed("b") is None
    assert len(store) == 1
    assert all(isinstance(data, bytes) for _, data in store.items())
    assert store.pop("a") == pack(service("a", port=81))
    assert store.pop("a") is None
    assert len(store) == 0


def test_the_view_is_a_read_only_mapping_that_decodes_on_access() -> None:
    store = store_of(service("a"), service("b", port=81))
    view = store.view
    assert isinstance(view, Mapping)
    assert not hasattr(view, "__setitem__")
    assert len(view) == 2
    assert sorted(view) == ["a", "b"]
    assert "a" in view and "c" not in view
    assert view["b"] == service("b", port=81)
    assert view.get("c") is None
    with pytest.raises(KeyError):
        view["c"]
    assert dict(view) == {"a": service("a"), "b": service("b", port=81)}

    copy = view["a"]
    copy["spec"]["clusterIP"] = "changed"  # a decoded copy
    assert view["a"] == service("a")

    store.put("c", pack(service("c")))  # the view follows the store
    store.pop("a")
    assert sorted(view) == ["b", "c"]


# -- differences and changes -------------------------------------------------------------


def test_difference_is_deletes_adds_and_only_real_updates() -> None:
    old = store_of(service("gone"), service("same"), service("reordered"), service("changed"))
    listed = (service("same"), reversed_keys(service("reordered")),
              service("changed", port=8080), service("added"))
    new = store_of(*listed)
    assert list(difference(old, new, packed_of(*listed))) == [
        (service("gone"), None),
        (service("changed"), service("changed", port=8080)),
        (None, service("added")),
    ]
    assert list(difference(new, new, packed_of(*listed))) == []
    assert list(difference(old, PackedStore(), {})) == [(service(n), None) for n in
                                                        ("gone", "same", "reordered", "changed")]


# -- a metadata-only store ---------------------------------------------------------------


def test_a_metadata_only_store_keeps_a_digest_and_the_head() -> None:
    obj = endpoint_slice("web-ipv4")
    store = store_of(obj, metadata_only=True)
    value = store.packed("web-ipv4")
    assert value is not None
    assert len(value) < len(pack(obj)) / 4  # ~1 KB packed, its head ~200 bytes
    assert store.kept(value) == pack(head(obj))
    assert head(obj) == {k: obj[k] for k in ("kind", "apiVersion", "metadata")}
    assert store.view["web-ipv4"] == head(obj)
    # equal objects, equal values; any change to the object, a different value
    assert store.value(reversed_keys(obj), pack(reversed_keys(obj))) == value
    moved = endpoint_slice("web-ipv4", first=1)
    assert head(moved) == head(obj)
    assert store.value(moved, pack(moved)) != value
    assert PackedStore().value(obj, pack(obj)) == pack(obj)  # a full store keeps it all


def test_the_difference_of_metadata_only_stores_is_heads_before_and_objects_after() -> None:
    gone, same, moved = (endpoint_slice(f"{n}-ipv4") for n in ("gone", "same", "moved"))
    listed = (same, endpoint_slice("moved-ipv4", first=5), endpoint_slice("added-ipv4"))
    old = store_of(gone, same, moved, metadata_only=True)
    new = store_of(*listed, metadata_only=True)
    assert list(difference(old, new, packed_of(*listed))) == [
        (head(gone), None),
        (head(moved), listed[1]),
        (None, listed[2]),
    ]


def test_changes_decode_their_pairs_when_read() -> None:
    a, b = pack(service("a")), pack(service("b"))
    changes = Changes([(None, a), (a, b), (b, None)])
    assert len(changes) == 3
    assert changes[0] == (None, service("a"))
    assert changes[-1] == (service("b"), None)
    assert list(changes[1:]) == [(service("a"), service("b")), (service("b"), None)]
    assert [pair for pair in changes] == [changes[0], changes[1], changes[2]]
    assert changes[1][0] is not changes[1][0]  # decoded at each read, never kept
    assert not Changes([])
