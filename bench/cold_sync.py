"""Cold start: process start -> rules committed, whole-tree peak and steady RSS.

Spec items 1 and 5; issue 12's bench/ item. Sizes SxE (services x
endpoints each, benchlib's service mix): 1000x10, 10000x10, 5000x50 and
45000x1 (the shape of kubernetes#139513: 44,125 services, one endpoint
each), chosen with --sizes. Every size runs from each source (--sources),
each in a fresh process in a fresh network namespace, one at a time:

- `api`: the real agent, `nftproxy run --kubeconfig`, listing everything
  (paged, as the informers do) from tests/fakeapi.py's FakeApiServer
  holding the same objects, served on the namespace's loopback by this
  process (bench/agentrun.py). start->commit = spawn -> the agent's own
  timestamp of its first committed full sync, read from its /metrics.
- `pod` (not in the default --sources): the same agent as a DaemonSet pod
  starts it: configured in-cluster (KUBERNETES_SERVICE_HOST/PORT, a
  service-account token and the CA under a fresh /run in its own mount
  namespace), the same FakeApiServer over TLS (bench/agentrun.py
  `in_cluster`). `api` runs it from a kubeconfig over plain HTTP, which
  imports the kubeconfig loader a pod never does (~6 MB).
- `agent-file`: the same agent with `--source` a `kind: List` JSON file.
- `api-restart`: the `api` agent run once (to its first commit, then
  stopped: rules left in place, as a DaemonSet rollout leaves them), then
  started again in the same namespace; the figures are the second run's: a
  full sync over existing tables (not in the default --sources).
- `file`: the harness of before (kept for comparison with earlier runs and
  for bench/probes/levers.py's variants): a fresh Python process does what
  `nftproxy run` does at startup -- tune malloc, open the backend, read the
  initial list (a JSON file of Services and EndpointSlices), feed it to a
  Proxier, sync once -- then reports feed_s, render_s, commit_s (SyncReport),
  ops, its own peak RSS (ru_maxrss) and RSS after the sync, after
  malloc_trim(0), after one small partial sync on the same context, and
  after freeing the context.

Memory, every source: the RSS of the started process's WHOLE tree (the
agent plus every descendant, e.g. a helper child that renders or commits a
full sync), summed and sampled every --sample-interval s by benchlib's
TreeSampler: `peak_tree_mb` (and the agent process alone / its children
alone), and `steady_tree_mb` read --idle s (default 30) after the commit
(`file`: after its partial sync). Every line names the userspace
(libnftables version, Debian release); run it inside the trixie userspace
with `scripts/userspace.sh run .userspaces/trixie /opt/nftproxy/bin/python
bench/cold_sync.py ...` (bench/run_all.sh --userspaces host,trixie).

Variants (`file` source only): `baseline` is the product as it is;
`baseline-nofresh` forces every commit onto the long-lived context; lever
variants (bench/probes/levers.py, e.g. `shard16`, `shard16+split`) run the same
Proxier with the structural levers around it. A variant
may end in `@NAME=VALUE` (repeatable): environment of the child, e.g.
`baseline@PYTHONMALLOC=malloc`.

    python bench/cold_sync.py [--quick] [--sizes 1000x10,10000x10,5000x50,45000x1]
        [--sources api,agent-file,file,api-restart,pod] [--idle 30] [--variants baseline,...]
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import agentrun
import benchlib as bl

BENCH = "cold_sync"
FULL_SIZES = "1000x10,10000x10,5000x50,45000x1"
QUICK_SIZES = "200x5"
SOURCES = ("api", "agent-file", "file")
EXTRA_SOURCES = ("api-restart", "pod")


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

    def encoded(self, commands: Any) -> Any:
        return self.inner.encoded(commands)

    def list_table_objects(self, family: str, table: str) -> Any:
        return self.inner.list_table_objects(family, table)


def child(args: argparse.Namespace) -> None:
    """Runs in the fresh process: one cold sync, one JSON line on stdout."""
    t_main = time.time()
    from probes import levers

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
    time.sleep(args.idle)
    out["steady_tree_mb"] = bl.tree_rss_mb(os.getpid())
    backend.close()  # frees the context, then malloc_trim(0)
    out["rss_after_ctx_free_mb"] = bl.rss_mb()
    out["peak_rss_final_mb"] = bl.peak_rss_mb()
    print(json.dumps(out), flush=True)


class Cluster:
    """One size's objects, and each source's way of serving them (made once
    per size, reused by every source and repetition)."""

    def __init__(self, shape: bl.ClusterShape, workdir: Path) -> None:
        self.shape = shape
        self.workdir = workdir
        self.services, self.slices = bl.make_cluster(shape)
        self._api: agentrun.ApiCluster | None = None
        self.api_list_requests = 0
        """List requests (pages) the fake API server answered in the last `api` run."""

    def child_list(self) -> Path:
        """The `file` harness's input: {"services": [...], "slices": [...]}."""
        path = self.workdir / f"list-{self.shape.label}.json"
        if not path.exists():
            path.write_text(json.dumps({"services": self.services, "slices": self.slices}))
        return path

    @contextlib.contextmanager
    def agent_source(self, source: str, ns: str) -> Iterator[agentrun.Launch]:
        """How the agent starts from `source`, served while inside."""
        if source == "agent-file":
            path = self.workdir / f"items-{self.shape.label}.json"
            yield agentrun.write_list(path, self.services, self.slices)
            return
        if self._api is None:
            self._api = agentrun.ApiCluster(self.services, self.slices)
        with self._api.serving(ns, self.workdir, pod=source == "pod") as launch:
            yield launch
            self.api_list_requests = self._api.list_requests()


def run_file(cluster: Cluster, variant: str, args: argparse.Namespace, ns: str) -> dict[str, Any]:
    """The `file` harness in a fresh child process, its tree sampled."""
    variant, *assignments = variant.split("@")
    env = dict(os.environ)
    for assignment in assignments:
        name, _, value = assignment.partition("=")
        env[name] = value
    argv = [
        sys.executable, __file__, "--child",
        "--list", str(cluster.child_list()),
        "--netns", ns,
        "--variant", variant,
        "--services", str(cluster.shape.services),
        "--endpoints", str(cluster.shape.endpoints),
        "--idle", str(args.idle),
    ]  # fmt: skip
    t0 = time.time()
    proc = subprocess.Popen(
        [*argv, "--t0", repr(t0)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env,
    )  # fmt: skip
    with bl.TreeSampler(proc.pid, args.sample_interval) as sampler:
        out, err = proc.communicate(timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}): {err[-2000:]}")
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    memory = sampler.result()
    return {
        **result,
        "peak_tree_mb": memory.peak_mb,
        "peak_agent_mb": memory.peak_root_mb,
        "peak_children_mb": memory.peak_children_mb,
        "peak_hwm_sum_mb": memory.hwm_sum_mb,
        "max_processes": memory.max_processes,
        "steady_after_s": args.idle,
    }


def run_agent(
    cluster: Cluster, source: str, args: argparse.Namespace, ns: str, *, idle: float | None = None
) -> dict[str, Any]:
    """`nftproxy run` from `source` (bench/agentrun.py)."""
    if source == "api-restart":
        run_agent(cluster, "api", args, ns, idle=1.0)  # the first start: tables left in place
        source = "api"
    run = agentrun.AgentRun(
        ns=ns,
        workdir=cluster.workdir,
        label=f"{cluster.shape.label}-{source}" + ("-first" if idle is not None else ""),
        idle=args.idle if idle is None else idle,
        interval=args.sample_interval,
        timeout=args.timeout,
    )
    with cluster.agent_source(source, ns) as launch:
        result = agentrun.run_agent(run, launch)
    if source in ("api", "pod"):
        result["api_list_requests"] = cluster.api_list_requests
    return result


def measure(
    cluster: Cluster, source: str, variant: str, args: argparse.Namespace, rep: int
) -> dict[str, Any]:
    """One cold start in a fresh namespace; its result line."""
    shape = cluster.shape
    bl.progress(f"cold start {shape.label} {source} {variant} (rep {rep + 1})")
    if not args.quick:
        bl.wait_quiet()
    noise = bl.Noise()
    with bl.bench_netns("cold") as ns:
        if source == "file":
            r = run_file(cluster, variant, args, ns)
        else:
            r = run_agent(cluster, source, args, ns)
    r["foreign_cpu"] = noise.foreign()
    return bl.emit(
        BENCH,
        f"{shape.label}/{source}" + (f"/{variant}" if source == "file" else ""),
        services=shape.services,
        endpoints_per_service=shape.endpoints,
        source=source,
        variant=variant,
        rep=rep,
        **r,
    )


TABLE: tuple[tuple[str, Callable[[dict[str, Any]], Any]], ...] = (
    ("case", lambda r: r["case"]),
    ("userspace", lambda r: r["userspace"]),
    ("start->commit s", lambda r: r["start_to_commit_s"]),
    ("sync s", lambda r: r["sync_s"]),
    ("render s", lambda r: r["render_s"]),
    ("commit s", lambda r: r["commit_s"]),
    ("ops", lambda r: r["ops"]),
    ("chains", lambda r: r["chains"]),
    ("peak tree MB", lambda r: r["peak_tree_mb"]),
    ("agent/children", lambda r: f"{r['peak_agent_mb']:.0f}/{r['peak_children_mb']:.0f}"),
    ("steady MB", lambda r: r["steady_tree_mb"]),
    ("procs", lambda r: r["max_processes"]),
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, 1 s idle (CI)")
    ap.add_argument("--sizes", help=f"comma list of SxE (default {FULL_SIZES})")
    ap.add_argument(
        "--sources", default=",".join(SOURCES), help=f"comma list of {', '.join(SOURCES)}"
    )
    ap.add_argument(
        "--variants",
        help="`file` source only: comma list: baseline (the product as is), "
        "baseline-nofresh, and lever variants of bench/probes/levers.py, e.g. "
        "shard16, shard16+split (default: baseline; quick: baseline,shard4)",
    )
    ap.add_argument("--idle", type=float, help="seconds after the commit to read steady RSS "
                    "(default 30; quick 1)")  # fmt: skip
    ap.add_argument("--sample-interval", type=float, default=0.05, help="RSS sampling, s")
    ap.add_argument("--timeout", type=float, default=3600.0, help="per cold start, s")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--list", help=argparse.SUPPRESS)
    ap.add_argument("--netns", help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="baseline", help=argparse.SUPPRESS)
    ap.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--services", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--endpoints", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.idle is None:
        args.idle = 1.0 if args.quick else 30.0
    if args.child:
        child(args)
        return 0
    bl.require_root()
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    shapes = [bl.parse_shape(size) for size in sizes.split(",")]
    sources = args.sources.split(",")
    if unknown := set(sources) - set(SOURCES) - set(EXTRA_SOURCES):
        ap.error(f"unknown sources {sorted(unknown)}")
    variants = (
        args.variants or ("baseline,shard4" if args.quick else "baseline")
    ).split(",")
    bl.emit(BENCH, "machine", **bl.machine_info(), mix=bl.MIX_DESCRIPTION)
    rows = []
    with tempfile.TemporaryDirectory(prefix="nftpx-bench-") as workdir:
        for shape in shapes:
            cluster = Cluster(shape, Path(workdir))
            for rep in range(args.repeat):
                for source in sources:
                    for variant in variants if source == "file" else ["product"]:
                        rows.append(measure(cluster, source, variant, args, rep))
            del cluster
    table = [[cell(r) for _, cell in TABLE] for r in rows]
    print(bl.fmt_table(table, [name for name, _ in TABLE]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
