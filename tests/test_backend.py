"""kernel.libnftables, kernel.fake and nft.errors: the Backend seam, real and fake.

Aspects:
- errors: libnftables' text maps to the type the caller acts on; parse
  errors name the offending command of the caller's list;
- NftBackend in a throwaway netns: a small table goes in as one commit and
  reads back (full listing and declarations); a refused commit raises the
  typed error and leaves the kernel as it was; a foreign table is never
  touched; delete_tables is idempotent; the context is bound to the netns,
  not the host; fresh contexts; concurrent callers;
- FakeBackend: kernel refusals, atomicity, and the same outcome and the same
  listing as the kernel for one scenario of commits, failing ones included:
  every refusal the planner relies on (ENOENT, EEXIST, EBUSY, EOPNOTSUPP,
  EMLINK), when a set is "dynamic" (created in one batch with a rule that
  updates it), so that re-adding it is refused, and declarations by typeof
  (refused by libnftables 1.0.6's JSON, listed by typeof by 1.1.x; the fake
  is told which userspace it stands beside).
Listings are compared per kind of object (sets and maps, then chains, then
rules, each in the order listed): 1.0.6 lists sets before chains, 1.1.x after.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import kernel
import pytest

from nftproxy.core.nft.errors import (
    NftBusy,
    NftError,
    NftExists,
    NftNotFound,
    NftRejected,
    NftUnavailable,
    rejection,
)
from nftproxy.core.nft.listing import ListedSet, TableListing
from nftproxy.core.nft.ops import Table
from nftproxy.core.nft.seam import Backend
from nftproxy.core.rules.fragment import BaseHook, SetDecl
from nftproxy.kernel import netns as netns_lib
from nftproxy.kernel.fake import FakeBackend
from nftproxy.kernel.libnftables import NftBackend, tune_malloc

Json = dict[str, Any]


# --- command builders (nft-python-notes.md §2 shapes) -----------------------


def _t(table: str) -> Json:
    return {"family": "ip", "table": table}


def add_table(table: str) -> Json:
    return {"add": {"table": {"family": "ip", "name": table}}}


def add_chain(table: str, name: str, **base: Any) -> Json:
    return {"add": {"chain": {**_t(table), "name": name, **base}}}


def add_rule(table: str, chain: str, *expr: Json) -> Json:
    return {"add": {"rule": {**_t(table), "chain": chain, "expr": list(expr)}}}


def verb(v: str, kind: str, table: str, name: str) -> Json:
    return {v: {kind: {**_t(table), "name": name}}}


def goto(target: str) -> Json:
    return {"goto": {"target": target}}


def jump(target: str) -> Json:
    return {"jump": {"target": target}}


def vip(ip: str, port: int) -> Json:
    return {"concat": [ip, "tcp", port]}


def element(v: str, table: str, name: str, *elem: Any) -> Json:
    return {v: {"element": {**_t(table), "name": name, "elem": list(elem)}}}


SADDR = {"payload": {"protocol": "ip", "field": "saddr"}}
DISPATCH = {
    "vmap": {
        "key": {
            "concat": [
                {"payload": {"protocol": "ip", "field": "daddr"}},
                {"meta": {"key": "l4proto"}},
                {"payload": {"protocol": "th", "field": "dport"}},
            ]
        },
        "data": "@service-ips",
    }
}
PREROUTING = {"type": "nat", "hook": "prerouting", "prio": -100, "policy": "accept"}
_RANK = {"table": 0, "set": 1, "map": 1, "chain": 2, "rule": 3}


def in_order(doc: Json | None) -> list[Json] | None:
    """A listing without handles, its objects grouped by kind (stable)."""
    objects = kernel.normalize(doc)
    return None if objects is None else sorted(objects, key=lambda o: _RANK[next(iter(o))])


def small_table(table: str) -> list[Json]:
    """Base chain at an int priority, regular chains, a concat-key verdict
    map with a goto element, a timeout set and a lookup of it."""
    return [
        add_table(table),
        add_chain(table, "nat-prerouting", **PREROUTING),
        add_chain(table, "svc-a"),
        add_chain(table, "ep-1"),
        {
            "add": {
                "map": {
                    **_t(table),
                    "name": "service-ips",
                    "type": ["ipv4_addr", "inet_proto", "inet_service"],
                    "map": "verdict",
                }
            }
        },
        {
            "add": {
                "set": {
                    **_t(table),
                    "name": "aff",
                    "type": "ipv4_addr",
                    "flags": ["timeout"],
                    "timeout": 10800,
                }
            }
        },
        add_rule(table, "nat-prerouting", DISPATCH),
        add_rule(
            table, "svc-a", {"match": {"op": "==", "left": SADDR, "right": "@aff"}}, goto("ep-1")
        ),
        add_rule(table, "svc-a", goto("ep-1")),
        add_rule(table, "ep-1", {"accept": None}),
        element("add", table, "service-ips", [vip("10.96.0.10", 80), goto("svc-a")]),
    ]


def expected_listing(table: str) -> list[Json]:
    t = _t(table)
    return [
        {"table": {"family": "ip", "name": table}},
        {
            "map": {
                "family": "ip",
                "name": "service-ips",
                "table": table,
                "type": ["ipv4_addr", "inet_proto", "inet_service"],
                "map": "verdict",
                "elem": [[vip("10.96.0.10", 80), goto("svc-a")]],
            }
        },
        {
            "set": {
                "family": "ip",
                "name": "aff",
                "table": table,
                "type": "ipv4_addr",
                "flags": ["timeout"],
                "timeout": 10800,
            }
        },
        {"chain": {**t, "name": "nat-prerouting", **PREROUTING}},
        {"chain": {**t, "name": "svc-a"}},
        {"chain": {**t, "name": "ep-1"}},
        {"rule": {**t, "chain": "nat-prerouting", "expr": [DISPATCH]}},
        {
            "rule": {
                **t,
                "chain": "svc-a",
                "expr": [{"match": {"op": "==", "left": SADDR, "right": "@aff"}}, goto("ep-1")],
            }
        },
        {"rule": {**t, "chain": "svc-a", "expr": [goto("ep-1")]}},
        {"rule": {**t, "chain": "ep-1", "expr": [{"accept": None}]}},
    ]


def expected_objects(table: str) -> TableListing:
    return TableListing(
        chains={
            "nat-prerouting": BaseHook("nat", "prerouting", -100),
            "svc-a": None,
            "ep-1": None,
        },
        sets={
            "aff": ListedSet("aff", ("ipv4_addr",), None, ("timeout",), 10800),
            "service-ips": ListedSet(
                "service-ips", ("ipv4_addr", "inet_proto", "inet_service"), "verdict"
            ),
        },
    )


@pytest.fixture
def nft(netns: str) -> Iterator[NftBackend]:
    with NftBackend(netns=netns) as backend:
        yield backend


@pytest.fixture
def fake() -> Iterator[FakeBackend]:
    backend = FakeBackend()
    backend.start()
    yield backend
    backend.close()


# --- errors ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        ("internal:0:0-0: Error: Could not process rule: No such file or directory", NftNotFound),
        (
            "Error: No such file or directory; did you mean chain \u2018x\u2019 in table ip"
            " \u2018t\u2019?",
            NftNotFound,
        ),
        ("internal:0:0-0: Error: Could not process rule: File exists", NftExists),
        ("internal:0:0-0: Error: Could not process rule: Device or resource busy", NftBusy),
        ("internal:0:0-0: Error: Could not process rule: Operation not supported", NftRejected),
        ("Error: Could not process rule: File exists\nNo such file or directory", NftExists),
    ],
    ids=["enoent", "enoent from the cache", "eexist", "ebusy", "other errno", "first errno wins"],
)
def test_error_text_maps_to_the_type_the_caller_acts_on(
    message: str, kind: type[NftRejected]
) -> None:
    error = rejection(message)
    assert type(error) is kind
    assert error.kernel_message == message
    assert error.command_index is None


def test_a_parse_error_names_the_command_of_the_callers_list() -> None:
    commands = [add_table("t"), {"bogus": {}}]
    text = (
        "Error: Unknown object passed to add command.\n"
        "Error: Parsing command array at index 2 failed."
    )
    error = rejection(text, commands, first_index=1)  # index 0 was the metainfo
    assert (error.command_index, error.command) == (1, {"bogus": {}})
    assert "command 1" in str(error)


def test_an_index_outside_the_callers_list_is_not_reported() -> None:
    error = rejection("Parsing command array at index 0 failed.", [add_table("t")], first_index=1)
    assert error.command_index is None and error.command is None


def test_all_errors_share_one_base() -> None:
    for cls in (NftUnavailable, NftRejected, NftNotFound, NftExists, NftBusy):
        assert issubclass(cls, NftError)


def test_malloc_can_be_tuned() -> None:
    assert tune_malloc() is True


# --- NftBackend against the kernel -----------------------------------------


def test_a_small_table_commits_and_reads_back(nft: NftBackend) -> None:
    nft.commit(small_table("px"))
    assert in_order(nft.list_table("ip", "px")) == expected_listing("px")
    assert nft.list_table_objects("ip", "px") == expected_objects("px")


def test_listing_a_missing_table_gives_none(nft: NftBackend, netns: str) -> None:
    kernel.nft(netns, "add", "table", "ip6", "px")  # same name, other family
    kernel.nft(netns, "add", "table", "ip", "other")
    assert nft.list_table("ip", "px") is None
    assert nft.list_table_objects("ip", "px") is None


def test_declarations_are_read_from_this_table_only(nft: NftBackend, netns: str) -> None:
    kernel.nft(netns, "-f", "-", stdin="table ip other { set s { type ipv4_addr; }; chain c { }; }")
    nft.commit(small_table("px"))
    assert nft.list_table_objects("ip", "px") == expected_objects("px")


def test_run_json_returns_the_parsed_listing(nft: NftBackend) -> None:
    nft.commit(small_table("px"))
    doc = nft.run_json({"list": {"chains": {"family": "ip"}}})
    assert "metainfo" in doc["nftables"][0]
    assert [o["chain"]["name"] for o in doc["nftables"][1:]] == ["nat-prerouting", "svc-a", "ep-1"]


REFUSED = [
    pytest.param([add_rule("px", "ep-1", goto("nowhere"))], NftNotFound, id="goto a missing chain"),
    pytest.param([verb("delete", "chain", "px", "svc-a")], NftBusy, id="delete a mapped chain"),
    pytest.param(
        [element("add", "px", "service-ips", [vip("10.96.0.10", 80), goto("ep-1")])],
        NftExists,
        id="element with another verdict",
    ),
    pytest.param(
        [add_rule("px", "ep-1", {"match": {"op": "==", "left": SADDR, "right": "@nope"}})],
        NftNotFound,
        id="lookup of a missing set",
    ),
    pytest.param([verb("flush", "chain", "px", "nope")], NftNotFound, id="flush a missing chain"),
]


@pytest.mark.parametrize(("bad", "error"), REFUSED)
def test_a_refused_commit_raises_and_changes_nothing(
    nft: NftBackend, bad: list[Json], error: type[NftRejected]
) -> None:
    nft.commit(small_table("px"))
    before = nft.list_table("ip", "px")
    with pytest.raises(error) as info:
        nft.commit([add_chain("px", "new-chain"), verb("flush", "chain", "px", "svc-a"), *bad])
    assert info.value.kernel_message.startswith(("internal:0:0-0: Error:", "Error:"))
    assert nft.list_table("ip", "px") == before


def test_a_parse_error_names_the_offending_command(nft: NftBackend) -> None:
    nft.commit(small_table("px"))
    before = nft.list_table("ip", "px")
    bad = {"add": {"chain": {**_t("px")}}}  # no name
    with pytest.raises(NftRejected) as info:
        nft.commit([add_chain("px", "new-chain"), bad])
    assert (info.value.command_index, info.value.command) == (1, bad)
    assert nft.list_table("ip", "px") == before


FOREIGN = """table ip foreign {
  set s { type ipv4_addr; elements = { 10.1.1.1 } }
  chain c { ip saddr @s counter accept; }
  chain in { type filter hook input priority 0; policy accept; jump c; }
}
"""


def test_a_foreign_table_is_never_touched(nft: NftBackend, netns: str) -> None:
    kernel.nft(netns, "-f", "-", stdin=FOREIGN)
    before = kernel.nft(netns, "list", "table", "ip", "foreign")
    nft.commit(small_table("px"))
    with pytest.raises(NftNotFound):
        nft.commit([add_rule("px", "ep-1", goto("nowhere"))])
    nft.delete_tables("px")
    nft.delete_tables("px")
    assert kernel.nft(netns, "list", "table", "ip", "foreign") == before
    assert "px" not in kernel.nft(netns, "list", "tables")


def test_delete_tables_removes_both_families_and_is_idempotent(nft: NftBackend, netns: str) -> None:
    nft.delete_tables("px")  # nothing there: fine
    nft.commit(small_table("px"))
    kernel.nft(netns, "add", "table", "ip6", "px")
    kernel.nft(netns, "add", "table", "inet", "px")
    nft.delete_tables("px")
    assert kernel.nft(netns, "list", "tables").split("\n") == ["table inet px", ""]


def test_the_context_is_bound_to_the_namespace(nft: NftBackend, netns: str) -> None:
    table = kernel.unique_name()
    nft.commit([add_table(table)])
    assert f"table ip {table}" in kernel.nft(netns, "list", "tables")
    assert table not in kernel.host_nft("list", "tables")


def test_a_fresh_context_commits_in_the_namespace_too(nft: NftBackend, netns: str) -> None:
    table = kernel.unique_name()
    nft.commit(small_table(table), fresh=True)
    assert table not in kernel.host_nft("list", "tables")
    # the long-lived context sees it (its cache is refreshed), and builds on it
    nft.commit([add_chain(table, "later")])
    objects = nft.list_table_objects("ip", table)
    assert objects is not None and "later" in objects.chains


def test_callers_on_many_threads_are_serialised(nft: NftBackend) -> None:
    nft.commit([add_table("px")])

    def worker(i: int) -> None:
        for j in range(10):
            nft.commit([add_chain("px", f"c{i}-{j}")])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    objects = nft.list_table_objects("ip", "px")
    assert objects is not None and len(objects.chains) == 80


@pytest.mark.kernel
def test_a_missing_namespace_makes_the_backend_unavailable() -> None:
    name = f"{kernel.NETNS_PREFIX}-missing-{kernel.unique_name()}"
    backend = NftBackend(netns=name)
    with pytest.raises(NftUnavailable) as info:
        backend.start()
    assert isinstance(info.value.__cause__, OSError)
    assert not netns_lib.exists(name)


def test_an_empty_commit_touches_nothing() -> None:
    NftBackend(netns="never-entered").commit([])  # not even started
    FakeBackend().commit([])


@pytest.mark.parametrize("backend", [NftBackend(), FakeBackend()], ids=["nft", "fake"])
def test_calls_before_start_are_refused(backend: Backend) -> None:
    with pytest.raises(RuntimeError):
        backend.commit([add_table("px")])
    with pytest.raises(RuntimeError):
        backend.list_table("ip", "px")


def test_close_is_idempotent_and_final(netns: str) -> None:
    backend = NftBackend(netns=netns)
    backend.start()
    backend.close()
    backend.close()
    with pytest.raises(RuntimeError):
        backend.commit([add_table("px")])


# --- FakeBackend alone -------------------------------------------------------


def test_fake_keeps_nothing_of_a_refused_commit(fake: FakeBackend) -> None:
    fake.commit(small_table("px"))
    before = fake.list_table("ip", "px")
    with pytest.raises(NftNotFound) as info:
        fake.commit(
            [
                add_chain("px", "x"),
                verb("flush", "chain", "px", "svc-a"),
                verb("delete", "set", "px", "nope"),
            ]
        )
    assert info.value.command_index == 2
    assert fake.list_table("ip", "px") == before


def test_fake_replaces_a_verdict_by_delete_and_add_in_one_commit(fake: FakeBackend) -> None:
    fake.commit(small_table("px"))
    fake.commit(
        [
            element("delete", "px", "service-ips", vip("10.96.0.10", 80)),
            element("add", "px", "service-ips", [vip("10.96.0.10", 80), goto("ep-1")]),
        ]
    )
    listing = fake.list_table("ip", "px")
    assert listing is not None
    assert listing["nftables"][1]["map"]["elem"] == [[vip("10.96.0.10", 80), goto("ep-1")]]


def test_fake_frees_a_chain_once_its_last_reference_goes(fake: FakeBackend) -> None:
    fake.commit(small_table("px"))
    with pytest.raises(NftBusy):
        fake.commit([verb("delete", "chain", "px", "ep-1")])  # svc-a's rules
    fake.commit([verb("flush", "chain", "px", "svc-a"), verb("delete", "chain", "px", "ep-1")])
    with pytest.raises(NftBusy):
        fake.commit([verb("delete", "chain", "px", "svc-a")])  # the map element
    fake.commit([verb("flush", "map", "px", "service-ips"), verb("delete", "chain", "px", "svc-a")])


def test_fake_refuses_what_it_does_not_model(fake: FakeBackend) -> None:
    with pytest.raises(NotImplementedError):
        fake.commit([{"replace": {"rule": {**_t("px"), "chain": "c", "handle": 1, "expr": []}}}])


# --- FakeBackend and the kernel agree ----------------------------------------

E = "agree"


def _rule_in(chain: str) -> list[Json]:
    return [add_rule(E, chain, {"accept": None})]


def add_set(name: str, *, timeout: int | None = 60) -> Json:
    """An affinity set as the renderer declares it (plain JSON: no "dynamic")."""
    spec = {**_t(E), "name": name, "type": "ipv4_addr", "flags": ["timeout"]}
    if timeout is not None:
        spec["timeout"] = timeout
    return {"add": {"set": spec}}


def updating(name: str, op: str = "update") -> Json:
    """A rule in chain "users" that records the source address in `name`."""
    return add_rule(E, "users", {"set": {"op": op, "set": f"@{name}", "elem": SADDR}})


DYNAMIC_SETS: list[tuple[str, list[Json]]] = [
    # libnftables 1.0.6 evaluates a batch as a whole: a set the batch creates
    # and a rule of it updates is created "dynamic"; plain JSON cannot say so.
    (
        "a set created in one batch with its update rule",
        [add_set("dyn"), add_chain(E, "users"), updating("dyn")],
    ),
    ("re-adding that (dynamic) set is refused", [add_set("dyn")]),
    (
        "a full sync that re-adds it is refused",
        [verb("flush", "chain", E, "users"), add_set("dyn"), updating("dyn")],
    ),
    ("a dynamic set can be flushed", [verb("flush", "set", E, "dyn")]),
    ("a set created before its update rule", [add_set("late")]),
    ("... gets its update rule later", [updating("late", "add")]),
    ("... stays plain: re-adding it is fine", [add_set("late")]),
    ("... with another timeout, which it takes", [add_set("late", timeout=90)]),
    ("... or with none, which clears it", [add_set("late", timeout=None)]),
    (
        "one batch may not create, update and re-add a set",
        [add_set("once"), updating("once", "add"), add_set("once")],
    ),
    ("... nor re-add it before the update", [add_set("once"), add_set("once"), updating("once")]),
    (
        "a rule flushed in the batch still made the set dynamic",
        [add_set("gone"), updating("gone"), verb("flush", "chain", E, "users"), updating("late")],
    ),
    ("... so re-adding it is refused", [add_set("gone")]),
    (
        "delete and re-add with its rule: dynamic again",
        [
            verb("flush", "chain", E, "users"),
            verb("delete", "set", E, "dyn"),
            add_set("dyn", timeout=90),
            updating("dyn"),
        ],
    ),
    ("... and refused again", [add_set("dyn", timeout=90)]),
    ("a set in use by an update rule is busy", [verb("delete", "set", E, "dyn")]),
]

_TYPEOF = Table("ip", E, typeof=True)
BY_TYPEOF = [
    _TYPEOF.add_set(
        SetDecl.keyed("typeof-map", ("ip daddr", "meta l4proto", "th dport"), map="verdict")
    ),
    _TYPEOF.add_set(SetDecl.keyed("typeof-set", ("ip saddr",), flags=("interval",))),
]

SCENARIO: list[tuple[str, list[Json]]] = [
    ("build the small table", small_table(E)),
    ("re-adding identical objects is a no-op", small_table(E)[1:]),
    (
        "an element with another verdict is refused",
        [element("add", E, "service-ips", [vip("10.96.0.10", 80), goto("ep-1")])],
    ),
    (
        "delete and add changes the verdict",
        [
            element("delete", E, "service-ips", vip("10.96.0.10", 80)),
            element("add", E, "service-ips", [vip("10.96.0.10", 80), goto("ep-1")]),
            element("add", E, "service-ips", [vip("10.96.0.11", 443), goto("svc-a")]),
        ],
    ),
    ("a chain held by a map element is busy", [verb("delete", "chain", E, "svc-a")]),
    ("a chain held by a rule is busy", [verb("delete", "chain", E, "ep-1")]),
    ("goto to a missing chain", [add_rule(E, "svc-a", goto("absent-one"))]),
    (
        "element goto to a missing chain",
        [element("add", E, "service-ips", [vip("10.96.0.12", 80), goto("absent-one")])],
    ),
    (
        "lookup of a missing set",
        [add_rule(E, "svc-a", {"match": {"op": "==", "left": SADDR, "right": "@nope"}})],
    ),
    ("flush of a missing chain", [verb("flush", "chain", E, "absent-one")]),
    ("delete of a missing set", [verb("delete", "set", E, "absent-one")]),
    ("delete of a missing element", [element("delete", E, "service-ips", vip("10.9.9.9", 1))]),
    (
        "a valid flush with a bad delete is all or nothing",
        [verb("flush", "chain", E, "svc-a"), verb("delete", "chain", E, "absent-one")],
    ),
    ("a loop reachable from a base chain", [add_rule(E, "ep-1", jump("svc-a"))]),
    ("a jump to a base chain", [add_rule(E, "ep-1", jump("nat-prerouting"))]),
    (
        "a set re-declared with other flags",
        [{"add": {"set": {**_t(E), "name": "aff", "type": "ipv4_addr"}}}],
    ),
    (
        "a regular chain re-added as a base chain",
        [add_chain(E, "ep-1", type="filter", hook="input", prio=0)],
    ),
    ("... with a policy", [add_chain(E, "ep-1", **PREROUTING)]),
    ("a base chain re-hooked", [add_chain(E, "nat-prerouting", **{**PREROUTING, "prio": -90})]),
    (
        "a base chain's policy can change",
        [add_chain(E, "nat-prerouting", **{**PREROUTING, "policy": "drop"})],
    ),
    ("a set held by a rule is busy", [verb("delete", "set", E, "aff")]),
    ("a chain with rules is deleted with them", [add_chain(E, "full"), *_rule_in("full")]),
    ("... also in one batch", [verb("delete", "chain", E, "full")]),
    (
        "... when created in the same batch",
        [add_chain(E, "x"), *_rule_in("x"), verb("delete", "chain", E, "x")],
    ),
    ("a rule in a missing chain", _rule_in("absent-one")),
    (
        "an element into a missing map",
        [element("add", E, "nope", [vip("10.9.9.9", 1), goto("ep-1")])],
    ),
    ("a flush of a missing map", [verb("flush", "map", E, "nope")]),
    ("sets declared by typeof (1.0.6's JSON refuses them)", BY_TYPEOF),
    ("... re-declared identically", BY_TYPEOF),
    (
        "... with an element",
        [element("add", E, "typeof-map", [vip("10.96.0.30", 80), goto("svc-a")])],
    ),
    *DYNAMIC_SETS,
    (
        "idempotent delete of an absent chain",
        [
            add_chain(E, "gone"),
            verb("flush", "chain", E, "gone"),
            verb("delete", "chain", E, "gone"),
        ],
    ),
    (
        "flush table drops rules, keeps elements",
        [{"flush": {"table": {"family": "ip", "name": E}}}],
    ),
    (
        "now the set and chains can go",
        [
            verb("delete", "set", E, "aff"),
            verb("delete", "chain", E, "ep-1"),
            verb("delete", "map", E, "service-ips"),
            verb("delete", "chain", E, "svc-a"),
        ],
    ),
    ("delete the table", [{"delete": {"table": {"family": "ip", "name": E}}}]),
    ("delete it again", [{"delete": {"table": {"family": "ip", "name": E}}}]),
]


def _outcome(backend: Backend, commands: list[Json]) -> str:
    try:
        backend.commit(commands)
    except NftRejected as exc:
        return type(exc).__name__
    return "ok"


def test_fake_and_kernel_agree_on_every_step(nft: NftBackend) -> None:
    seen = []
    fake = FakeBackend(version="1.1" if nft.accepts_typeof() else "1.0.6")  # nft's userspace
    fake.start()
    for step, commands in SCENARIO:
        outcome = _outcome(nft, commands)
        assert _outcome(fake, commands) == outcome, step
        assert in_order(fake.list_table("ip", E)) == in_order(nft.list_table("ip", E)), step
        assert fake.list_table_objects("ip", E) == nft.list_table_objects("ip", E), step
        seen.append(outcome)
    # the scenario exercises every outcome type
    assert set(seen) == {"ok", "NftNotFound", "NftExists", "NftBusy", "NftRejected"}
