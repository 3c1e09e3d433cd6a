"""What the drift check costs (agent/drift.py), next to the checks it was chosen over.

For each size (benchlib's service mix, E endpoints each), a throwaway
namespace gets the full table; then R repetitions of each probe (ms):

- `generation`: Backend.generation(), the kernel's NFT_MSG_GETGEN -- the
  check an agent makes once per syncPeriod;
- `idle_sync`: a sync with nothing to do and the check on (period 0: every
  sync checks) -- what an idle syncPeriod tick costs;
- `objects`: list_table_objects (chains and sets, no rules): would see a
  deleted table or chain, never a flushed one;
- `chain_rules`: a terse `list chain` of one chain (1.0.6 cannot batch
  several): what counting the rules of ONE chain costs;
- `table_rules`: a terse `list table`, parsed: counting every chain's rules;
- `full_sync`: a forced full sync: the repair, and what "a full sync every
  syncPeriod" would cost;
- `repair`: another process flushes `nat-prerouting`, then the sync that
  notices it (generation moved) and repairs it by a full sync.

It also checks that one full sync moves the generation by exactly one (one
transaction), which the check relies on.

    python bench/probes/drift_check.py [--quick] [--sizes 1000,10000] [--endpoints 3] [--reps 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: benchlib
import benchlib as bl

BENCH = "drift_check"
TABLE = "nftproxy"


def _timed(fn: Callable[[], object], reps: int) -> dict[str, float]:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return bl.summary(samples, 1000)


def _terse(backend: Any, command: dict[str, Any]) -> int:
    """One terse list command on the backend's context; objects listed."""
    from nftproxy.kernel.libnftables import _objects, _run_terse, dumps

    rc, out, err = backend._call(lambda ctx: _run_terse(ctx, dumps({"nftables": [command]})))
    if rc != 0:
        raise RuntimeError(err)
    return len(_objects(out))


def _proxier(backend: Any, shape: bl.ClusterShape) -> Any:
    """A Proxier with the check at every sync, fed the cluster as the agent feeds it."""
    from nftproxy.agent.intake import Intake
    from nftproxy.agent.proxier import Proxier

    proxier = Proxier(bl.bench_config(), backend, drift_check_period=0.0)
    events = Intake(proxier, node_name=bl.NODE, report=lambda _: None)
    events.on_node(bl.node_obj())
    bl.feed(events, *bl.make_cluster(shape))
    return proxier


def run_size(shape: bl.ClusterShape, reps: int, *, quiet: bool) -> list[dict[str, Any]]:
    from nftproxy.kernel.libnftables import NftBackend

    rows = []
    with bl.bench_netns("drift") as ns, NftBackend(netns=ns) as backend:
        proxier = _proxier(backend, shape)
        before = backend.generation()
        t0 = time.perf_counter()
        proxier.sync()
        load_s = time.perf_counter() - t0
        per_commit = backend.generation() - before
        bl.progress(f"{shape.label}: table loaded in {load_s:.1f}s; "
                    f"generation moved by {per_commit} for one full sync")
        chain = {"list": {"chain": {"family": "ip", "table": TABLE, "name": "KUBE-SERVICES"}}}
        table = {"list": {"table": {"family": "ip", "name": TABLE}}}
        flush = {"flush": {"chain": {"family": "ip", "table": TABLE, "name": "nat-prerouting"}}}

        def repair() -> None:
            bl.raw(backend, [flush])  # another process, as far as the proxier can tell
            if not proxier.sync().full:
                raise RuntimeError("the drift check missed a flushed chain")

        def forced_full() -> None:
            proxier.request_full_sync()
            proxier.sync()

        def idle() -> None:
            if proxier.sync().full:
                raise RuntimeError("an idle sync went full")

        probes: dict[str, tuple[Callable[[], object], int]] = {
            "generation": (backend.generation, reps * 20),
            "idle_sync": (idle, reps * 20),
            "objects": (lambda: backend.list_table_objects("ip", TABLE), reps),
            "chain_rules": (lambda: _terse(backend, chain), reps),
            "table_rules": (lambda: _terse(backend, table), reps),
            "full_sync": (forced_full, reps),
            "repair": (repair, reps),
        }
        if quiet:
            bl.wait_quiet()
        for probe, (fn, n) in probes.items():
            noise = bl.Noise()
            ms = _timed(fn, n)
            rows.append(bl.emit(BENCH, f"{shape.label}/{probe}", services=shape.services,
                                endpoints_per_service=shape.endpoints, probe=probe, ms=ms,
                                generations_per_full_sync=per_commit,
                                foreign_cpu=noise.foreign(), **bl.chain_count(proxier)))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few reps (CI)")
    ap.add_argument("--sizes")
    ap.add_argument("--endpoints", type=int, default=3)
    ap.add_argument("--reps", type=int)
    args = ap.parse_args()
    bl.require_root()
    from nftproxy.kernel.libnftables import tune_malloc

    tune_malloc()
    sizes = args.sizes or ("100,300" if args.quick else "1000,10000")
    reps = args.reps or (2 if args.quick else 5)
    bl.emit(BENCH, "machine", **bl.machine_info(), mix=bl.MIX_DESCRIPTION)
    rows = []
    for n in sizes.split(","):
        shape = bl.ClusterShape(int(n), args.endpoints)
        bl.progress(f"drift check {shape.label}: {reps} reps")
        rows += run_size(shape, reps, quiet=not args.quick)
    header = ["case", "p50 ms", "p90 ms", "max ms", "n"]
    table = [[r["case"], r["ms"]["p50"], r["ms"]["p90"], r["ms"]["max"], r["ms"]["n"]]
             for r in rows]
    print(bl.fmt_table(table, header), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
