"""kernel.libnftables, kernel.fake and nft.errors: the Backend seam, real and fake.

Aspects:
- errors: libnftables' text maps to the type the caller acts on; parse
  errors name the offending command of the caller's list;
- NftBackend in a throwaway netns: a small table of typed commands
  (core/nft/commands.py) goes in as one commit and reads back (full listing
  and declarations: by datatype on libnftables 1.0.6, by typeof on 1.1.x);
  a refused commit raises the typed error and leaves the kernel as it was;
  a command libnftables' parser refuses names itself in JSON (1.1.x) and
  changes nothing in either syntax; a foreign table is never touched;
  delete_tables is idempotent; the context is bound to the netns, not the
  host; fresh contexts; concurrent callers;
- declarations: printed in nft's syntax, every set and map (an integer key
  part included) is declared by typeof in the one transaction, on either
  libnftables; the JSON printer is refused on 1.0.6 (its JSON declares no
  set by typeof), real and fake alike;
- FakeBackend: kernel refusals, atomicity, and the same outcome and the same
  listing as the kernel for one scenario of commits, failing ones included,
  printed in nft's syntax and (where libnftables takes it, 1.1.x) in JSON:
  every refusal the planner relies on (ENOENT, EEXIST, EBUSY, EOPNOTSUPP,
  EMLINK), when a set is "dynamic" (created in one batch with a rule that
  updates it), so that re-adding it is refused, and declarations by typeof
  (listed by datatype by 1.0.6, by typeof by 1.1.x; the fake is told which
  userspace it stands beside).
Listings are compared per kind of object (sets and maps, then chains, then
rules, each in the order listed): 1.0.6 lists sets before chains, 1.1.x after.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import kernel
import pytest

from nftproxy.core.nft import nfttext
from nftproxy.core.nft.commands import (
    AddChain,
    AddElements,
    AddRule,
    AddSet,
    AddTable,
    Command,
    DeleteChain,
    DeleteElements,
    DeleteSet,
    DeleteTable,
    FlushChain,
    FlushSet,
    Where,
)
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
from nftproxy.core.nft.ops import Table, typeof_key
from nftproxy.core.nft.seam import Backend
from nftproxy.core.rules.fragment import (
    NUMGEN_KEY,
    BaseHook,
    Element,
    Key,
    Rule,
    SetDecl,
    Verdict,
)
from nftproxy.kernel import netns as netns_lib
from nftproxy.kernel.fake import FakeBackend
from nftproxy.kernel.libnftables import NftBackend, tune_malloc

Json = dict[str, Any]


# --- command builders (typed commands; rule statements as expr.py's JSON) ----


def where(table: str) -> Where:
    return Where("ip", table)


def add_table(table: str) -> Command:
    return AddTable(where(table))


def add_chain(table: str, name: str, hook: BaseHook | None = None) -> Command:
    return AddChain(where(table), name, hook)


def add_rule(table: str, chain: str, *expr: Json) -> Command:
    return AddRule(where(table), chain, Rule(tuple(expr)))


def declare(table: str, decl: SetDecl) -> Command:
    return AddSet(where(table), decl.name, decl)


def verb(v: str, kind: str, table: str, name: str) -> Command:
    """flush|delete chain|set|map."""
    w = where(table)
    if kind == "chain":
        return FlushChain(w, name) if v == "flush" else DeleteChain(w, name)
    is_map = kind == "map"
    return FlushSet(w, name, is_map) if v == "flush" else DeleteSet(w, name, is_map)


def goto(target: str) -> Json:
    """A rule's goto statement."""
    return {"goto": {"target": target}}


def jump(target: str) -> Json:
    return {"jump": {"target": target}}


def vip(ip: str, port: int) -> Key:
    return (ip, "tcp", port)


def vip_json(ip: str, port: int) -> Json:
    """`vip(ip, port)` as libnftables lists it."""
    return {"concat": [ip, "tcp", port]}


def add_element(table: str, name: str, key: Key, target: str) -> Command:
    """A verdict map element: `key` goes to chain `target`."""
    return AddElements(where(table), name, (Element(name, key, Verdict("goto", target)),))


def delete_element(table: str, name: str, key: Key) -> Command:
    return DeleteElements(where(table), name, (key,))


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
PREROUTING = BaseHook("nat", "prerouting", -100, "accept")
PREROUTING_JSON = {"type": "nat", "hook": "prerouting", "prio": -100, "policy": "accept"}
SERVICE_IPS = SetDecl.keyed("service-ips", ("ip daddr", "meta l4proto", "th dport"), map="verdict")
AFF = SetDecl.keyed("aff", ("ip saddr",), flags=("timeout",), timeout=10800)
_RANK = {"table": 0, "set": 1, "map": 1, "chain": 2, "rule": 3}


def in_order(doc: Json | None) -> list[Json] | None:
    """A listing without handles, its objects grouped by kind (stable)."""
    objects = kernel.normalize(doc)
    return None if objects is None else sorted(objects, key=lambda o: _RANK[next(iter(o))])


def small_table(table: str) -> list[Command]:
    """Base chain at an int priority, regular chains, a concat-key verdict
    map with a goto element, a timeout set and a lookup of it."""
    return [
        add_table(table),
        add_chain(table, "nat-prerouting", PREROUTING),
        add_chain(table, "svc-a"),
        add_chain(table, "ep-1"),
        declare(table, SERVICE_IPS),
        declare(table, AFF),
        add_rule(table, "nat-prerouting", DISPATCH),
        add_rule(
            table, "svc-a", {"match": {"op": "==", "left": SADDR, "right": "@aff"}}, goto("ep-1")
        ),
        add_rule(table, "svc-a", goto("ep-1")),
        add_rule(table, "ep-1", {"accept": None}),
        add_element(table, "service-ips", vip("10.96.0.10", 80), "svc-a"),
    ]


def listed_key(decl: SetDecl, *, v11: bool) -> Any:
    """A declaration's key as libnftables lists it: by typeof on 1.1.x, by
    datatype(s) on 1.0.6 (every set is declared by typeof)."""
    if v11:
        return {"typeof": typeof_key(decl.key)}
    return decl.type[0] if len(decl.type) == 1 else list(decl.type)


def expected_listing(table: str, *, v11: bool) -> list[Json]:
    t = {"family": "ip", "table": table}
    return [
        {"table": {"family": "ip", "name": table}},
        {
            "map": {
                "family": "ip",
                "name": "service-ips",
                "table": table,
                "type": listed_key(SERVICE_IPS, v11=v11),
                "map": "verdict",
                "elem": [[vip_json("10.96.0.10", 80), goto("svc-a")]],
            }
        },
        {
            "set": {
                "family": "ip",
                "name": "aff",
                "table": table,
                "type": listed_key(AFF, v11=v11),
                "flags": ["timeout"],
                "timeout": 10800,
            }
        },
        {"chain": {**t, "name": "nat-prerouting", **PREROUTING_JSON}},
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


def listed_set(decl: SetDecl, *, v11: bool) -> ListedSet:
    """`decl` as list_table_objects reads it back (listing.ListedSet)."""
    if v11:
        return ListedSet(decl.name, (), decl.map, decl.flags, decl.timeout,
                         Table.declared_typeof(decl))
    return ListedSet(decl.name, decl.type, decl.map, decl.flags, decl.timeout)


def expected_objects(*, v11: bool) -> TableListing:
    return TableListing(
        chains={"nat-prerouting": PREROUTING, "svc-a": None, "ep-1": None},
        sets={"aff": listed_set(AFF, v11=v11), "service-ips": listed_set(SERVICE_IPS, v11=v11)},
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
    commands = [add_table("t"), add_chain("t", "c", BaseHook("nat", "nowhere", 0))]
    text = (  # as libnftables 1.1.3 words it
        "internal:0:0-0: Error: Invalid chain hook 'nowhere'.\n\n"
        "internal:0:0-0: Error: Parsing command array at index 2 failed."
    )
    error = rejection(text, commands, first_index=1)  # index 0 was the metainfo
    assert (error.command_index, error.command) == (1, commands[1])
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
    v11 = nft.accepts_typeof()
    nft.commit(small_table("px"))
    assert in_order(nft.list_table("ip", "px")) == expected_listing("px", v11=v11)
    assert nft.list_table_objects("ip", "px") == expected_objects(v11=v11)


def test_listing_a_missing_table_gives_none(nft: NftBackend, netns: str) -> None:
    kernel.nft(netns, "add", "table", "ip6", "px")  # same name, other family
    kernel.nft(netns, "add", "table", "ip", "other")
    assert nft.list_table("ip", "px") is None
    assert nft.list_table_objects("ip", "px") is None


def test_declarations_are_read_from_this_table_only(nft: NftBackend, netns: str) -> None:
    kernel.nft(netns, "-f", "-", stdin="table ip other { set s { type ipv4_addr; }; chain c { }; }")
    nft.commit(small_table("px"))
    assert nft.list_table_objects("ip", "px") == expected_objects(v11=nft.accepts_typeof())


def test_run_json_returns_the_parsed_listing(nft: NftBackend) -> None:
    nft.commit(small_table("px"))
    doc = nft.run_json({"list": {"chains": {"family": "ip"}}})
    assert "metainfo" in doc["nftables"][0]
    assert [o["chain"]["name"] for o in doc["nftables"][1:]] == ["nat-prerouting", "svc-a", "ep-1"]


REFUSED = [
    pytest.param([add_rule("px", "ep-1", goto("nowhere"))], NftNotFound, id="goto a missing chain"),
    pytest.param([verb("delete", "chain", "px", "svc-a")], NftBusy, id="delete a mapped chain"),
    pytest.param(
        [add_element("px", "service-ips", vip("10.96.0.10", 80), "ep-1")],
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
    nft: NftBackend, bad: list[Command], error: type[NftRejected]
) -> None:
    nft.commit(small_table("px"))
    before = nft.list_table("ip", "px")
    with pytest.raises(error) as info:
        nft.commit([add_chain("px", "new-chain"), verb("flush", "chain", "px", "svc-a"), *bad])
    assert info.value.kernel_message.startswith(("internal:0:0-0: Error:", "Error:"))
    assert nft.list_table("ip", "px") == before


def test_a_parse_error_names_the_offending_command(netns: str) -> None:
    """The parse error this test once sent, a chain without a name, can no
    longer be built (commands.py checks names when a command is built). A
    command libnftables' parser refuses -- a hook it does not know -- is
    refused in either syntax with nothing changed; printed in JSON (1.1.x)
    the refusal names the offending command of the caller's list, as a
    JSON parse error does; nft's syntax names none (on 1.0.6, JSON is
    refused at start: kernel.json_backend checks)."""
    with pytest.raises(ValueError):
        add_chain("px", "")
    bad = add_chain("px", "bad-hook", BaseHook("nat", "nowhere", 0))
    with NftBackend(netns=netns) as nft:
        nft.commit(small_table("px"))
        before = nft.list_table("ip", "px")
        with pytest.raises(NftRejected) as info:
            nft.commit([add_chain("px", "new-chain"), bad])
        assert info.value.command_index is None
        assert nft.list_table("ip", "px") == before
    with kernel.json_backend(netns) as json_only:
        if json_only is None:
            return
        with pytest.raises(NftRejected) as info:
            json_only.commit([add_chain("px", "new-chain"), bad])
        assert (info.value.command_index, info.value.command) == (1, bad)
        assert json_only.list_table("ip", "px") == before


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


# --- declarations: by typeof in nft's syntax; JSON only on 1.1.x ----------------

E = "agree"

BY_TYPEOF_DECLS = (
    SetDecl.keyed("typeof-map", ("ip daddr", "meta l4proto", "th dport"), map="verdict"),
    SetDecl.keyed("typeof-set", ("ip saddr",), flags=("interval",)),
    SetDecl.data_map("typeof-endpoints", ("ip daddr", "tcp dport", NUMGEN_KEY),
                     ("ip daddr", "tcp dport")),
)
"""A verdict map, an interval set, and a data map with an integer key part
(as the endpoints maps: libnftables 1.0.6 once declared it only in a
transaction of nft text of its own)."""
_TABLE = Table("ip", E)
BY_TYPEOF = [_TABLE.add_set(decl) for decl in BY_TYPEOF_DECLS]


def test_nft_syntax_declares_every_set_by_typeof_on_either_userspace(
    nft: NftBackend, netns: str
) -> None:
    """Every declaration is printed by typeof, the integer-keyed one too,
    and goes in the same transaction as the rest; the kernel keeps the
    typeof (nft lists it), and libnftables lists it in JSON by datatype on
    1.0.6, by typeof on 1.1.x, as the fake told which it stands beside."""
    assert all(" { typeof " in nfttext.command_text(c) for c in BY_TYPEOF)
    commands = [add_table(E), *BY_TYPEOF]
    nft.commit(commands)
    text = kernel.nft(netns, "list", "table", "ip", E)
    for decl in BY_TYPEOF_DECLS:
        assert f"typeof {' . '.join(decl.key)}" in text, decl.name
    v11 = nft.accepts_typeof()
    objects = nft.list_table_objects("ip", E)
    assert objects is not None
    assert objects.sets["typeof-set"] == listed_set(BY_TYPEOF_DECLS[1], v11=v11)
    fake = FakeBackend(version="1.1" if v11 else "1.0.6")
    fake.start()
    fake.commit(commands)
    assert fake.list_table_objects("ip", E) == objects
    assert in_order(fake.list_table("ip", E)) == in_order(nft.list_table("ip", E))


def test_the_json_printer_is_refused_on_1_0_6(netns: str) -> None:
    """libnftables 1.0.6's JSON declares no set by typeof: a backend
    printing JSON refuses to start beside it (kernel.json_backend checks),
    and so does the fake told it stands beside 1.0.6; beside 1.1.x both
    take the same declarations in JSON and list them by typeof."""
    with pytest.raises(NftUnavailable):
        FakeBackend(version="1.0.6", syntax="json").start()
    fake = FakeBackend(version="1.1", syntax="json")
    fake.start()
    fake.commit([add_table(E), *BY_TYPEOF])
    typeofs = fake.list_table_objects("ip", E)
    assert typeofs is not None
    assert typeofs.sets["typeof-map"] == listed_set(BY_TYPEOF_DECLS[0], v11=True)
    with kernel.json_backend(netns) as json_only:
        if json_only is None:
            return
        json_only.commit([add_table(E), *BY_TYPEOF])
        assert json_only.list_table_objects("ip", E) == typeofs


def test_a_declaration_by_datatype_alone_cannot_be_built() -> None:
    """What the scenario once declared by `type` is declared by its key's
    selectors (SetDecl.keyed); a declaration without them is refused when
    its command is built."""
    with pytest.raises(ValueError):
        declare(E, SetDecl("aff", ("ipv4_addr",)))


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
            delete_element("px", "service-ips", vip("10.96.0.10", 80)),
            add_element("px", "service-ips", vip("10.96.0.10", 80), "ep-1"),
        ]
    )
    listing = fake.list_table("ip", "px")
    assert listing is not None
    assert listing["nftables"][1]["map"]["elem"] == [[vip_json("10.96.0.10", 80), goto("ep-1")]]


def test_fake_frees_a_chain_once_its_last_reference_goes(fake: FakeBackend) -> None:
    fake.commit(small_table("px"))
    with pytest.raises(NftBusy):
        fake.commit([verb("delete", "chain", "px", "ep-1")])  # svc-a's rules
    fake.commit([verb("flush", "chain", "px", "svc-a"), verb("delete", "chain", "px", "ep-1")])
    with pytest.raises(NftBusy):
        fake.commit([verb("delete", "chain", "px", "svc-a")])  # the map element
    fake.commit([verb("flush", "map", "px", "service-ips"), verb("delete", "chain", "px", "svc-a")])


def test_fake_refuses_what_it_does_not_model(fake: FakeBackend) -> None:
    """Nothing it does not model is accepted silently: a command that is
    not a typed one is refused by the printer, and a JSON command it does
    not model (run_json applies what is not a list) raises."""
    replace_rule: Json = {"replace": {"rule": {"family": "ip", "table": "px", "chain": "c",
                                               "handle": 1, "expr": []}}}
    with pytest.raises(TypeError):
        fake.commit([replace_rule])  # type: ignore[list-item]
    with pytest.raises(NotImplementedError):
        fake.run_json(replace_rule)


# --- FakeBackend and the kernel agree ----------------------------------------


def _rule_in(chain: str) -> list[Command]:
    return [add_rule(E, chain, {"accept": None})]


def add_set(name: str, *, timeout: int | None = 60) -> Command:
    """An affinity set, declared without the "dynamic" flag (the kernel
    makes it dynamic or not by what the batch holds)."""
    return declare(E, SetDecl.keyed(name, ("ip saddr",), flags=("timeout",), timeout=timeout))


def updating(name: str, op: str = "update") -> Command:
    """A rule in chain "users" that records the source address in `name`."""
    return add_rule(E, "users", {"set": {"op": op, "set": f"@{name}", "elem": SADDR}})


DYNAMIC_SETS: list[tuple[str, list[Command]]] = [
    # libnftables 1.0.6 evaluates a batch as a whole: a set the batch creates
    # and a rule of it updates is created "dynamic"; these declarations do not say so.
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

CHAINS_LEFT = ("nat-prerouting", "svc-a", "ep-1", "users")
"""The chains of table E when the scenario flushes them all."""

SCENARIO: list[tuple[str, list[Command]]] = [
    ("build the small table", small_table(E)),
    ("re-adding identical objects is a no-op", small_table(E)[1:]),
    (
        "an element with another verdict is refused",
        [add_element(E, "service-ips", vip("10.96.0.10", 80), "ep-1")],
    ),
    (
        "delete and add changes the verdict",
        [
            delete_element(E, "service-ips", vip("10.96.0.10", 80)),
            add_element(E, "service-ips", vip("10.96.0.10", 80), "ep-1"),
            add_element(E, "service-ips", vip("10.96.0.11", 443), "svc-a"),
        ],
    ),
    ("a chain held by a map element is busy", [verb("delete", "chain", E, "svc-a")]),
    ("a chain held by a rule is busy", [verb("delete", "chain", E, "ep-1")]),
    ("goto to a missing chain", [add_rule(E, "svc-a", goto("absent-one"))]),
    (
        "element goto to a missing chain",
        [add_element(E, "service-ips", vip("10.96.0.12", 80), "absent-one")],
    ),
    (
        "lookup of a missing set",
        [add_rule(E, "svc-a", {"match": {"op": "==", "left": SADDR, "right": "@nope"}})],
    ),
    ("flush of a missing chain", [verb("flush", "chain", E, "absent-one")]),
    ("delete of a missing set", [verb("delete", "set", E, "absent-one")]),
    ("delete of a missing element", [delete_element(E, "service-ips", vip("10.9.9.9", 1))]),
    (
        "a valid flush with a bad delete is all or nothing",
        [verb("flush", "chain", E, "svc-a"), verb("delete", "chain", E, "absent-one")],
    ),
    ("a loop reachable from a base chain", [add_rule(E, "ep-1", jump("svc-a"))]),
    ("a jump to a base chain", [add_rule(E, "ep-1", jump("nat-prerouting"))]),
    (
        "a set re-declared with other flags",
        [declare(E, SetDecl.keyed("aff", ("ip saddr",)))],
    ),
    # A typed base chain always says its policy (BaseHook.policy, both
    # printers): a regular chain re-added as one is EOPNOTSUPP; the EEXIST
    # of a re-add that names no policy cannot be sent any more.
    (
        "a regular chain re-added as a base chain (with its policy)",
        [add_chain(E, "ep-1", BaseHook("filter", "input", 0))],
    ),
    ("... as another base chain", [add_chain(E, "ep-1", PREROUTING)]),
    (
        "a base chain re-hooked",
        [add_chain(E, "nat-prerouting", BaseHook("nat", "prerouting", -90))],
    ),
    (
        "a base chain's policy can change",
        [add_chain(E, "nat-prerouting", BaseHook("nat", "prerouting", -100, "drop"))],
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
        [add_element(E, "nope", vip("10.9.9.9", 1), "ep-1")],
    ),
    ("a flush of a missing map", [verb("flush", "map", E, "nope")]),
    ("sets declared by typeof (an integer key part too)", BY_TYPEOF),
    ("... re-declared identically", BY_TYPEOF),
    (
        "... with an element",
        [add_element(E, "typeof-map", vip("10.96.0.30", 80), "svc-a")],
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
        # no command flushes a table (what `flush table` did here): every chain instead
        "flushing every chain drops rules, keeps elements",
        [verb("flush", "chain", E, chain) for chain in CHAINS_LEFT],
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
    ("delete the table", [DeleteTable(where(E))]),
    ("delete it again", [DeleteTable(where(E))]),
]


def _outcome(backend: Backend, commands: list[Command]) -> str:
    try:
        backend.commit(commands)
    except NftRejected as exc:
        return type(exc).__name__
    return "ok"


@pytest.mark.parametrize("syntax", ["nft", "json"])
def test_fake_and_kernel_agree_on_every_step(netns: str, syntax: str) -> None:
    """Each step has the same outcome and leaves the same listing on the
    kernel and on the fake told which libnftables it stands beside, both
    printing the same syntax; JSON only beside 1.1.x (on 1.0.6 the kernel
    backend's refusal is checked by kernel.json_backend, the fake's here)."""
    with NftBackend(netns=netns) as probe:
        version = "1.1" if probe.accepts_typeof() else "1.0.6"
    fake = FakeBackend(version=version, syntax=syntax)
    with contextlib.ExitStack() as stack:
        if syntax == "nft":
            nft: NftBackend | None = stack.enter_context(NftBackend(netns=netns))
        else:
            nft = stack.enter_context(kernel.json_backend(netns))
        if nft is None:
            with pytest.raises(NftUnavailable):
                fake.start()
            return
        fake.start()
        seen = []
        for step, commands in SCENARIO:
            outcome = _outcome(nft, commands)
            assert _outcome(fake, commands) == outcome, step
            assert in_order(fake.list_table("ip", E)) == in_order(nft.list_table("ip", E)), step
            assert fake.list_table_objects("ip", E) == nft.list_table_objects("ip", E), step
            seen.append(outcome)
    # the scenario exercises every outcome type
    assert set(seen) == {"ok", "NftNotFound", "NftExists", "NftBusy", "NftRejected"}
