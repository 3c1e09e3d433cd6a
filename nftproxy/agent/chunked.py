"""Full syncs cut into steps, so that their memory follows a chunk, not the cluster.

Layer: agent (orchestration over core/render.py and core/nft; no I/O of its
own: the proxier records and commits). One job: turn a full sync of a
large cluster into a sequence of transactions, each committed by the
proxier (drift bookkeeping, typeof dialect, errors as for any commit):

- onto ABSENT tables (first start): the skeletons (`stage_full`), then the
  service ports in sorted `chunks` (`stage_partial`), each recorded when
  staged; nothing is there yet to keep consistent;
- over EXISTING tables (agent restart, drift repair, periodic full sync):
  core/nft/resync.py's steps -- skeleton, chunks of owners' chains, then one
  final transaction that switches every shared map and removes what is no
  longer desired; recorded at the final step only. Taken when the cluster
  makes more than one chunk and the listing allows it (`resyncable`: same set
  declarations, same base-chain hooks); otherwise `steps` returns None and
  the proxier sends today's single transaction.

Steps are lazy: a step is staged when taken, after the previous one was
recorded (a chunk onto absent tables diffs against what the previous one
recorded). `run_steps` records and encodes a step when it is staged and
commits it in a thread of its own while the next is staged and encoded:
libnftables runs with the GIL released (ctypes), so the kernel takes one
chunk while Python makes the next. The record runs ahead of the kernel
(by the step in flight and the one taken); a refused step stops the steps
and makes the next sync full, which lists the tables and builds its record
from the listing (`stage_full`, a resync), not from this one. A step's
render, which depends on nothing recorded, runs one step further ahead in
another thread (`_rendered_ahead`), and is compacted there too (`Records`:
each owner's record, its chains' digests and its elements packed), which
the staging would otherwise do beside it, holding the GIL.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from typing import TypeVar, cast

from nftproxy.agent.report import SyncInput
from nftproxy.core.config import ProxyConfig
from nftproxy.core.model import IPFamily
from nftproxy.core.nft.listing import TableListing
from nftproxy.core.nft.plan import SKELETON, Owner, Staged, TableState
from nftproxy.core.nft.resync import ResyncPlan, resyncable
from nftproxy.core.render import RenderedFamily, chunks, render_fresh
from nftproxy.core.rules.fragment import CompactFragment, compact
from nftproxy.core.rules.skeleton import GENERATIONS, endpoints_generation

__all__ = ["Chunked", "Records", "Step", "run_steps"]

T = TypeVar("T")

Rendered = Mapping[IPFamily, RenderedFamily]
Listings = Mapping[IPFamily, TableListing | None]
Records = Mapping[IPFamily, Mapping[Owner, CompactFragment]]
"""The compact records of a render's fragments, made with it."""
Step = tuple[Mapping[IPFamily, Staged], Rendered]
"""One transaction of both families, and the renders it came from (for the
no-local tallies; empty for the final step of a resync)."""


@dataclass(frozen=True, slots=True)
class Chunked:
    """What a chunked full sync needs of the proxier: its config, the chunk
    size in endpoints, its tables' records, its `stage` (the fresh path
    stages as any sync does), whether the backend takes typeof declarations
    and whether deletes are deferred (EBUSY)."""

    config: ProxyConfig
    min_endpoints: int
    tables: Mapping[IPFamily, TableState]
    stage: Callable[[Rendered, Listings, Records], dict[IPFamily, Staged]]
    typeof: bool = False
    defer_deletes: bool = False

    def steps(self, snapshot: SyncInput, listings: Listings) -> Generator[Step, None, None] | None:
        """The steps of the full sync `snapshot` over `listings`, or None:
        send it as one transaction."""
        if all(listing is None for listing in listings.values()):
            return self._fresh(snapshot)
        return self._resync(snapshot, listings)

    def _renders(
        self, snapshot: SyncInput, generation: str
    ) -> Iterator[tuple[Rendered, Records]]:
        states = {f: inp.state for f, inp in snapshot.families.items()}
        renders = render_fresh(
            states,
            self.config,
            snapshot.node,
            snapshot.service_cidrs,
            self.min_endpoints,
            generation,
        )
        return ((rendered, _records(rendered)) for rendered in renders)

    def _fresh(self, snapshot: SyncInput) -> Generator[Step, None, None]:
        absent: dict[IPFamily, TableListing | None] = {f: None for f in snapshot.families}
        generations = {self.tables[f].generation for f in snapshot.families}
        renders = self._renders(snapshot, min(generations, default=GENERATIONS[0]))
        with closing(_rendered_ahead(renders)) as ahead:
            for rendered, records in ahead:
                yield self.stage(rendered, absent, records), rendered

    def _resync(
        self, snapshot: SyncInput, listings: Listings
    ) -> Generator[Step, None, None] | None:
        states = [inp.state for inp in snapshot.families.values()]
        if sum(1 for _ in chunks(states, self.min_endpoints)) < 2:
            return None
        generation = _next_generation(listings)
        if generation is None:
            return None
        renders = self._renders(snapshot, generation)
        skeletons, _ = next(renders)
        for family, r in skeletons.items():
            listing = listings.get(family)
            self.tables[family].use_typeof(self.typeof)
            table = self.tables[family].table
            if listing is not None and not resyncable(table, listing, r.desired()[SKELETON]):
                return None
        plans = {
            f: ResyncPlan(
                self.tables[f], listings.get(f), generation, defer_deletes=self.defer_deletes
            )
            for f in skeletons
        }
        return _resync_steps(plans, skeletons, _rendered_ahead(renders))


_END = object()


def _rendered_ahead(renders: Iterator[T]) -> Generator[T, None, None]:
    """`renders`' items, each next one computed in a worker thread while
    the caller works on (stages and commits) the current one. At most one
    is computed ahead; closing this generator waits for it and drops it."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="render-ahead") as worker:
        pending = worker.submit(next, renders, _END)
        while (item := pending.result()) is not _END:
            pending = worker.submit(next, renders, _END)
            yield cast(T, item)


def _next_generation(listings: Listings) -> str | None:
    """The endpoints-map generation a resync fills: one no listed table
    holds (None: they hold every one -- resyncs cut short twice -- so one
    transaction)."""
    held = {
        endpoints_generation(name)
        for listing in listings.values()
        if listing is not None
        for name in listing.sets
    }
    free = [g for g in GENERATIONS if g not in held]
    return free[0] if free else None


def _resync_steps(
    plans: Mapping[IPFamily, ResyncPlan],
    skeletons: Rendered,
    rest: Generator[tuple[Rendered, Records], None, None],
) -> Generator[Step, None, None]:
    yield {f: plans[f].step(r.desired(), first=True) for f, r in skeletons.items()}, skeletons
    with closing(rest):
        for rendered, records in rest:
            yield {
                f: plans[f].step(r.desired(), records=records.get(f)) for f, r in rendered.items()
            }, rendered
    yield {f: plan.final() for f, plan in plans.items()}, {}


def _records(rendered: Rendered) -> Records:
    """The compact record of each fragment of a chunk of ports (none of a
    skeleton's render: `stage_full` records it)."""
    return {
        f: {owner: compact(fragment) for owner, fragment in r.fragments.items() if fragment}
        for f, r in rendered.items()
        if not r.full
    }


def run_steps(
    steps: Generator[Step, None, None],
    take: Callable[[Mapping[IPFamily, Staged], Rendered], Callable[[], int]],
    clock: Callable[[], float],
) -> tuple[int, float, float]:
    """Take each step in order -- `take` records and encodes it and returns
    its commit -- and run each commit in a worker thread while the next step
    is staged and taken. Returns (commands, render s: staging and taking the
    steps, commit s: waiting for their commits). A refused step raises once
    the step after it is taken; no later step is committed (nor rendered
    ahead)."""
    ops, render_s, commit_s = 0, 0.0, 0.0
    with (
        closing(steps),
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="commit") as committer,
    ):
        pending: Future[int] | None = None
        while True:
            t_render = clock()  # the step is staged (its render waited for) when taken
            step = next(steps, None)
            commit = take(*step) if step is not None else None
            t_commit = clock()
            render_s += t_commit - t_render
            if pending is not None:
                ops += pending.result()
                commit_s += clock() - t_commit
            if commit is None:
                return ops, render_s, commit_s
            pending = committer.submit(commit)
