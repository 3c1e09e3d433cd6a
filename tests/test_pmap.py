"""PersistentMap: a mapping like a dict, whose edits never change a map already handed out."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nftproxy.core.pmap import SHARDS, PersistentMap


def test_reads_like_the_dict_it_was_built_from() -> None:
    d = {f"k{i}": i for i in range(300)}
    m = PersistentMap(d)
    assert len(m) == 300
    assert m == d
    assert dict(m.items()) == d
    assert sorted(m) == sorted(d)
    assert sorted(m.values()) == sorted(d.values())
    assert m["k7"] == 7 and m.get("k7") == 7
    assert m.get("nope") is None and m.get("nope", -1) == -1
    assert "k7" in m and "nope" not in m
    with pytest.raises(KeyError):
        m["nope"]
    assert m.keys() | {"x"} == set(d) | {"x"}


def test_an_edit_leaves_the_map_it_started_from_as_it_was() -> None:
    old = PersistentMap({i: str(i) for i in range(1000)})
    edit = old.edit()
    edit[5] = "five"
    edit[1000] = "new"
    del edit[6]
    assert edit.pop(7) == "7"
    assert edit.pop(7, None) is None
    with pytest.raises(KeyError):
        del edit[6]
    new = edit.done()
    assert old == {i: str(i) for i in range(1000)}
    assert len(new) == 999
    assert new[5] == "five" and new[1000] == "new"
    assert 6 not in new and 7 not in new


def test_an_edit_copies_only_the_shards_it_changes() -> None:
    old = PersistentMap({i: i for i in range(SHARDS * 10)})
    edit = old.edit()
    edit[3] = -3
    new = edit.done()
    shared = sum(a is b for a, b in zip(old._shards, new._shards, strict=True))
    assert shared == SHARDS - 1


def test_changes_after_done_do_not_reach_the_map_done_returned() -> None:
    edit = PersistentMap({1: 1}).edit()
    edit[1] = 2
    first = edit.done()
    edit[1] = 3
    del edit[1]
    assert first == {1: 2}
    assert edit.done() == {}


ops = st.lists(st.tuples(st.booleans(), st.integers(0, 200), st.integers()), max_size=60)


@given(st.dictionaries(st.integers(0, 200), st.integers(), max_size=100), st.lists(ops, max_size=5))
def test_a_chain_of_edits_matches_dicts_and_every_earlier_map_stays(
    start: dict[int, int], rounds: list[list[tuple[bool, int, int]]]
) -> None:
    maps = [PersistentMap(start)]
    expected = [dict(start)]
    for changes in rounds:
        edit, model = maps[-1].edit(), dict(expected[-1])
        for is_set, key, value in changes:
            if is_set:
                edit[key] = value
                model[key] = value
            else:
                assert edit.pop(key) == model.pop(key, None)
        maps.append(edit.done())
        expected.append(model)
    for m, d in zip(maps, expected, strict=True):
        assert len(m) == len(d)
        assert dict(m.items()) == d
