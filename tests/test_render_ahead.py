"""A full sync's next chunk is rendered while the current one commits (agent/chunked.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from nftproxy.agent.chunked import _rendered_ahead

WAIT = 10.0


def test_items_come_in_order_and_all_of_them() -> None:
    assert list(_rendered_ahead(iter(range(7)))) == list(range(7))
    assert list(_rendered_ahead(iter(()))) == []


def test_the_next_item_is_computed_while_the_caller_holds_the_current_one() -> None:
    asked = [threading.Event() for _ in range(3)]

    def source() -> Iterator[int]:
        for i in range(3):
            asked[i].set()
            yield i

    ahead = _rendered_ahead(source())
    assert next(ahead) == 0
    # The caller is still "committing" item 0: item 1 is already on its way.
    assert asked[1].wait(WAIT)
    assert not asked[2].is_set()  # one ahead, no more
    assert next(ahead) == 1
    assert asked[2].wait(WAIT)
    assert list(ahead) == [2]


def test_the_work_runs_in_another_thread() -> None:
    threads: list[str] = []

    def source() -> Iterator[int]:
        for i in range(2):
            threads.append(threading.current_thread().name)
            yield i

    assert list(_rendered_ahead(source())) == [0, 1]
    assert all(name.startswith("render-ahead") for name in threads)


def test_an_error_of_the_source_reaches_the_caller_at_its_item() -> None:
    def source() -> Iterator[int]:
        yield 0
        raise ValueError("bad chunk")

    ahead = _rendered_ahead(source())
    assert next(ahead) == 0
    with pytest.raises(ValueError, match="bad chunk"):
        next(ahead)


def test_closing_early_stops_the_thread_and_takes_no_more_items() -> None:
    taken: list[int] = []

    def source() -> Iterator[int]:
        for i in range(100):
            taken.append(i)
            yield i

    ahead = _rendered_ahead(source())
    assert next(ahead) == 0
    ahead.close()
    assert taken == [0, 1]
    assert not [t for t in threading.enumerate() if t.name.startswith("render-ahead")]
