"""Elements written as JSON text are the bytes `json.dumps` makes of their
objects, and an ElementList reads as the list of those objects.

core/nft/jsontext.py: a full sync writes its ~180,000 elements straight
from the Element values; libnftables must receive exactly what the objects
say, and everyone who reads a command (the fake backend, error messages,
tests) must see the objects.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from nftproxy.core.nft.errors import rejection
from nftproxy.core.nft.jsontext import (
    ElementList,
    command_text,
    element_json,
    element_text,
    transaction_text,
)
from nftproxy.core.nft.ops import Table
from nftproxy.core.rules import names
from nftproxy.core.rules.fragment import Element, Target, Verdict


def dumps(doc: Any) -> str:
    return json.dumps(doc, separators=(",", ":"))


_TEXT = st.text(min_size=1, max_size=140)  # non-ASCII, quotes, controls; over the comment budget
_PARTS = st.one_of(
    st.integers(min_value=0, max_value=2**32),
    st.sampled_from(["10.96.0.1", "fd00::1", "tcp", "10.0.0.0/8", "fd00::/64", "192.0.2.7/32"]),
    _TEXT.filter(lambda s: "/" not in s),  # a "/" says CIDR: render makes only valid ones
)
_VALUES = st.one_of(
    st.none(),
    st.builds(Target, st.sampled_from(["10.128.0.5", "fd00:10::5"]), st.integers(1, 65535)),
    st.builds(Verdict, st.sampled_from(["goto", "jump"]), st.sampled_from(["dispatch-2", "K-X"])),
    st.builds(Verdict, st.sampled_from(["drop", "accept"])),
)
_ELEMENTS = st.builds(
    Element,
    st.sampled_from(["service-ips", "vip-endpoints-tcp"]),
    st.lists(_PARTS, min_size=1, max_size=4).map(tuple),
    _VALUES,
    st.one_of(st.none(), _TEXT),
)


@settings(max_examples=500)
@given(element=_ELEMENTS, with_comment=st.booleans())
def test_an_element_as_text_is_the_dump_of_its_objects(
    element: Element, with_comment: bool
) -> None:
    text = element_text(element, with_comment=with_comment)
    assert text == dumps(element_json(element, with_comment=with_comment))


@settings(max_examples=200)
@given(elements=st.lists(_ELEMENTS, max_size=6))
def test_an_add_elements_command_is_sent_as_the_dump_of_its_objects(
    elements: list[Element],
) -> None:
    commands = Table("ip", "nftproxy").add_elements("service-ips", elements)
    as_lists = [
        {"add": {"element": {**c["add"]["element"], "elem": list(c["add"]["element"]["elem"])}}}
        for c in commands
    ]
    assert [command_text(c) for c in commands] == [dumps(c) for c in as_lists]
    assert transaction_text(commands, head={"metainfo": {"json_schema_version": 1}}) == dumps(
        {"nftables": [{"metainfo": {"json_schema_version": 1}}, *as_lists]}
    )


def test_an_element_list_reads_as_the_list_of_its_objects() -> None:
    a = Element("vip-endpoints-tcp", ("10.96.0.1", 80, 0), Target("10.128.0.5", 8080),
                "ns/web:http")
    b = Element("service-ips", ("10.96.0.1", "tcp", 80), Verdict("goto", "dispatch-tcp-1"))
    elems = ElementList((a, b), with_comment=True)
    objects = [element_json(a, with_comment=True), element_json(b, with_comment=True)]
    assert objects[0] == [
        {"elem": {"val": {"concat": ["10.96.0.1", 80, 0]}, "comment": "ns/web:http"}},
        {"concat": ["10.128.0.5", 8080]},
    ]
    assert len(elems) == 2 and list(elems) == objects
    assert elems == objects and objects == elems and elems == tuple(objects)
    assert elems[1] == objects[1] and elems[-1:] == objects[-1:]
    assert elems != objects[:1] and elems != "not a list"
    assert repr(elems) == repr(objects)
    assert ElementList((a,), with_comment=False)[0][0] == {"concat": ["10.96.0.1", 80, 0]}


def test_a_long_comment_is_cut_in_the_text_as_in_the_objects() -> None:
    long = "ns/" + "x" * 200 + ":http"
    e = Element("service-ips", ("10.96.0.1", "tcp", 80), None, long)
    (comment,) = [json.loads(element_text(e, with_comment=True))["elem"]["comment"]]
    assert comment == names.comment(long) and len(comment.encode()) <= names.COMMENT_MAX_BYTES


def test_other_commands_are_dumped_as_they_are() -> None:
    rule = {"family": "ip", "table": "t", "chain": "c", "expr": [{"accept": None}]}
    command = {"add": {"rule": rule}}
    assert command_text(command) == dumps(command)
    static = Table("ip", "t").add_set_elements("s", ["10.0.0.1"])[0]
    assert command_text(static) == dumps(static)


def test_a_refusal_shows_the_refused_element_command() -> None:
    e = Element("service-ips", ("10.96.0.1", "tcp", 80), Verdict("goto", "nowhere"), "ns/web:http")
    commands = Table("ip", "nftproxy").add_elements("service-ips", [e])
    message = "Error: Could not process rule: No such file or directory at index 1"
    error = rejection(message, commands, first_index=1)  # after the metainfo
    assert error.command is commands[0]
    assert '"elem":[[{"elem":{"val":{"concat":["10.96.0.1","tcp",80]}' in str(error)
