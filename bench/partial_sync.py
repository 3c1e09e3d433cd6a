"""Partial sync against a large table: add / change endpoint / delete / no-op.

Spec item 2. For each variant (bench/probes/levers.py: the product as is, and the
structural levers around the real Proxier, e.g. shard tables) and each table
size, a throwaway namespace gets the full table (the service mix of
benchlib), then R repetitions of one cycle, each step one Proxier.sync():

- add:     a new ClusterIP service with E endpoints (Service + EndpointSlice);
- change:  one endpoint of a random existing service replaced by a new pod IP;
- delete:  the service added in this cycle (Service + EndpointSlice);
- noop:    nothing changed.

Per step: p50/p90/p99 of the whole sync (wall time of sync()) and of the
commit alone (SyncReport.commit_seconds: the libnftables call), and the ops
(JSON commands) per transaction. Three probe transactions on a scratch
table (one chain, one plain set) in the same namespace price the parts of a
commit that do not depend on what changed:
- `probe_flush` (`flush chain`): no cache fetch, nothing to validate: the
  floor of one libnftables call + kernel commit;
- `probe_rule` (+ `add rule ... accept`): libnftables 1.0.6 first dumps
  every table, chain, set and object of the namespace (the kernel validates
  only the tiny scratch table);
- `probe_elem` (+ `add element` to the plain set): the same dumps, plus the
  elements of EVERY interval set of the namespace (1.0.6's
  NFT_CACHE_SETELEM_MAYBE), one netlink dump per set.
probe_rule - probe_flush and probe_elem - probe_flush are the cache taxes
that the 1.0.6 "block" forms or libnftables >= 1.1.1 would remove; what a
real step costs beyond probe_elem is mostly the kernel's table validation.

Sizes: a list of S (services, each with --endpoints endpoints) or SxE, e.g.
`--sizes 1000x10,10000x10,45000x1` (45000x1: the shape of kubernetes#139513).

Reference: upstream kube-proxy (nftables mode) needs 141 ms to add one
service to a 10,000-service table (kubernetes#126013).

    python bench/partial_sync.py [--quick] [--sizes 1000,10000|SxE,...] [--endpoints 10]
        [--reps 50] [--variants baseline,shard16]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
from typing import Any

import benchlib as bl
from probes import levers

BENCH = "partial_sync"
STEPS = ("add", "change", "delete", "noop", "probe_flush", "probe_rule", "probe_elem")
PROBE_TABLE = "nftpx-probe"


def _probe(backend: Any, kind: str) -> float:
    from nftproxy.core.nft import commands as c
    from nftproxy.core.rules.fragment import Element, Rule

    t = c.Where("ip", PROBE_TABLE)
    cmds: list[Any] = [c.FlushChain(t, "c")]
    if kind == "rule":
        cmds.append(c.AddRule(t, "c", Rule(({"accept": None},))))
    elif kind == "elem":
        cmds += [c.FlushSet(t, "s"), c.AddElements(t, "s", (Element("s", ("10.0.0.1",)),))]
    t0 = time.perf_counter()
    backend.commit(cmds)
    return time.perf_counter() - t0


class Cycle:
    """The four steps, against one facade."""

    def __init__(self, facade: Any, backend: Any, shape: bl.ClusterShape, seed: int = 1) -> None:
        self.facade = facade
        self.backend = backend
        self.shape = shape
        self.rng = random.Random(seed)
        self.generation: dict[int, int] = {}
        self.added = bl.ClusterShape(shape.services, shape.endpoints, mix=False)

    def _sync(self) -> tuple[float, float, int]:
        t0 = time.perf_counter()
        r = self.facade.sync()
        return time.perf_counter() - t0, r.commit_seconds, r.ops

    def run(self, rep: int) -> dict[str, tuple[float, float, int]]:
        out: dict[str, tuple[float, float, int]] = {}
        i_new = self.shape.services + rep
        name = f"bench-add-{rep}"
        svc = bl.service_obj(i_new, self.added, name=name)
        eps = bl.slice_obj(i_new, self.added, name=name)
        self.facade.on_service(None, svc)
        self.facade.on_endpoint_slice(None, eps)
        out["add"] = self._sync()
        i = self.rng.randrange(self.shape.services)
        j = bl.changed_endpoint(self.shape)
        g = self.generation.get(i, 0)
        old = bl.slice_obj(i, self.shape, generations={j: g} if g else None)
        self.generation[i] = g + 1
        new = bl.slice_obj(i, self.shape, generations={j: g + 1})
        self.facade.on_endpoint_slice(old, new)
        out["change"] = self._sync()
        self.facade.on_service(svc, None)
        self.facade.on_endpoint_slice(eps, None)
        out["delete"] = self._sync()
        out["noop"] = self._sync()
        for kind in ("flush", "rule", "elem"):
            x = _probe(self.backend, kind)
            out[f"probe_{kind}"] = (x, x, 1 if kind == "flush" else 2 if kind == "rule" else 3)
        return out


def run_variant(
    variant: str, shape: bl.ClusterShape, reps: int, warmup: int, *, quiet: bool
) -> list[dict[str, Any]]:
    from nftproxy.kernel.libnftables import NftBackend

    rows = []
    services, slices = bl.make_cluster(shape)
    with bl.bench_netns("part") as ns, NftBackend(netns=ns) as backend:
        facade = levers.build(variant, backend)
        bl.feed(facade, services, slices)
        del services, slices
        t0 = time.perf_counter()
        full = facade.sync()
        load_s = time.perf_counter() - t0
        from nftproxy.core.nft import commands as c
        from nftproxy.core.rules.fragment import SetDecl

        t = c.Where("ip", PROBE_TABLE)
        backend.commit(
            [c.AddTable(t), c.AddChain(t, "c"), c.AddSet(t, "s", SetDecl.keyed("s", ("ip daddr",)))]
        )
        counts = facade.counts()
        bl.progress(
            f"{variant} {shape.label}: table loaded in {load_s:.1f}s ({counts['chains']} chains)"
        )
        cycle = Cycle(facade, backend, shape)
        samples: dict[str, list[tuple[float, float, int]]] = {s: [] for s in STEPS}
        if quiet:
            bl.wait_quiet()
        noise = bl.Noise()
        for rep in range(warmup + reps):
            result = cycle.run(rep)
            if rep >= warmup:
                for step, v in result.items():
                    samples[step].append(v)
        for step in STEPS:
            walls = [s[0] for s in samples[step]]
            commits = [s[1] for s in samples[step]]
            ops = sorted(s[2] for s in samples[step])
            rows.append(
                bl.emit(
                    BENCH,
                    f"{variant}/{shape.label}/{step}",
                    variant=variant,
                    services=shape.services,
                    endpoints_per_service=shape.endpoints,
                    mix=shape.mix,
                    affinity=shape.affinity,
                    step=step,
                    sync_ms=bl.summary(walls, 1000),
                    commit_ms=bl.summary(commits, 1000),
                    ops=ops[len(ops) // 2],
                    table_load_s=round(load_s, 2),
                    foreign_cpu=noise.foreign(),
                    full_ops=full.ops,
                    **counts,
                )
            )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few reps (CI)")
    ap.add_argument("--sizes")
    ap.add_argument("--endpoints", type=int)
    ap.add_argument("--reps", type=int)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variants")
    ap.add_argument("--plain", action="store_true", help="only plain ClusterIP services")
    ap.add_argument("--no-affinity", action="store_true", help="the mix without affinity")
    args = ap.parse_args()
    bl.require_root()
    from nftproxy.kernel.libnftables import tune_malloc

    tune_malloc()  # as `nftproxy run` does, before any libnftables context
    sizes = args.sizes or ("100,300" if args.quick else "1000,10000")
    endpoints = args.endpoints or (3 if args.quick else 10)
    reps = args.reps or (5 if args.quick else 50)
    warmup = 1 if args.quick else args.warmup
    variants = args.variants or ("baseline,shard4" if args.quick else "baseline,shard16")
    bl.emit(BENCH, "machine", **bl.machine_info(), mix=bl.MIX_DESCRIPTION)
    rows = []
    for variant in variants.split(","):
        for size in sizes.split(","):
            shape = dataclasses.replace(
                bl.parse_shape(size, endpoints), mix=not args.plain, affinity=not args.no_affinity
            )
            bl.progress(f"partial sync {variant} {shape.label}: {reps} reps")
            rows += run_variant(variant, shape, reps, warmup, quiet=not args.quick)
    header = ["case", "sync p50 ms", "sync p99 ms", "commit p50 ms", "commit p99 ms", "ops"]
    table = [
        [
            r["case"],
            r["sync_ms"]["p50"],
            r["sync_ms"]["p99"],
            r["commit_ms"]["p50"],
            r["commit_ms"]["p99"],
            r["ops"],
        ]
        for r in rows
    ]
    print(bl.fmt_table(table, header), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
