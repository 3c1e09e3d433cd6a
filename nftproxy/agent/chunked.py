"""Full syncs of a large cluster, built where traffic cannot see them.

Layer: agent (orchestration over core/render.py and core/nft; no I/O of its
own: the proxier records and commits). One job: turn a full sync that is
too large for one transaction (memory follows the transaction) into steps
that traffic never sees, then one small transaction that switches:

- a step deletes any leftover of the table being built (a build cut short);
- the skeletons go in without their base chains, so nothing is hooked;
- the service ports follow in sorted `chunks`, each recorded when staged;
- the last step adds the base chains and deletes the tables that were
  live: the kernel holds the complete old ruleset or the complete new one,
  never a mix.

The build goes into the one of `names.table_pair` that is not live, so a
restart over existing tables switches from one name to the other. A
cluster of one chunk is one transaction over the live table instead
(`build` returns None). ClientIP affinity entries live in the table they
were learnt in, so a switch forgets them: each such client picks an
endpoint afresh once.

Steps are lazy: a step is staged when taken, after the previous one was
recorded. `run_steps` records and encodes a step when it is staged and
commits it in a thread of its own while the next is staged and encoded:
libnftables runs with the GIL released (ctypes), so the kernel takes one
chunk while Python makes the next. The record (the build's own
TableStates, which the proxier takes only once the switch is committed)
runs ahead of the kernel; a refused step stops the steps. A step's render,
which depends on nothing recorded, runs one step further ahead in another
thread (`_rendered_ahead`), compacted there too (`Records`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, replace
from typing import TypeVar, cast

from nftproxy.agent.report import SyncInput
from nftproxy.core.config import ProxyConfig
from nftproxy.core.model import IPFamily
from nftproxy.core.nft.commands import Command
from nftproxy.core.nft.listing import TableListing
from nftproxy.core.nft.ops import Table
from nftproxy.core.nft.plan import SKELETON, Owner, Staged, TableState
from nftproxy.core.render import RenderedFamily, chunks, render_fresh
from nftproxy.core.rules import names
from nftproxy.core.rules.fragment import Chain, CompactFragment, Fragment, compact

__all__ = ["Build", "Chunked", "Records", "Step", "run_steps"]

T = TypeVar("T")

Rendered = Mapping[IPFamily, RenderedFamily]
Listings = Mapping[IPFamily, TableListing | None]
Records = Mapping[IPFamily, Mapping[Owner, CompactFragment]]
"""The compact records of a render's fragments, made with it."""
Step = tuple[Mapping[IPFamily, Staged], Rendered]
"""One transaction of both families, and the renders it came from (for the
no-local tallies; empty for the first and last steps)."""
Stage = Callable[
    [Mapping[IPFamily, TableState], Rendered, Listings, Records], dict[IPFamily, Staged]
]


@dataclass(frozen=True, slots=True)
class Build:
    """A full sync in steps into table `target`; `tables` are its records,
    filled as the steps are taken, for the proxier to take once the last
    step (the switch) is committed."""

    target: str
    tables: Mapping[IPFamily, TableState]
    steps: Generator[Step, None, None]


@dataclass(frozen=True, slots=True)
class Chunked:
    """What a full sync in steps needs of the proxier: its config, the
    chunk size in endpoints and its `stage` (given the tables to stage
    against)."""

    config: ProxyConfig
    min_endpoints: int
    stage: Stage

    def build(self, snapshot: SyncInput, live: str | None) -> Build | None:
        """The steps of the full sync `snapshot` when the table `live` (None:
        no table is live) is to be replaced, or None: the cluster makes one
        chunk, so send it as one transaction."""
        states = [inp.state for inp in snapshot.families.values()]
        if sum(1 for _ in chunks(states, self.min_endpoints)) < 2:
            return None
        pair = names.table_pair(self.config.table_name)
        target = pair[1] if live == pair[0] else pair[0]
        tables = {
            f: TableState(f, Table(f.nft_family, target))
            for f in snapshot.families
        }
        leftovers = [name for name in pair if name != live]
        return Build(target, tables, self._steps(snapshot, tables, leftovers, live))

    def _steps(
        self,
        snapshot: SyncInput,
        tables: Mapping[IPFamily, TableState],
        leftovers: list[str],
        live: str | None,
    ) -> Generator[Step, None, None]:
        yield {
            f: Staged([c for name in leftovers for c in _delete(state, name)], lambda: None)
            for f, state in tables.items()
        }, {}
        states = {f: inp.state for f, inp in snapshot.families.items()}
        renders = render_fresh(
            states, self.config, snapshot.node, snapshot.service_cidrs, self.min_endpoints
        )
        absent: Listings = {f: None for f in tables}
        skeletons: dict[IPFamily, Fragment] = {}
        with closing(_rendered_ahead((r, _records(r)) for r in renders)) as ahead:
            for rendered, records in ahead:
                if not skeletons:
                    skeletons = {f: r.desired()[SKELETON] for f, r in rendered.items()}
                    rendered = {f: _unhooked(r) for f, r in rendered.items()}
                yield self.stage(tables, rendered, absent, records), rendered
        yield {f: _switch(state, skeletons[f], live) for f, state in tables.items()}, {}


def _delete(state: TableState, name: str) -> list[Command]:
    """Delete the family's tables called `name`, whether they exist or not."""
    return replace(state.table, name=name).delete_tables()


def _unhooked(rendered: RenderedFamily) -> RenderedFamily:
    """A skeleton's render without its base chains."""
    skeleton = rendered.desired()[SKELETON]
    chains = tuple(c for c in skeleton.chains if c.hook is None)
    fragments = {**rendered.fragments, SKELETON: replace(skeleton, chains=chains)}
    return replace(rendered, fragments=fragments)


def _switch(state: TableState, skeleton: Fragment, live: str | None) -> Staged:
    """The last step: hook the built table (its base chains) and delete the
    tables that were live, in one transaction."""
    t = state.table
    hooked: list[Chain] = [c for c in skeleton.chains if c.hook is not None]
    commands: list[Command] = [
        c for chain in hooked for c in (t.add_chain(chain), *t.add_rules(chain))
    ]
    if live is not None:
        commands += _delete(state, live)
    return Staged(commands, lambda: state.adopt(SKELETON, skeleton))


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
