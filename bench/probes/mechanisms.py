"""Two mechanisms against the tree without them, in alternating fresh processes.

Layer: bench probe. One question: what do the agent's heap policy and
bare_packages buy, each measured against the same tree with it switched off?

- `heap`: A = AgentHeapPolicy(malloc_trim), as `nftproxy run` builds it (the
  initial list fed inside its `bulk()` bracket, as the kube source's
  `listing` does); B = NoHeapPolicy. A fresh process feeds a synthetic
  cluster (benchlib) to the real Proxier over a real NftBackend in a
  throwaway netns, runs the first full sync, then --churn partial syncs each
  replacing one endpoint of a random service. Figures: feed and full-sync
  wall time (the sync call, its settle step included), VmHWM, RSS after the
  full sync and after the churn, partial-sync p50/p99/max (and p99 of the
  first 300), and the gen-2 collections (count, seconds; gc.callbacks)
  during the feed and full sync, and during the churn. Under NoHeapPolicy
  (Python 3.11, 10k x 10) a gen-2 collection comes every ~1000 partial
  syncs, so a churn of 300 sees none: run --churn 1500 or more to see one.
- `bare`: A = the product's imports of `nftproxy run` (tools.cli, the API
  source's cluster.kube and kube_events, kernel.conntrack, pyroute2.iproute
  through kernel/pyroute2_modules.py); B = the same after importing the
  packages `kubernetes`, `kubernetes.config` and `pyroute2` whole, as a tree
  without bare_packages.register would (register leaves an imported package
  alone). Figures: import wall time, process wall (spawn to exit), RSS after
  the imports, len(sys.modules).

Rounds run A, B, A, B, ... each in a fresh process, after one discarded
warm-up of each. JSON lines on stdout, a table on stderr.

    python bench/probes/mechanisms.py [--quick] [--rounds 3] [--churn 300]
        [--services 10000] [--endpoints 10] [--only heap,bare]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: benchlib
import benchlib as bl

BENCH = "mechanisms"
VARIANTS = {"heap": ("AgentHeapPolicy", "NoHeapPolicy"), "bare": ("bare", "whole-packages")}


def _hwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def child_heap(product: bool, shape: bl.ClusterShape, churn: int) -> dict[str, Any]:
    from nftproxy.agent.heap import AgentHeapPolicy, NoHeapPolicy
    from nftproxy.agent.intake import Intake
    from nftproxy.agent.proxier import Proxier
    from nftproxy.kernel.libnftables import NftBackend, malloc_trim, tune_malloc

    tune_malloc()  # as `nftproxy run` does, in both variants
    gen2: list[float] = []
    started: list[float] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if info["generation"] == 2:
            if phase == "start":
                started.append(time.perf_counter())
            elif started:
                gen2.append(time.perf_counter() - started.pop())

    services, slices = bl.make_cluster(shape)  # stands in for the API's JSON: not counted
    gc.callbacks.append(on_gc)
    with bl.bench_netns("mech") as ns, NftBackend(netns=ns) as backend:
        policy = AgentHeapPolicy(malloc_trim) if product else None
        proxier = Proxier(bl.bench_config(), backend, heap=policy or NoHeapPolicy())
        intake = Intake(proxier, node_name=bl.NODE, report=lambda _: None)
        intake.on_node(bl.node_obj())
        t0 = time.perf_counter()
        with policy.bulk() if policy else contextlib.nullcontext():
            bl.feed(intake, services, slices)
        feed_s = time.perf_counter() - t0
        del services, slices
        t0 = time.perf_counter()
        full = proxier.sync()
        full_s = time.perf_counter() - t0
        rss_full = bl.rss_mb()
        rng = random.Random(7)
        j = bl.changed_endpoint(shape)
        generation: dict[int, int] = {}
        times: list[float] = []
        gen2_build = (len(gen2), sum(gen2))  # during the feed and the full sync
        gen2.clear()
        for _ in range(churn):
            i = rng.randrange(shape.services)
            g = generation.get(i, 0)
            old = bl.slice_obj(i, shape, generations={j: g} if g else None)
            generation[i] = g + 1
            intake.on_endpoint_slice(old, bl.slice_obj(i, shape, generations={j: g + 1}))
            t0 = time.perf_counter()
            proxier.sync()
            times.append(time.perf_counter() - t0)
        gc.callbacks.remove(on_gc)
    return {
        "feed_s": round(feed_s, 3),
        "full_s": round(full_s, 3),
        "full_render_s": round(full.render_seconds, 3),
        "full_commit_s": round(full.commit_seconds, 3),
        "hwm_mb": _hwm_mb(),
        "rss_after_full_mb": rss_full,
        "rss_after_churn_mb": bl.rss_mb(),
        "partial_ms": bl.summary(times, 1000),
        "partial_first300_ms": bl.summary(times[:300], 1000),
        "gen2_build_n": gen2_build[0],
        "gen2_build_s": round(gen2_build[1], 3),
        "gen2_n": len(gen2),
        "gen2_s": round(sum(gen2), 3),
    }


def child_bare(product: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    if not product:  # the tree without bare_packages: each package's __init__ runs
        for name in ("kubernetes", "kubernetes.config", "pyroute2"):
            importlib.import_module(name)
    importlib.import_module("nftproxy.tools.cli")
    importlib.import_module("nftproxy.cluster.kube")  # cli._kube_source
    importlib.import_module("nftproxy.cluster.kube_events")
    importlib.import_module("nftproxy.kernel.conntrack")  # cli._conntrack
    from nftproxy.kernel import pyroute2_modules

    pyroute2_modules.module("pyroute2.iproute")  # AddressWatch's worker
    return {
        "import_s": round(time.perf_counter() - t0, 3),
        "rss_mb": bl.rss_mb(),
        "modules": len(sys.modules),
    }


def spawn(args: argparse.Namespace, mech: str, variant: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", mech, "--variant", variant,
           "--services", str(args.services), "--endpoints", str(args.endpoints),
           "--churn", str(args.churn)]
    noise = bl.Noise()
    t0 = time.perf_counter()
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    row: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    row["process_s"] = round(time.perf_counter() - t0, 3)
    row["foreign_cpu"] = noise.foreign()
    return row


def _g(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"


def _range(rows: list[dict[str, Any]], key: str) -> str:
    vals = [r[key] for r in rows]
    return f"{_g(sorted(vals)[len(vals) // 2])} [{_g(min(vals))}-{_g(max(vals))}]"


FIGURES = {
    "heap": ("feed_s", "full_s", "gen2_build_n", "gen2_build_s", "hwm_mb", "rss_after_full_mb",
             "rss_after_churn_mb", "partial_p50_ms", "partial_p99_ms", "first300_p99_ms",
             "partial_max_ms", "gen2_n", "gen2_s"),
    "bare": ("import_s", "process_s", "rss_mb", "modules"),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="300x5, 50 partial syncs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--services", type=int)
    ap.add_argument("--endpoints", type=int)
    ap.add_argument("--churn", type=int)
    ap.add_argument("--only", default="heap,bare")
    ap.add_argument("--child", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    ap.add_argument("--variant", choices=("A", "B"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.services = args.services or (300 if args.quick else 10000)
    args.endpoints = args.endpoints or (5 if args.quick else 10)
    args.churn = args.churn or (50 if args.quick else 300)
    if args.child:
        product = args.variant == "A"
        shape = bl.ClusterShape(args.services, args.endpoints)
        heap = args.child == "heap"
        row = child_heap(product, shape, args.churn) if heap else child_bare(product)
        print(json.dumps(row), flush=True)
        return 0
    bl.require_root()
    bl.emit(BENCH, "machine", **bl.machine_info(), mix=bl.MIX_DESCRIPTION)
    table: list[list[Any]] = []
    for mech in args.only.split(","):
        rows: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
        label = f"{args.services}x{args.endpoints}, churn {args.churn}" if mech == "heap" else ""
        for rnd in range(-1, args.rounds):  # round -1: warm-up, discarded
            if not args.quick:
                bl.wait_quiet()
            for variant in ("A", "B"):
                name = VARIANTS[mech][variant == "B"]
                bl.progress(f"{mech} {variant} ({name}) round {rnd} {label}")
                r = spawn(args, mech, variant)
                if mech == "heap":
                    r["partial_p50_ms"] = r["partial_ms"]["p50"]
                    r["partial_p99_ms"] = r["partial_ms"]["p99"]
                    r["partial_max_ms"] = r["partial_ms"]["max"]
                    r["first300_p99_ms"] = r["partial_first300_ms"]["p99"]
                if rnd >= 0:
                    rows[variant].append(r)
                    bl.emit(BENCH, f"{mech}/{variant}", variant=name, round=rnd,
                            services=args.services, endpoints=args.endpoints,
                            churn=args.churn if mech == "heap" else None, **r)
        for key in FIGURES[mech]:
            a = sorted(r[key] for r in rows["A"])[len(rows["A"]) // 2]
            b = sorted(r[key] for r in rows["B"])[len(rows["B"]) // 2]
            change = f"{(a - b) / b:+.0%}" if b else "-"
            table.append([f"{mech} {key}", _range(rows["A"], key), _range(rows["B"], key), change])
    print(bl.fmt_table(table, ["figure", "A median [range]", "B median [range]", "A vs B"]),
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
