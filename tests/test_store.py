"""cluster/store.py: the informers' store of packed objects.

Aspects: pack/unpack round-trips every JSON value json.loads gives (lone
surrogates included) and packs ASCII bytes; equal objects built in
different key orders pack equal, different ones do not; the store keeps
bytes and its view is a read-only Mapping that decodes on access and
follows the store; `difference` gives deletes, adds and only real updates;
`Changes` decodes its pairs when read (index, slice, iteration).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest

from nftproxy.cluster.store import Changes, PackedStore, difference, pack, unpack


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


def store_of(*objs: dict[str, Any]) -> PackedStore:
    store = PackedStore()
    for obj in objs:
        store.put(obj["metadata"]["name"], pack(obj))
    return store


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


def test_the_store_keeps_bytes_and_returns_what_it_replaced() -> None:
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
    new = store_of(
        service("same"), reversed_keys(service("reordered")), service("changed", port=8080),
        service("added"),
    )
    assert list(difference(old, new)) == [
        (service("gone"), None),
        (service("changed"), service("changed", port=8080)),
        (None, service("added")),
    ]
    assert list(difference(new, new)) == []
    assert list(difference(old, PackedStore())) == [(service(n), None) for n in
                                                    ("gone", "same", "reordered", "changed")]


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
