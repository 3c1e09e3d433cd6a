"""Who claims a shared element, and what the planner's record of it costs
(nftproxy.core.nft.claims, through plan.py; the helpers are test_plan's).

Aspects:
- a key two owners claim: the first by name wins, the other takes over when
  it leaves (a delete + add only where the element differs), and the key is
  gone from the record and the kernel when both have left;
- an owner that renders one key twice (a service whose external IP is its
  cluster IP) puts it in the table once, as it rendered it last, by a
  partial or a full sync;
- a single claim costs the record a dict slot, no wrapper objects (10,000
  services hold ~180,000 claims); an endpoint index's claim in an indexed
  map costs a list slot, no key tuple;
- an index that groups a map's keys by chooser answers every question as
  one keyed by the whole key does, over any history of claims and releases.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Sequence
from typing import Any

from builders import endpoint, service_port
from hypothesis import given, settings
from hypothesis import strategies as st
from test_plan import (
    SKEL,
    _ops,
    apply,
    assert_same_as_full,
    content,
    frag,
    fresh,
    listing,
    partial,
)

from nftproxy.core.nft.claims import ElementIndex
from nftproxy.core.nft.plan import SKELETON, Owner, stage_full
from nftproxy.core.rules import names
from nftproxy.core.rules.dispatch import is_indexed_map
from nftproxy.core.rules.fragment import Element, Fragment, Json

SAME_IP = "172.30.0.42"
EP = endpoint("10.180.0.9", local=True)  # a hairpin pair
A = service_port("a", ns="ns1", cluster_ip=SAME_IP)
B = service_port("b", ns="ns2", cluster_ip=SAME_IP)
SERVICE_KEY = ("service-ips", (SAME_IP, "tcp", 80))
HAIRPIN_KEY = ("hairpin-endpoints", (EP.ip, EP.ip))


def _element_ops(commands: Sequence[Json]) -> list[tuple[str, str]]:
    """The element commands: (verb, set name)."""
    return [(verb, name) for verb, kind, name, _ in _ops(commands) if kind == "element"]


def test_a_shared_key_passes_to_the_next_claimant_and_goes_with_the_last() -> None:
    state, kernel = fresh({SKELETON: SKEL})
    partial(state, kernel, {B.name: frag(B, [EP])})
    assert state.index.owners(*SERVICE_KEY) == (B.name,)
    # a second claimant that sorts first takes the key over
    commands = partial(state, kernel, {A.name: frag(A, [EP])})
    assert state.index.owners(*SERVICE_KEY) == (A.name, B.name)
    assert state.index.owners(*HAIRPIN_KEY) == (A.name, B.name)
    # its service-ips element and its endpoint's (same key, another comment)
    taken = [
        ("delete", "service-ips"),
        ("delete", "vip-endpoints-tcp"),
        ("add", "service-ips"),
        ("add", "vip-endpoints-tcp"),
    ]
    assert _element_ops(commands) == taken
    assert_same_as_full(state, kernel)
    # the winner leaves: the other takes over; an equal element is not re-sent
    commands = partial(state, kernel, {A.name: None})
    assert state.index.owners(*SERVICE_KEY) == (B.name,)
    winner = state.effective(SERVICE_KEY)
    assert winner is not None and winner.comment is not None
    assert winner.comment.endswith(names.service_chain(B.name))
    assert _element_ops(commands) == taken
    assert_same_as_full(state, kernel)
    # the last one leaves: the key is gone from the record and the kernel
    partial(state, kernel, {B.name: None})
    for key in (SERVICE_KEY, HAIRPIN_KEY):
        assert state.index.owners(*key) == ()
        assert state.effective(key) is None
        assert key not in set(state.index.ids())
    assert not content(kernel).sets["service-ips"].elems
    assert not content(kernel).sets["hairpin-endpoints"].elems
    assert_same_as_full(state, kernel)


def _twice() -> Fragment:
    """A port whose external IP is its cluster IP: two service-ips elements
    of one key, the cluster IP's (goto the service chain) then the external
    IP's (goto the external chain)."""
    port = service_port("twice", cluster_ip=SAME_IP, external_ips=(SAME_IP,))
    fragment = frag(port, [EP])
    same = [e for e in fragment.elements if (e.set_name, e.key) == SERVICE_KEY]
    assert len(same) == 2 and same[0] != same[1]
    return fragment


def _service_ips_added(commands: Sequence[Json]) -> list[Any]:
    return [elem for verb, kind, name, spec in _ops(commands)
            if (verb, kind, name) == ("add", "element", "service-ips") for elem in spec["elem"]]


def test_a_key_an_owner_renders_twice_is_added_once_as_rendered_last() -> None:
    twice = _twice()
    last = [e for e in twice.elements if (e.set_name, e.key) == SERVICE_KEY][-1]
    state, kernel = fresh({SKELETON: SKEL})
    assert len(_service_ips_added(partial(state, kernel, {"twice": twice}))) == 1
    assert state.effective(SERVICE_KEY) == last
    assert_same_as_full(state, kernel)
    desired: dict[Owner, Fragment] = {SKELETON: SKEL, "twice": twice}
    staged = stage_full(state, listing(kernel), desired)
    assert len(_service_ips_added(staged.commands)) == 1
    assert staged.counts["elements"] == len(state.index)
    apply(state, kernel, staged, desired, full=True)
    assert state.effective(SERVICE_KEY) == last
    assert_same_as_full(state, kernel)


def test_a_single_claim_costs_a_dict_slot() -> None:
    elements = [Element("hairpin-endpoints", (f"10.0.{i // 250}.{i % 250}",) * 2)
                for i in range(20_000)]
    index = ElementIndex()
    tracemalloc.start()
    try:
        index.replace("owner", (), elements)
        per_claim = tracemalloc.get_traced_memory()[0] / len(elements)
    finally:
        tracemalloc.stop()
    assert len(index) == len(elements)
    # a dict slot is ~30 bytes; a (set, key) tuple and a claim tuple per key were ~200
    assert per_claim < 80


def _retained_per_claim(index: ElementIndex, name: str) -> float:
    """Bytes per claim the index keeps once the rendered elements are gone."""
    count = 20_000
    tracemalloc.start()
    try:
        elements = [Element(name, (f"10.96.{s // 250}.{s % 250}", "tcp", 80, i))
                    for s in range(count // 10) for i in range(10)]
        index.replace("owner", (), elements)
        assert index.winner(name, elements[7].key) == "owner"
        del elements
        return tracemalloc.get_traced_memory()[0] / count
    finally:
        tracemalloc.stop()


def test_an_endpoint_index_claim_costs_a_list_slot_and_keeps_no_key() -> None:
    name = "vip-endpoints-tcp"
    assert is_indexed_map(name) and not is_indexed_map("service-ips")
    grouped = _retained_per_claim(ElementIndex(), name)
    keyed = _retained_per_claim(ElementIndex(indexed=lambda _: False), name)
    # a key tuple (and its address) and a dict slot per claim, against a
    # list slot and a tenth of its chooser's list, key and dict slot
    assert keyed > 120 and grouped < 60


_OWNERS = ("a", "b", "c")
_STEPS = st.lists(
    st.tuples(st.sampled_from(_OWNERS), st.booleans(), st.sampled_from(("m", "n")),
              st.sampled_from(((1, 2), (1, 3), (4,))), st.integers(0, 5)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(steps=_STEPS)
def test_an_index_grouped_by_chooser_answers_as_one_keyed_by_element(
    steps: list[tuple[str, bool, str, tuple[int, ...], int]],
) -> None:
    grouped, flat = ElementIndex(indexed=lambda _: True), ElementIndex(indexed=lambda _: False)
    for owner, claims, name, prefix, i in steps:
        for index in (grouped, flat):
            (index.claim if claims else index.release)(owner, name, (*prefix, i))
        assert len(grouped) == len(flat)
        assert sorted(grouped.items()) == sorted(flat.items())
        for key in [(*p, j) for p in ((1, 2), (1, 3), (4,)) for j in range(7)]:
            assert grouped.owners(name, key) == flat.owners(name, key)
            assert grouped.winner(name, key) == flat.winner(name, key)
    for owner in _OWNERS:
        ids = [elem_id for elem_id, owners in flat.items() if owner in owners]
        mine = [Element(name, key) for name, key in ids]
        assert list(grouped.won(owner, mine)) == list(flat.won(owner, mine))
