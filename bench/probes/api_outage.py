"""API server outage: how soon after the API server is back does a change reach the kernel.

Issue 13. The real Agent (KubeSource's four informers, Runner, Proxier;
kube-proxy's minSyncPeriod 1 s and syncPeriod 30 s) runs in this process
against tests/fakeapi.py's FakeApiServer, which speaks the real list/watch
protocol on 127.0.0.1 to the real kubernetes client. Each repetition:
start a fresh server and agent, wait for the first sync and every watch,
stop the server for OUTAGE seconds (watches cut, connections refused), start
it again on the same port with a new watch cache (the old resourceVersion
answers 410, as a restarted kube-apiserver's does), create a Service and
its EndpointSlice at once, and time from the server being back to:
- `resume_s`: each informer's re-list complete (services, endpointslices,
  nodes, servicecidrs; the largest is printed, all are in the JSON line);
- `recovery_s`: the new endpoint in the kernel's table (polled every 5 ms).
`warnings` counts the WARNING lines logged meanwhile (all loggers, urllib3
included).

Variants: `after` is this tree's informer; `before` is the informer and
KubeSource of git revision --before-rev (the last one before the recovery
work), loaded from `git show` into this process; skipped if that revision is
not in the repository.

Backend: the real NftBackend in a throwaway network namespace (`--backend
nft`, the default as root; the userspace, `nft --version`, is printed), or
FakeBackend (`--backend fake`, no root needed).

    python bench/probes/api_outage.py [--quick] [--outage 30] [--reps 5]
        [--variants after,before] [--backend nft|fake] [--before-rev REV]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: benchlib
import benchlib as bl
from fakeapi import FakeApiServer
from k8s import endpoint_slice, node, service

BENCH = "api_outage"
BEFORE_REV = "6738db05588fe3d05c37209382c14baccce0d127"
RESOURCES = ("services", "endpointslices", "nodes", "servicecidrs")
POLL = 0.005

SourceClass = Callable[..., Any]


# -- the two informers ----------------------------------------------------------------


def _git_show(rev: str, path: str) -> str:
    return subprocess.run(
        ["git", "-C", str(bl.ROOT), "show", f"{rev}:{path}"],
        capture_output=True, text=True, check=True,
    ).stdout


def _module(name: str, source: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__file__ = f"<{name}>"
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def before_source(rev: str) -> SourceClass | None:
    """KubeSource as of `rev`, with that revision's informer; None if absent."""
    try:
        informer = _git_show(rev, "nftproxy/cluster/informer.py")
        kube = _git_show(rev, "nftproxy/cluster/kube.py")
    except (OSError, subprocess.CalledProcessError):
        return None
    _module("_before_informer", informer)
    kube = kube.replace("from nftproxy.cluster.informer import", "from _before_informer import")
    cls: SourceClass = _module("_before_kube", kube).KubeSource
    return cls


def after_source() -> SourceClass:
    from nftproxy.cluster.kube import KubeSource

    return KubeSource


# -- one repetition --------------------------------------------------------------------


class WarningCount(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def _until(check: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL)
    return True


@contextlib.contextmanager
def running_agent(api: FakeApiServer, source_cls: SourceClass, backend: Any
                  ) -> Iterator[tuple[Any, list[Any]]]:
    from nftproxy.agent.agent import Agent

    config = bl.bench_config(healthz_bind_address="", metrics_bind_address="")
    client = api.api_client()
    sources: list[Any] = []

    def factory(handler: Any) -> Any:
        sources.append(source_cls(client, handler, node_name=bl.NODE))
        return sources[-1]

    agent = Agent(config, backend=backend, source_factory=factory)
    try:
        agent.start()
        yield agent, sources
    finally:
        agent.stop()


def one(source_cls: SourceClass, backend: Any, rep: int, outage: float,
        warnings: WarningCount) -> dict[str, Any]:
    endpoint = f"10.128.{rep + 1}.7"
    with FakeApiServer() as api, running_agent(api, source_cls, backend) as (agent, sources):
        api.create(node(bl.NODE, [bl.NODE_IP]))
        api.create(service("before", "10.96.0.10"))
        api.create(endpoint_slice("before", [("10.128.0.2", bl.NODE)], family="IPv4"))
        if not agent.synced.wait(60):
            raise RuntimeError("no first sync")
        for resource in RESOURCES:
            api.wait_watchers(resource, timeout=30)
        stats = sources[0].stats
        lists = {r: stats[r].lists for r in RESOURCES}
        noise = bl.Noise()
        warnings.count = 0
        api.stop()
        time.sleep(outage)
        api.start(forget_history=True)
        back = time.monotonic()
        api.create(service("after", "10.96.0.20"))
        api.create(endpoint_slice("after", [(endpoint, bl.NODE)], family="IPv4"))
        resume: dict[str, float] = {}

        def resumed() -> bool:
            now = time.monotonic() - back
            for r in RESOURCES:
                if r not in resume and stats[r].lists > lists[r]:
                    resume[r] = round(now, 3)
            return len(resume) == len(RESOURCES)

        def done() -> bool:
            resumed()
            table = backend.list_table("ip", agent.config.table_name)
            return endpoint in json.dumps(table)

        ok = _until(done, 120.0)
        recovery = round(time.monotonic() - back, 3) if ok else None
        _until(resumed, 60.0)
        return {
            "rep": rep,
            "outage_s": outage,
            "recovery_s": recovery,
            "resume_max_s": max(resume.values()) if len(resume) == len(RESOURCES) else None,
            "resume_s": resume,
            "relists": {r: stats[r].relists for r in RESOURCES},
            "warnings": warnings.count,
            "foreign_cpu": noise.foreign(),
        }


# -- backends ---------------------------------------------------------------------------


@contextlib.contextmanager
def backends(kind: str) -> Iterator[Callable[[], Any]]:
    """A factory of fresh backends (a closed NftBackend cannot start again)."""
    if kind == "fake":
        from nftproxy.kernel.fake import FakeBackend

        yield FakeBackend
        return
    from nftproxy.kernel.libnftables import NftBackend

    bl.require_root()
    with bl.bench_netns("outage") as ns:
        yield lambda: NftBackend(netns=ns)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="a 3 s outage, once")
    ap.add_argument("--outage", type=float, default=30.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variants", default="after,before")
    ap.add_argument("--backend", choices=("nft", "fake"),
                    default="nft" if os.geteuid() == 0 else "fake")
    ap.add_argument("--before-rev", default=BEFORE_REV)
    args = ap.parse_args()
    if args.quick:
        args.outage, args.reps = 3.0, 1
    warnings = WarningCount()
    logging.getLogger().addHandler(warnings)
    logging.getLogger().setLevel(logging.WARNING)
    info = bl.machine_info()
    bl.emit(BENCH, "machine", **info, backend=args.backend)
    if args.backend == "nft":
        bl.progress(f"userspace: {info['nft']} (libnftables1 {info['libnftables1']})")
    classes = {"after": after_source(), "before": before_source(args.before_rev)}
    rows = []
    with backends(args.backend) as new_backend:
        for variant in args.variants.split(","):
            cls = classes[variant]
            if cls is None:
                bl.progress(f"{variant}: revision {args.before_rev} not found; skipped")
                continue
            for rep in range(args.reps):
                bl.progress(f"{variant} #{rep + 1}: {args.outage:.0f} s outage")
                r = one(cls, new_backend(), rep, args.outage, warnings)
                rows.append(bl.emit(BENCH, variant, **r))
                bl.progress(f"  recovery {r['recovery_s']} s, informers resumed by "
                            f"{r['resume_max_s']} s, {r['warnings']} WARNING lines")
    table = []
    for variant in args.variants.split(","):
        values = [r["recovery_s"] for r in rows if r["case"] == variant]
        got = [v for v in values if v is not None]
        if got:
            table.append([variant, len(values), min(got), statistics.median(got), max(got),
                          len(values) - len(got)])
    print(bl.fmt_table(table, ["variant", "reps", "min s", "median s", "max s", "never"]),
          file=sys.stderr)


if __name__ == "__main__":
    main()
