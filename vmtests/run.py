"""Run the multi-node scenarios and print a summary (as root).

    python vmtests/run.py --mode netns      # no VMs: namespaces on this machine
    python vmtests/run.py --mode vm         # inside the client VM of a VM cluster

Layer: vmtests (the runner). One job: bring up a driver, run
vmtests/scenarios.py's scenarios in order, print one PASS/FAIL line per
scenario and a JSON summary (versions, timings, notes per scenario) between
the lines NFTVM-RESULT-BEGIN and NFTVM-RESULT-END, where the qemu host
script (vmtests/qemu/run-cluster.sh) picks it up from the serial console.
Exit status 0 only if every scenario passed.

--mode vm: this machine is the client (192.168.56.20 on the LAN). The
runner starts the API server there (the fake API server of tests/fakeapi.py,
plain HTTP on :6443) with the base objects, waits for the node daemons
(vmtests/vmnode.py on 192.168.56.11 and .12, port 7070), starts
`nftproxy run` on every node through them, runs the scenarios and stops
the agents again. Nothing outside the cluster's LAN is contacted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import platform
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: vmtests/ is not installed
    sys.path.insert(0, str(ROOT))

from nftproxy.tools.sandbox import cluster  # noqa: E402
from vmtests import scenarios  # noqa: E402
from vmtests.apiserver import LanApiServer  # noqa: E402

BEGIN, END = "NFTVM-RESULT-BEGIN", "NFTVM-RESULT-END"
CLIENT_NS = "nftvm-client"


def _versions() -> dict[str, str]:
    out = {"kernel": platform.release(), "python": platform.python_version()}
    for dist in ("nftproxy", "kubernetes", "pyroute2"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    try:
        nft = subprocess.run(["nft", "--version"], capture_output=True, text=True, check=False)
        out["nft"] = nft.stdout.strip()
    except OSError as exc:
        out["nft"] = f"unavailable: {exc}"
    return out


def _run_all(d: scenarios.Driver, only: Sequence[str]) -> list[scenarios.Result]:
    chosen = [s for s in scenarios.SCENARIOS if not only or s.name in only]
    unknown = set(only) - {s.name for s in scenarios.SCENARIOS}
    if unknown:
        raise SystemExit(f"unknown scenarios: {sorted(unknown)}")
    results = []
    for scenario in chosen:
        print(f"--- {scenario.name}", flush=True)
        result = scenarios.run_scenario(scenario, d)
        state = "PASS" if result.ok else "FAIL"
        print(f"{state} {scenario.name} {result.seconds:.1f}s {json.dumps(result.notes)}")
        if not result.ok:
            print(f"     {result.error}")
        sys.stdout.flush()
        results.append(result)
    return results


@contextlib.contextmanager
def _netns_driver() -> Iterator[tuple[scenarios.Driver, dict[str, Any]]]:
    from vmtests import netns_driver

    with netns_driver.running() as d:
        yield d, {}


@contextlib.contextmanager
def _vm_driver(
    daemons: dict[str, str], slow: float, wait: float
) -> Iterator[tuple[scenarios.Driver, dict[str, Any]]]:
    from vmtests.vm_driver import VmDriver

    plan = cluster.plan()
    with cluster.attached(CLIENT_NS) as client_ns:
        api = LanApiServer(plan.client_ipv4[0], cluster.API_PORT)
        api.start()
        try:
            for obj in scenarios.base_objects(plan):
                api.apply(obj)
            d = VmDriver(plan, api, client_ns=client_ns, daemons=daemons, slow=slow)
            t0 = time.monotonic()
            status = d.wait_ready(wait)
            print(f"node daemons ready after {time.monotonic() - t0:.0f}s", flush=True)
            agents: dict[str, Any] = {}  # filled at the end: starts and exit status
            started: list[str] = []
            try:
                for node in plan.nodes:
                    d.start_agent(node.name)
                    started.append(node.name)
                # `nftproxy run` takes a while to start in an emulated VM
                first = scenarios.wait_converged(d, timeout=120)
                print(f"agents started and synced in {first:.0f}s", flush=True)
                yield d, {"nodes": status, "agents": agents, "first_sync_s": round(first, 1)}
            finally:
                for name in started:
                    try:
                        rc = d.stop_agent_status(name)
                        agents[name] = {"starts": d.agent_starts(name), "last_exit": rc}
                    except Exception as exc:
                        agents[name] = {"error": str(exc)}
        finally:
            api.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vmtests/run.py", description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=("netns", "vm"), default="netns")
    parser.add_argument("--only", action="append", default=[], metavar="SCENARIO")
    parser.add_argument("--json", metavar="FILE", help="also write the summary here")
    parser.add_argument(
        "--node",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="a node daemon (--mode vm; default: every node of the plan on port 7070)",
    )
    parser.add_argument("--slow", type=float, default=4.0, help="wait scale in VMs (--mode vm)")
    parser.add_argument(
        "--wait", type=float, default=900.0, help="seconds to wait for the node daemons"
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    started = time.time()
    t0 = time.monotonic()
    summary: dict[str, Any] = {"mode": args.mode, "versions": _versions()}
    results: list[scenarios.Result] = []
    try:
        if args.mode == "vm":
            daemons = dict(n.split("=", 1) for n in args.node) or {
                n.name: f"http://{n.lan_ipv4}:7070" for n in cluster.plan().nodes
            }
            driver = _vm_driver(daemons, args.slow, args.wait)
        else:
            driver = _netns_driver()
        with driver as (d, extra):
            summary.update(extra)
            summary["setup_s"] = round(time.monotonic() - t0, 1)
            results = _run_all(d, args.only)
    except Exception as exc:  # the summary still says what happened
        summary["error"] = f"{type(exc).__name__}: {exc}"
        print(f"ERROR {summary['error']}", flush=True)
    summary["started"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))
    summary["total_s"] = round(time.monotonic() - t0, 1)
    summary["scenarios"] = [
        {
            "name": r.name,
            "ok": r.ok,
            "seconds": round(r.seconds, 1),
            "notes": r.notes,
            **({"error": r.error[:2000]} if r.error else {}),
        }
        for r in results
    ]
    passed = sum(r.ok for r in results)
    ok = "error" not in summary and bool(results) and passed == len(results)
    summary["result"] = f"{passed}/{len(results)} passed" + ("" if ok else " (FAILED)")
    text = json.dumps(summary, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(BEGIN)
    print(text)
    print(END, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
