"""Agent-level fuzzing: random valid and invalid cluster changes through the
fake API server into a running agent; the kernel is the judge.

Layer: tests (a helper of test_fuzz_agent.py, and a script:
`python tests/fuzz_agent.py --batches N --seed S`, which
scripts/fuzz_agent.sh runs). One job: run the real `Agent` (kube source
against `FakeApiServer`, `NftBackend` in a throwaway namespace) while
`fuzz_cluster.World` writes batches of random changes, in bursts, now and
then cutting the watches' connections, and after each batch,
once the agent has caught up (every watch has passed the batch's last
resourceVersion, then two syncs completed), check that:
- the agent's tables (tests/kernel.py `canonical`, a pick tree's destinations
  read as gotos) equal what ONE full sync
  of the API's current objects builds: a fresh Proxier fed the objects the
  agent's watches select, committed by another NftBackend in a second
  namespace;
- the agent did not crash: the sync thread and the informer threads are
  alive, no handler raised, nothing was logged at ERROR;
- every invalid field was reported exactly once, through `on_invalid_field`
  and nftproxy_invalid_fields_total alike: the reports equal the oracle's
  (fuzz_faults.faults; a field is reported again only after its object
  lost it -- fixed, deleted or hidden by a label -- and got it back).
A failure raises `FuzzFailure`, naming the seed, the batch and its writes.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import random
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import kernel
from fakeapi import FakeApiServer
from feed import intake
from fuzz_cluster import World, Write
from fuzz_faults import NODE, NS, faults, visible
from prometheus_client import CollectorRegistry

from nftproxy.agent.agent import Agent, Source
from nftproxy.agent.intake import INVALID_FIELD, InvalidField
from nftproxy.agent.proxier import Proxier
from nftproxy.agent.report import SyncReport
from nftproxy.cluster.events import KIND_ENDPOINT_SLICES, KIND_SERVICES, ClusterEvents
from nftproxy.cluster.kube import KubeSource
from nftproxy.core.config import ProxyConfig
from nftproxy.core.nft.listing import list_family
from nftproxy.core.nft.seam import Backend
from nftproxy.kernel.libnftables import NftBackend

__all__ = ["CONFIG", "FuzzFailure", "Harness", "Oracle", "fuzz"]

CONFIG = ProxyConfig(
    node_name=NODE,
    cluster_cidrs=("10.244.0.0/16", "fd00:244::/48"),
    min_sync_period=0.05,
    sync_period=30.0,  # no periodic sync hides a missed change ...
    full_sync_period=3600.0,  # ... nor does a periodic full one
    healthz_bind_address="",
    metrics_bind_address="",
)
WATCHED = ("services", "endpointslices", "nodes", "servicecidrs")
SERVICE_CIDR = {
    "apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
    "metadata": {"name": "kubernetes"}, "spec": {"cidrs": ["10.96.0.0/16", "fd00:96::/64"]},
}
KINDS = ("Service", "EndpointSlice", "Node", "ServiceCIDR")
Reported = tuple[str, str, str]
"""(kind, object, field path) of one invalid-field report."""


class FuzzFailure(AssertionError):
    pass


class _Errors(logging.Handler):
    """Every record at ERROR or above, from any nftproxy logger."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@dataclass
class Oracle:
    """The reports the agent owes: each object's faults as it last saw them."""

    seen: dict[tuple[str, str], frozenset[tuple[str, str]]] = field(default_factory=dict)
    owed: Counter[Reported] = field(default_factory=Counter)

    def wrote(self, w: Write) -> None:
        now = faults(w.kind, w.obj) if w.obj is not None else None
        before = self.seen.pop((w.kind, w.name), frozenset())
        if now is None:
            return  # deleted, or hidden by a label: its faults may come back
        self.owed.update((w.kind, w.name, path) for path, _ in now - before)
        self.seen[(w.kind, w.name)] = now


def _free_ports(count: int) -> list[int]:
    """Ports nothing listens on at 127.0.0.1 (for healthCheckNodePorts)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


class Harness:
    """The agent, the API it watches, the world that changes it and the judge."""

    def __init__(self, api: FakeApiServer, agent_ns: str, judge_ns: str, *, seed: int,
                 services: int) -> None:
        self.api = api
        self.seed = seed
        self.world = World(random.Random(seed), _free_ports(services))
        self.pace = random.Random(seed)
        self.oracle = Oracle()
        self.reports: list[InvalidField] = []
        self.syncs = 0
        self.batches = 0
        self.judge = NftBackend(netns=judge_ns)
        self.registry = CollectorRegistry()
        self.errors = _Errors()
        self.sources: list[KubeSource] = []
        self.agent = Agent(
            CONFIG, backend=NftBackend(netns=agent_ns), source_factory=self._source,
            registry=self.registry, on_invalid_field=self.reports.append,
            service_health_host="127.0.0.1", hooks=[self._synced],
        )

    def _source(self, handler: ClusterEvents) -> Source:
        source = KubeSource(self.api.api_client(), handler, node_name=NODE,
                            backoff_initial=0.05, backoff_max=0.2)
        self.sources.append(source)
        return source

    def _synced(self, _report: SyncReport) -> None:
        self.syncs += 1

    def __enter__(self) -> Harness:
        logging.getLogger("nftproxy").addHandler(self.errors)
        self.judge.start()
        self.api.create(SERVICE_CIDR)
        self._write(self.world.initial())
        self.agent.start()
        self.settle()
        self.check("the initial lists")
        return self

    def __exit__(self, *exc: object) -> None:
        self.agent.stop()
        self.judge.close()
        logging.getLogger("nftproxy").removeHandler(self.errors)

    # ---- one batch ----------------------------------------------------------------

    def batch(self, size: int) -> list[Write]:
        """`size` random writes, then wait for the agent and check it."""
        self.batches += 1
        writes = [self.world.step() for _ in range(size)]
        done = 0
        while done < size:  # in bursts, so that partial syncs see states in between
            burst = self.pace.randrange(1, 10)
            self._write(writes[done:done + burst])
            done += burst
            if self.pace.random() < 0.05:  # the watches resume from where they were cut
                self.api.drop_watches(partial=self.pace.random() < 0.5)
            time.sleep(self.pace.uniform(0, 2 * CONFIG.min_sync_period))
        self.settle()
        self.check(f"batch {self.batches}", writes)
        return writes

    def _write(self, writes: list[Write]) -> None:
        for w in writes:
            if w.obj is not None:
                self.api.apply(w.obj)
            else:
                self.api.delete(w.kind, w.name.split("/")[-1], NS if w.kind != "Node" else "")
            self.oracle.wrote(w)

    def settle(self, timeout: float = 30.0) -> None:
        """Every watch past the API's resourceVersion, then two whole syncs."""
        target = self.api.resource_version
        stats = self.sources[0].stats

        def caught_up() -> bool:
            self.api.bookmark()  # moves every open watch to the API's resourceVersion
            return all(int(stats[r].resource_version or 0) >= target for r in WATCHED)

        self._wait(caught_up, timeout, "the watches did not catch up")
        for _ in range(2):  # the first may have begun before the last event
            self._wait(self._one_more_sync(), timeout, "no successful sync")

    def _one_more_sync(self) -> Callable[[], bool]:
        count = self.syncs
        self.agent.runner.kick()
        return lambda: self.syncs > count

    def _wait(self, done: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                self.fail(what, [])
            time.sleep(0.02)

    # ---- the checks -----------------------------------------------------------------

    def check(self, when: str, writes: list[Write] | None = None) -> None:
        problems = self._crashes() + self._table_diff() + self._report_diff()
        if problems:
            self.fail(f"after {when}: " + "; ".join(problems), writes or [])

    def fail(self, what: str, writes: list[Write]) -> None:
        lines = [f"seed {self.seed}: {what}", "the batch's writes:"]
        lines += [f"  {w.what}" for w in writes]
        lines += [f"logged: {r.getMessage()}" for r in self.errors.records[:5]]
        raise FuzzFailure("\n".join(lines))

    def _crashes(self) -> list[str]:
        out = [f"logged at {r.levelname}: {r.getMessage()}" for r in self.errors.records]
        runner = self.agent.runner._thread
        if runner is None or not runner.is_alive():
            out.append("the sync thread is dead")
        source = self.sources[0]
        out += [f"{t.name} is dead" for t in source._threads if not t.is_alive()]
        out += [f"{r}: {s.handler_errors} handler errors"
                for r, s in source.stats.items() if s.handler_errors]
        return out

    def _table_diff(self) -> list[str]:
        got, want = self._tables(self.agent.backend), self.expected()
        return [f"table {f}: {_diff(got[f], want[f])}" for f in got if got[f] != want[f]]

    def _report_diff(self) -> list[str]:
        got = Counter((r.problem.kind, r.problem.obj, r.problem.field)
                      for r in self.reports if r.reason == INVALID_FIELD)  # not duplicates
        out = []
        if got != self.oracle.owed:
            extra, missing = got - self.oracle.owed, self.oracle.owed - got
            out.append(f"invalid fields reported but not owed {dict(extra)}, "
                       f"owed but not reported {dict(missing)}")
        counted = sum(self.registry.get_sample_value(
            "nftproxy_invalid_fields_total", {"kind": k}) or 0 for k in KINDS)
        if counted != len(self.reports):
            out.append(f"nftproxy_invalid_fields_total {counted} != {len(self.reports)} reports")
        return out

    # ---- the judge ------------------------------------------------------------------

    def expected(self) -> dict[str, Any]:
        """One full sync, on a fresh table, of what the agent's watches select."""
        self.judge.delete_tables(CONFIG.table_name)
        proxier = Proxier(CONFIG, self.judge)
        events = intake(proxier)
        node = self.api.get("Node", NODE)
        if node is not None:
            events.on_node(node)
        events.on_service_cidrs(list(self.api.objects("ServiceCIDR").values()))
        for kind, feed in (("Service", events.on_service),
                           ("EndpointSlice", events.on_endpoint_slice)):
            for obj in self.api.objects(kind).values():
                if visible(kind, obj):
                    feed(None, obj)
        events.on_synced(KIND_SERVICES)
        events.on_synced(KIND_ENDPOINT_SLICES)
        proxier.sync()
        return self._tables(self.judge)

    @staticmethod
    def _tables(backend: Backend) -> dict[str, Any]:
        return {
            f: kernel.canonical(
                list_family(backend.list_table, f, CONFIG.table_name)
            )
            for f in ("ip", "ip6")
        }


def _diff(got: dict[str, Any] | None, want: dict[str, Any] | None) -> str:
    if got is None or want is None:
        return f"agent has {'no' if got is None else 'a'} table, the judge " \
               f"{'none' if want is None else 'one'}"
    out = []
    for part in ("chains", "rules", "sets"):
        names = set(got[part]) | set(want[part])
        bad = sorted(n for n in names if got[part].get(n) != want[part].get(n))
        if bad:
            out.append(f"{part} differ: {', '.join(bad[:6])}{' ...' if len(bad) > 6 else ''}")
        for name in bad[:2]:  # what differs, for the first few
            mine, theirs = _items(got[part].get(name)), _items(want[part].get(name))
            out.append(f"{name}: agent only {sorted(mine - theirs)[:4]}, "
                       f"full sync only {sorted(theirs - mine)[:4]}")
    return "; ".join(out)


def _items(value: Any) -> set[str]:
    """A chain's rules or a set's elements, as comparable strings."""
    if value is None:
        return set()
    if value and value[0] in ("set", "map"):
        return set(value[-1])
    return {str(v) for v in value}


@contextlib.contextmanager
def harness(*, seed: int, services: int) -> Iterator[Harness]:
    """A started Harness in two fresh namespaces, all removed afterwards."""
    with (kernel.fresh_netns() as agent_ns, kernel.fresh_netns() as judge_ns,
          FakeApiServer() as api, Harness(api, agent_ns, judge_ns, seed=seed,
                                          services=services) as h):
        yield h


def fuzz(*, seed: int, batches: int, size: int, services: int,
         progress: Callable[[str], None] = lambda _: None) -> Harness:
    """Run `batches` batches of `size` writes; FuzzFailure on the first bad one."""
    with harness(seed=seed, services=services) as h:
        for n in range(batches):
            h.batch(size)
            progress(f"batch {n + 1}/{batches}: {len(h.reports)} invalid fields reported, "
                     f"{h.syncs} syncs")
        return h


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--size", type=int, default=30, help="writes per batch")
    parser.add_argument("--services", type=int, default=12)
    parser.add_argument("--seed", type=int, default=None, help="default: random")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    print(f"fuzz_agent: seed {seed}, {args.batches} batches of {args.size} writes, "
          f"{args.services} services", flush=True)
    start = time.monotonic()
    try:
        h = fuzz(seed=seed, batches=args.batches, size=args.size, services=args.services,
                 progress=lambda line: print(line, flush=True))
    except FuzzFailure as exc:
        print(f"FAILED: {exc}\nreproduce: scripts/fuzz_agent.sh --seed {seed} "
              f"--batches {args.batches} --size {args.size} --services {args.services}")
        return 1
    print(f"ok: {h.batches} batches, {h.batches * args.size} writes, {len(h.reports)} "
          f"invalid fields reported, {h.syncs} syncs in {time.monotonic() - start:.1f}s")
    return 0


if __name__ == "__main__":
    logging.getLogger("nftproxy").propagate = False  # the checks read the errors
    sys.exit(main())
