"""Endpoint churn: network programming latency and CPU under 100 changes/s.

Spec item 3. A table of S services (the benchlib mix) is loaded into a
throwaway namespace; then the real Runner (nftproxy.agent.runner.Runner, the
agent's settings: minSyncPeriod 1 s, burst 2, syncPeriod 30 s) drives
Proxier.sync() while a feeder thread hands the proxier RATE endpoint changes
per second for DURATION seconds (each: one endpoint of a random service
replaced by a new pod IP), kicking the runner as the agent does.

Latency per change = time the sync that covered it returned from its commit
(post-commit hook) - time the change was handed to the proxier. The handed
time travels in the EndpointSlice's last-change-trigger-time annotation
(microseconds), i.e. through the same path as the product's
network-programming-latency metric (UpdateResult.trigger_times).

CPU = process CPU time (user + sys, all threads, libnftables and the kernel
work of the netlink calls included) / wall time of the churn window; the
feeder's own share (building the EndpointSlice dicts, thread_time around
that part only) is shown separately and subtracted: it stands in for the
API watch, not the proxy. Handling the event (Proxier.on_endpoint_slice:
conversion, tracker) counts as proxy CPU.

    python bench/churn.py [--quick] [--services 10000] [--endpoints 10]
        [--rate 100] [--duration 60] [--variants baseline,shard16]
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import threading
import time
from typing import Any

import benchlib as bl
from probes import levers

BENCH = "churn"


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run(
    variant: str, shape: bl.ClusterShape, rate: float, duration: float, *, quiet: bool
) -> dict[str, Any]:
    from nftproxy.agent.runner import Runner
    from nftproxy.kernel.libnftables import NftBackend

    latencies: list[float] = []
    syncs: list[tuple[float, float, int]] = []
    lock = threading.Lock()

    def hook(report: Any) -> None:
        """Post-commit hook (per shard): the changes this commit covered."""
        now = time.time()
        with lock:
            for fam in report.families:
                for times in fam.update.trigger_times.values():
                    latencies.extend(now - t for t in times)

    services, slices = bl.make_cluster(shape)
    with bl.bench_netns("churn") as ns, NftBackend(netns=ns) as backend:
        facade = levers.build(variant, backend, hooks=[hook])
        bl.feed(facade, services, slices)
        del services, slices
        t0 = time.perf_counter()
        facade.sync()
        bl.progress(f"{variant} {shape.label}: table loaded in {time.perf_counter() - t0:.1f}s")
        with lock:
            syncs.clear()

        def sync() -> None:
            r = facade.sync()
            with lock:
                syncs.append((r.total_seconds, r.commit_seconds, r.ops))

        runner = Runner(sync, min_interval=1.0, max_interval=30.0, retry_interval=1.0, name="sync")
        facade.set_change_callback(runner.kick)
        runner.start()
        rng = random.Random(7)
        current: dict[int, dict[str, Any]] = {}
        generation: dict[int, int] = {}
        handed = 0
        feeder_cpu = 0.0
        late = 0

        def feeder() -> None:
            nonlocal handed, feeder_cpu, late
            start = time.perf_counter()
            n = int(rate * duration)
            for k in range(n):
                due = start + k / rate
                delay = due - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                elif delay < -0.05:
                    late += 1
                c0 = time.thread_time()
                i = rng.randrange(shape.services)
                g = generation.get(i, 0) + 1
                generation[i] = g
                old = current.get(i) or bl.slice_obj(i, shape)
                new = bl.slice_obj(i, shape, generations={bl.changed_endpoint(shape): g})
                feeder_cpu += time.thread_time() - c0
                new["metadata"]["annotations"] = {
                    "endpoints.kubernetes.io/last-change-trigger-time": bl.rfc3339(time.time())
                }
                facade.on_endpoint_slice(old, new)
                current[i] = new
                handed += 1

        if quiet:
            bl.wait_quiet()
        noise = bl.Noise()
        cpu0, wall0 = _cpu(), time.perf_counter()
        thread = threading.Thread(target=feeder, name="feeder")
        thread.start()
        thread.join()
        # let the last changes reach the kernel (one more sync at most)
        deadline = time.perf_counter() + 5.0
        while time.perf_counter() < deadline:
            with lock:
                if len(latencies) >= handed:
                    break
            time.sleep(0.05)
        cpu1, wall1 = _cpu(), time.perf_counter()
        foreign = noise.foreign()
        runner.stop(timeout=30)
    with lock:
        lat = list(latencies)
        sy = list(syncs)
    wall = wall1 - wall0
    return {
        "variant": variant,
        "services": shape.services,
        "endpoints_per_service": shape.endpoints,
        "rate_per_s": rate,
        "duration_s": duration,
        "changes_handed": handed,
        "changes_programmed": len(lat),
        "feeder_late": late,
        "latency_ms": bl.summary(lat, 1000) if lat else None,
        "syncs": len(sy),
        "sync_ms": bl.summary([s[0] for s in sy], 1000) if sy else None,
        "commit_ms": bl.summary([s[1] for s in sy], 1000) if sy else None,
        "ops_p50": sorted(s[2] for s in sy)[len(sy) // 2] if sy else 0,
        "cpu_total": round((cpu1 - cpu0) / wall, 3),
        "cpu_feeder": round(feeder_cpu / wall, 3),
        "cpu_proxy": round((cpu1 - cpu0 - feeder_cpu) / wall, 3),
        "target_p99_ms": 1250,
        "foreign_cpu": foreign,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="300 services, 5 s (CI)")
    ap.add_argument("--services", type=int)
    ap.add_argument("--endpoints", type=int)
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--duration", type=float)
    ap.add_argument("--variants")
    args = ap.parse_args()
    bl.require_root()
    from nftproxy.kernel.libnftables import tune_malloc

    tune_malloc()  # as `nftproxy run` does, before any libnftables context
    shape = bl.ClusterShape(
        args.services or (300 if args.quick else 10000), args.endpoints or (5 if args.quick else 10)
    )
    duration = args.duration or (5.0 if args.quick else 60.0)
    variants = args.variants or ("baseline" if args.quick else "baseline,shard16")
    bl.emit(BENCH, "machine", **bl.machine_info(), mix=bl.MIX_DESCRIPTION)
    rows = []
    for variant in variants.split(","):
        bl.progress(f"churn {variant} {shape.label}: {args.rate}/s for {duration}s")
        r = run(variant, shape, args.rate, duration, quiet=not args.quick)
        rows.append(bl.emit(BENCH, f"{variant}/{shape.label}", **r))
    header = [
        "case",
        "latency p50 ms",
        "p99 ms",
        "max ms",
        "syncs",
        "sync p50 ms",
        "cpu proxy",
        "cpu feeder",
    ]
    table = [
        [
            r["case"],
            r["latency_ms"]["p50"],
            r["latency_ms"]["p99"],
            r["latency_ms"]["max"],
            r["syncs"],
            r["sync_ms"]["p50"],
            r["cpu_proxy"],
            r["cpu_feeder"],
        ]
        for r in rows
        if r["latency_ms"] and r["sync_ms"]
    ]
    print(bl.fmt_table(table, header), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
