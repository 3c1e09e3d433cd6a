"""Where a first full sync's time goes: the CPU of each phase, in its thread.

In-process, in a throwaway namespace: the product Proxier wired as the
agent wires it (benchlib.make_proxier: the Intake in front, AgentHeapPolicy
-- the GC paused and a 1 ms switch interval while a full sync is built --
and the drift check on, as `nftproxy run` sets it), fed benchlib's service
mix; then its first full sync, in pipelined steps (agent/chunked.py). Each
phase is wrapped to add up its thread's CPU (time.thread_time) and its wall
time:

- `render`: core/render.py render_changed (the render-ahead thread);
- `compact`: a chunk's records, chains digested and elements packed (same
  thread; zlib runs without the GIL);
- `stage`: core/nft/plan.py stage_partial (the sync's thread);
- `encode`: a transaction's JSON text (kernel/libnftables.py _transaction;
  the sync's thread);
- `record`, `snapshot`: Proxier._record, Proxier._snapshot;
- `commit`: Proxier._commit_staged, a step's commit as the commit thread
  runs it (the drift check's reading included);
- `nft`: libnftables' calls inside it (parse, evaluation, the kernel's
  commit; the backend's worker thread, without the GIL).

Per size and rep: the sync's wall time, the process's CPU over it, the
JSON bytes sent, and each phase's {cpu_s, wall_s}. CPU adds up across
threads, wall time does not: on 2 vCPUs a sync cannot take less than half
its CPU, and the longer of the pipeline's halves (Python's phases under the
GIL; the chain of commits) sets its length.

    python bench/sync_phases.py [--quick] [--sizes 10000x10] [--reps 2]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import benchlib as bl

BENCH = "sync_phases"
PHASES = ("render", "compact", "stage", "encode", "record", "snapshot", "commit", "nft")


def _targets() -> dict[str, tuple[Any, str]]:
    """phase -> (the object whose attribute is called, the attribute)."""
    from nftproxy.agent import chunked, proxier
    from nftproxy.core import render
    from nftproxy.kernel import libnftables

    return {
        "render": (render, "render_changed"),
        "compact": (chunked, "compact"),
        "stage": (proxier, "stage_partial"),
        "encode": (libnftables.NftBackend, "printed"),
        "record": (proxier.Proxier, "_record"),
        "snapshot": (proxier.Proxier, "_snapshot"),
        "commit": (proxier.Proxier, "_commit_staged"),
        "nft": (libnftables, "_run"),
    }


@contextlib.contextmanager
def timed_phases(cpu: Counter[str], wall: Counter[str]) -> Iterator[list[int]]:
    """Wrap every phase for the block (restored after); yields the list the
    transactions' text sizes are appended to."""
    sizes: list[int] = []
    saved = []

    def wrap(phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kw: Any) -> Any:
            c0, w0 = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                cpu[phase] += time.thread_time() - c0
                wall[phase] += time.perf_counter() - w0
                if phase == "nft":
                    sizes.append(len(args[1]))

        return timed

    for phase, (owner, name) in _targets().items():
        fn = getattr(owner, name)
        saved.append((owner, name, fn))
        setattr(owner, name, wrap(phase, fn))
    try:
        yield sizes
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def run_once(shape: bl.ClusterShape, rep: int) -> dict[str, Any]:
    from nftproxy.kernel.libnftables import NftBackend

    with bl.bench_netns("phases") as ns, NftBackend(netns=ns) as backend:
        proxier = bl.make_proxier(backend, drift_check_period=30.0)
        bl.feed(proxier, *bl.make_cluster(shape))
        gc.collect()
        cpu: Counter[str] = Counter()
        wall: Counter[str] = Counter()
        noise = bl.Noise()
        with timed_phases(cpu, wall) as sizes:
            c0, w0 = time.process_time(), time.perf_counter()
            report = proxier.sync()
            sync_s, cpu_s = time.perf_counter() - w0, time.process_time() - c0
        if not report.full:
            raise RuntimeError("the first sync was not full")
        return bl.emit(
            BENCH, f"{shape.label}/first_sync", services=shape.services,
            endpoints_per_service=shape.endpoints, rep=rep, sync_s=round(sync_s, 3),
            cpu_s=round(cpu_s, 3), json_mb=round(sum(sizes) / 1e6, 1), transactions=len(sizes),
            phases={p: {"cpu_s": round(cpu[p], 3), "wall_s": round(wall[p], 3)} for p in PHASES},
            foreign_cpu=noise.foreign(), **bl.chain_count(proxier),
        )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small size of two chunks, one rep (CI)")
    ap.add_argument("--sizes", help="SxE,... (default 10000x10)")
    ap.add_argument("--reps", type=int)
    args = ap.parse_args()
    bl.require_root()
    from nftproxy.kernel.libnftables import tune_malloc

    tune_malloc()
    sizes = args.sizes or ("600x5" if args.quick else "10000x10")  # quick: two chunks, so steps
    reps = args.reps or (1 if args.quick else 2)
    bl.emit(BENCH, "machine", **bl.machine_info(), mix=bl.MIX_DESCRIPTION)
    rows = []
    for size in sizes.split(","):
        shape = bl.parse_shape(size)
        for rep in range(reps):
            if not args.quick:
                bl.wait_quiet()
            bl.progress(f"sync phases {shape.label} (rep {rep + 1})")
            rows.append(run_once(shape, rep))
    header = ["case", "userspace", "sync s", "cpu s", "JSON MB", *PHASES]
    table = [
        [r["case"], r["userspace"], r["sync_s"], r["cpu_s"], r["json_mb"],
         *(f"{r['phases'][p]['cpu_s']:.2f}/{r['phases'][p]['wall_s']:.2f}" for p in PHASES)]
        for r in rows
    ]  # fmt: skip
    print("phases: cpu s / wall s", file=sys.stderr)
    print(bl.fmt_table(table, header), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
