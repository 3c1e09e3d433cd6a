"""Cold full sync: process start -> rules committed, peak and steady RSS.

Spec items 1 and 5. For each size, a FRESH Python process (so peak RSS is
that sync's own, via getrusage) is started in a throwaway network namespace
and does what `nftproxy run` does at startup: tune malloc, open the backend
(one long-lived libnftables context), read the initial list (a JSON file of
Services and EndpointSlices, the stand-in for the API server's list
response), feed it to a Proxier, and sync once. It then reports:

- start_to_commit_s: parent's clock before spawning the child -> the sync
  returned (interpreter start, imports, list parsing, feeding, render, commit);
- feed_s, render_s, commit_s (SyncReport), ops (JSON commands);
- peak_rss_mb (ru_maxrss) and RSS after the sync, after malloc_trim(0), after
  one small partial sync on the same context (the 1.0.6 cache is fetched
  again), and after freeing the context (NftBackend.close -> trim);
  these are the steady-state numbers of item 5.

Variants: `baseline` is the product as it is (its full sync commits on a
fresh libnftables context, freed right after); `baseline-nofresh` forces
every commit onto the long-lived context (the product before that change);
lever variants (bench/levers.py, e.g. `inline+fwset+shard16`) run the same
Proxier with the structural levers prototyped on the translator's output.
A variant may end in `@NAME=VALUE` (repeatable): environment of the child,
e.g. `baseline@PYTHONMALLOC=malloc` (CPython objects on glibc malloc, whose
free pages malloc_trim can return, instead of pymalloc arenas).

    python bench/cold_sync.py [--quick] [--sizes 1000x10,10000x10,5000x50]
                              [--variants default,fresh]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchlib as bl

BENCH = "cold_sync"
FULL_SIZES = "1000x10,10000x10,5000x50"
QUICK_SIZES = "200x5"


class Metered:
    """A Backend wrapper: user and system CPU of the commits (the process is
    otherwise idle during a commit, so process rusage is the commit's:
    user = Python json.dumps + libnftables parse/evaluate, sys = netlink and
    the kernel's transaction). `long_lived` ignores `fresh=True`: every
    commit, the full sync's included, runs on the one long-lived context
    (the product before it committed full syncs on a fresh context)."""

    def __init__(self, inner: Any, *, long_lived: bool = False) -> None:
        self.inner = inner
        self.long_lived = long_lived
        self.user = 0.0
        self.sys = 0.0

    def commit(self, commands: Any, *, fresh: bool = False) -> None:
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        self.inner.commit(commands, fresh=fresh and not self.long_lived)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        self.user += r1.ru_utime - r0.ru_utime
        self.sys += r1.ru_stime - r0.ru_stime

    def list_table_objects(self, family: str, table: str) -> Any:
        return self.inner.list_table_objects(family, table)

    def accepts_typeof(self) -> bool:
        return bool(self.inner.accepts_typeof())


def child(args: argparse.Namespace) -> None:
    """Runs in the fresh process: one cold sync, one JSON line on stdout."""
    t_main = time.time()
    import levers

    import nftproxy.agent.proxier  # noqa: F401  (the imports `nftproxy run` pays)
    from nftproxy.kernel.libnftables import NftBackend, tune_malloc

    tune_malloc()
    t_import = time.time()
    doc = json.loads(Path(args.list).read_text())
    t_load = time.time()
    backend = NftBackend(netns=args.netns)
    backend.start()
    lever = args.variant.removesuffix("-nofresh")
    wrapped = Metered(backend, long_lived=args.variant.endswith("-nofresh"))
    stack = contextlib.ExitStack()
    stack.enter_context(levers.lever(lever))
    proxier = levers.build(lever, wrapped)
    t_feed0 = time.time()
    bl.feed(proxier, doc["services"], doc["slices"])
    t_feed = time.time()
    report = proxier.sync()
    t_done = time.time()
    out: dict[str, Any] = {
        "start_to_commit_s": round(t_done - args.t0, 3),
        "interpreter_s": round(t_main - args.t0, 3),
        "imports_s": round(t_import - t_main, 3),
        "list_parse_s": round(t_load - t_import, 3),
        "feed_s": round(t_feed - t_feed0, 3),
        "sync_s": round(report.total_seconds, 3),
        "render_s": round(report.render_seconds, 3),
        "commit_s": round(report.commit_seconds, 3),
        "commit_user_s": round(wrapped.user, 3),
        "commit_sys_s": round(wrapped.sys, 3),
        "ops": report.ops,
        **proxier.counts(),
        "peak_rss_mb": bl.peak_rss_mb(),
        "rss_after_sync_mb": bl.rss_mb(),
    }
    del doc
    bl.malloc_trim()
    out["rss_after_trim_mb"] = bl.rss_mb()
    # one small partial sync on the long-lived context: what the agent keeps
    shape = bl.ClusterShape(args.services, args.endpoints)
    proxier.on_endpoint_slice(bl.slice_obj(1, shape), bl.slice_obj(1, shape, generations={0: 1}))
    partial = proxier.sync()
    out["partial_after_s"] = round(partial.total_seconds, 4)
    out["rss_after_partial_mb"] = bl.rss_mb()
    backend.close()  # frees the context, then malloc_trim(0)
    stack.close()
    out["rss_after_ctx_free_mb"] = bl.rss_mb()
    out["peak_rss_final_mb"] = bl.peak_rss_mb()
    print(json.dumps(out), flush=True)


def run_one(shape: bl.ClusterShape, variant: str, workdir: str, *, netns: str) -> dict[str, Any]:
    path = os.path.join(workdir, f"list-{shape.label}.json")
    if not os.path.exists(path):
        services, slices = bl.make_cluster(shape)
        Path(path).write_text(json.dumps({"services": services, "slices": slices}))
    variant, *assignments = variant.split("@")
    env = dict(os.environ)
    env.update(a.split("=", 1) for a in assignments)
    argv = [
        sys.executable,
        __file__,
        "--child",
        "--list",
        path,
        "--netns",
        netns,
        "--variant",
        variant,
        "--services",
        str(shape.services),
        "--endpoints",
        str(shape.endpoints),
    ]
    t0 = time.time()
    proc = subprocess.run(
        [*argv, "--t0", repr(t0)],
        capture_output=True,
        text=True,
        check=False,
        timeout=3600,
        env=env,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}): {proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (CI)")
    ap.add_argument("--sizes", help=f"comma list of SxE (default {FULL_SIZES})")
    ap.add_argument(
        "--variants",
        help="comma list: baseline (the product as is), baseline-nofresh, and lever "
        "variants of bench/levers.py, e.g. inline+fwset+shard16 (default: baseline; "
        "quick: baseline,inline+fwset+shard4)",
    )
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--list", help=argparse.SUPPRESS)
    ap.add_argument("--netns", help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="baseline", help=argparse.SUPPRESS)
    ap.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--services", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--endpoints", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    bl.require_root()
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    shapes = [bl.ClusterShape(*map(int, s.split("x"))) for s in sizes.split(",")]
    variants = (
        args.variants or ("baseline,inline+fwset+shard4" if args.quick else "baseline")
    ).split(",")
    bl.emit(BENCH, "machine", **bl.machine_info(), mix=bl.MIX_DESCRIPTION)
    rows = []
    with tempfile.TemporaryDirectory(prefix="nftpx-bench-") as workdir:
        for shape in shapes:
            for rep in range(args.repeat):
                for variant in variants:
                    bl.progress(f"cold sync {shape.label} {variant} (rep {rep + 1})")
                    if not args.quick:
                        bl.wait_quiet()
                    noise = bl.Noise()
                    with bl.bench_netns("cold") as ns:
                        r = run_one(shape, variant, workdir, netns=ns)
                    r["foreign_cpu"] = noise.foreign()
                    row = bl.emit(
                        BENCH,
                        f"{shape.label}/{variant}",
                        services=shape.services,
                        endpoints_per_service=shape.endpoints,
                        variant=variant,
                        rep=rep,
                        **r,
                    )
                    rows.append(row)
    header = [
        "case",
        "start->commit s",
        "render s",
        "commit s",
        "ops",
        "chains",
        "peak MB",
        "after sync",
        "after trim",
        "after partial",
        "ctx freed",
    ]
    table = [
        [
            r["case"],
            r["start_to_commit_s"],
            r["render_s"],
            r["commit_s"],
            r["ops"],
            r["chains"],
            r["peak_rss_mb"],
            r["rss_after_sync_mb"],
            r["rss_after_trim_mb"],
            r["rss_after_partial_mb"],
            r["rss_after_ctx_free_mb"],
        ]
        for r in rows
    ]
    print(bl.fmt_table(table, header), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
