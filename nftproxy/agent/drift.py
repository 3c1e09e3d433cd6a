"""Drift: has another process changed nftables under the proxier?

Layer: agent (used by proxier.py; imports the core only: the generation is
read through the Backend protocol, kernel/nftgen.py for NftBackend). One
job: tell the proxier when its record of the kernel (`TableState`) can no
longer be trusted because someone else committed -- `nft delete table`,
`nft flush chain`, another tool's transaction -- so that the next sync is a
full one, which repairs everything; and name what was found, for the log
and `nftproxy_drift_repairs_total{reason}`.

How: the kernel adds one to its per-namespace ruleset generation for every
committed transaction, of any process (kernel/nftgen.py). Right before each
of its own commits the proxier reads it; if the commit is accepted, the
generation is now that value plus one -- unless someone else committed in
between, and then it is not. At most once per `period` (the agent passes
syncPeriod, so an idle agent checks on its syncPeriod-driven syncs and a
busy one on the first sync after syncPeriod), `changed()` reads the
generation again: any other value means another process committed since;
that stays so until the full sync it forces has committed (a refused one
is retried as a repair). The full sync lists our tables anyway, and
`drift_reason()` compares that listing with the record: `table` (a table
we programmed is gone), `chains` or `sets` (one of ours is missing, or one
we never made is there), else `foreign_commit` (our chains and sets are
intact; a flush, a rule or element change, or a commit to another table --
the listing cannot tell them apart, so everything is rewritten).

Why this and not a listing, nor a full sync every syncPeriod
(bench/probes/drift_check.py measures each): reading the generation is one
netlink request whatever the ruleset's size. Listing the chains and sets
(`list_table_objects`) grows with the ruleset and would see a deleted table
or chain, never a flushed one. Counting rules needs the rules, and 1.0.6
fetches and decodes every chain of the namespace to list any: even a terse
`list chain` of ONE chain costs a good part of a full sync at scale
(several `list chain` in one batch fail on 1.0.6). So the gate is the
generation: free while nobody else touches nftables,
and complete (it sees every change, flushes included). When another
process did commit, the repair is a full sync, at most one per syncPeriod:
checking rules first would cost half of that full sync again at 10,000
services, to spare it only when the other commit did not touch our tables.

Known limits: on a node where another tool commits nftables changes all the
time (a CNI plugin through iptables-nft on every pod start), this means up
to one full sync per syncPeriod. A generation that cannot be read (OSError)
skips the check; the hourly full sync (config.full_sync_period) still runs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sized

from nftproxy.core.model import IPFamily
from nftproxy.core.nft.listing import TableListing
from nftproxy.core.nft.plan import TableState
from nftproxy.core.rules.fragment import in_affinity_table

__all__ = ["FOREIGN_COMMIT", "DriftWatch", "drift_reason", "next_generation"]

FOREIGN_COMMIT = "foreign_commit"


def next_generation(generation: int) -> int:
    """The generation one more commit makes (32 bits; the kernel skips 0)."""
    return generation + 1 if generation < 0xFFFFFFFF else 1


class DriftWatch:
    """The generation our last commit left, and the periodic comparison.

    `read` is Backend.generation; `period` None turns the watch off (then
    it never reads anything). The first check comes one period after
    construction.
    """

    def __init__(
        self,
        read: Callable[[], int],
        *,
        period: float | None,
        clock: Callable[[], float] = time.monotonic,
        log: logging.Logger | None = None,
    ) -> None:
        self._read = read
        self._period = period
        self._clock = clock
        self.log = log or logging.getLogger(__name__)
        self._expected: int | None = None
        self._checked = clock()  # the first sync is full anyway
        self._pending = False
        self._in_steps = False

    @contextlib.contextmanager
    def committing(self, commands: Sized) -> Iterator[None]:
        """Wrap one commit of ours: on success, remember the generation it
        leaves if nobody else commits meanwhile. An empty commit sends
        nothing and changes nothing; a refused one leaves the generation.
        Within `committing_steps`, reads nothing."""
        if self._period is None or self._in_steps or not len(commands):
            yield
            return
        before = self._current()
        yield
        self._expected = None if before is None else next_generation(before)

    @contextlib.contextmanager
    def committing_steps(self) -> Iterator[None]:
        """Wrap the commits of a full sync in steps (each in `committing`,
        from any thread, all done when the block ends): the generation is
        read once, after them, refused or not, instead of before each: only
        the last step's reading would count (each replaces the one before),
        and in a pipelined sync every reading waits for the interpreter lock
        in the commit thread, which lengthens the chain of commits."""
        if self._period is None:
            yield
            return
        self._in_steps = True
        try:
            yield
        finally:
            self._in_steps = False
            self._expected = self._current()

    def changed(self) -> bool:
        """Has another process committed since our last commit? Checked at
        most once per period (False before our first commit); once seen,
        True until `repaired()`, so a refused repair is retried as one."""
        if self._pending:
            return True
        if self._period is None or self._expected is None:
            return False
        now = self._clock()
        if now - self._checked < self._period:
            return False
        self._checked = now
        current = self._current()
        self._pending = current is not None and current != self._expected
        return self._pending

    def repaired(self) -> None:
        """The full sync `changed()` asked for has committed."""
        self._pending = False

    def _current(self) -> int | None:
        try:
            return self._read()
        except OSError as exc:
            self.log.debug("cannot read the nftables generation: %s", exc)
            return None


def drift_reason(
    tables: Mapping[IPFamily, TableState], listings: Mapping[IPFamily, TableListing | None]
) -> str:
    """What a full sync's listing shows that our record does not (pure):
    "table", "chains", "sets", else FOREIGN_COMMIT."""
    for family, state in tables.items():
        listed = listings.get(family)
        tables_held = {in_affinity_table(c) for c in listed.chains} if listed else set()
        if any(in_affinity_table(c) not in tables_held for c in state.chains):
            return "table"  # the main table, or the affinity table
        if listed is None:
            continue
        if set(listed.chains) != set(state.chains) | state.stale_chains:
            return "chains"
        if set(listed.sets) != set(state.sets) | set(state.stale_sets):
            return "sets"
    return FOREIGN_COMMIT
