"""agent/heap.py: what the agent's heap policy does to the garbage collector
and the interpreter's switch interval.

The policy is process-wide by design, so every test leaves the collector as
it found it (enabled, nothing frozen)."""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Iterator

import pytest

from nftproxy.agent.heap import SWITCH_INTERVAL, AgentHeapPolicy


class Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def clean_gc() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.enable()


def test_a_full_build_pauses_the_collector_and_freezes_what_it_built() -> None:
    policy = AgentHeapPolicy()
    with policy.building(True):
        assert not gc.isenabled()
        built = [Cycle() for _ in range(100)]
    assert gc.isenabled()
    assert gc.get_freeze_count() >= len(built)
    gc.unfreeze()
    with policy.building(False):
        assert gc.isenabled()
    assert gc.get_freeze_count() == 0


def test_the_collector_comes_back_when_a_build_fails() -> None:
    with pytest.raises(RuntimeError), AgentHeapPolicy().building(True):
        raise RuntimeError("refused")
    assert gc.isenabled()


def test_a_full_build_switches_threads_sooner_until_it_ends() -> None:
    before = sys.getswitchinterval()
    assert before > SWITCH_INTERVAL
    policy = AgentHeapPolicy()
    with policy.building(False):
        assert sys.getswitchinterval() == before
    with pytest.raises(RuntimeError), policy.building(True):
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL)
        raise RuntimeError("refused")
    assert sys.getswitchinterval() == before


def test_every_sync_freezes_what_it_leaves() -> None:
    policy = AgentHeapPolicy()
    kept = [Cycle() for _ in range(100)]
    policy.settled(False)
    assert gc.get_freeze_count() >= len(kept)


def test_a_full_sync_collects_cycles_frozen_before_it_then_trims() -> None:
    trims: list[int] = []
    policy = AgentHeapPolicy(trim=lambda: trims.append(1))
    garbage = Cycle()
    ref = weakref.ref(garbage)
    policy.settled(False)  # a partial sync froze the cycle while it was alive
    del garbage
    gc.collect()
    assert ref() is not None  # frozen: no collection reaches it
    assert trims == []
    policy.settled(True)
    assert ref() is None
    assert trims == [1]
    assert gc.get_freeze_count() > 0


def test_overlapping_bulk_brackets_resume_the_collector_when_the_last_ends() -> None:
    policy = AgentHeapPolicy()
    services, slices = policy.bulk(), policy.bulk()  # two informers listing at once
    services.__enter__()
    slices.__enter__()
    services.__exit__(None, None, None)
    assert not gc.isenabled()
    slices.__exit__(None, None, None)
    assert gc.isenabled()
