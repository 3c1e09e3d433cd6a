"""The benchmark scripts still run: each one in --quick mode (small sizes).

Aspects:
- every script under bench/ that measures something exits 0 in --quick mode
  within its time budget (all together well under 2 minutes);
- its stdout is JSON lines, each an object with "bench" and "case" and the
  nftables userspace it ran with, and it reports the cases and fields its
  documentation promises, with numbers where numbers belong;
- cold_sync's sources: the real agent listing from the fake API server (every
  object listed, every page requested) and from a file, and the file harness,
  each with the memory of its whole process tree;
- the tree sampler (bench/proctree.py) counts every descendant, not only
  the process it was given;
- partial_sync's 1-endpoint shape (kubernetes#139513's) really changes an
  endpoint in its "change" step;
- levers.py's traffic check: under every lever (the product as is, and
  sharded) hairpin is exact (masquerade only when the client is the endpoint
  it was sent to), off-cluster clients are masqueraded, ClientIP affinity
  sticks, loadBalancerSourceRanges are enforced, and no v1 KUBE-SEP-* or
  KUBE-FW-* chain is left.

No assertion here is about how fast anything is: benchmarks print numbers,
they never decide pass/fail on timing (bench/RESULTS.md has the numbers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import kernel
import pytest

pytestmark = pytest.mark.kernel

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def run_quick(script: str, *args: str, budget: float = 90.0) -> list[dict[str, Any]]:
    """Run bench/<script> --quick; return its result lines (parsed)."""
    kernel.require_root()
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--quick", *args],
        capture_output=True,
        text=True,
        timeout=budget,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stderr[-3000:]}"
    rows = []
    for line in proc.stdout.splitlines():
        if not line.strip():
            continue
        row = json.loads(line)  # every stdout line is one JSON object
        assert isinstance(row, dict), line
        assert isinstance(row.get("bench"), str) and isinstance(row.get("case"), str), line
        rows.append(row)
    assert rows and rows[0]["case"] == "machine", "first line describes the machine"
    for key in ("kernel", "nft", "cpu", "cores"):
        assert key in rows[0], key
    for row in rows:  # e.g. "bookworm, libnftables 1.0.6"
        assert ", libnftables " in row.get("userspace", ""), row["case"]
    return rows


def is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x >= 0


def is_summary(x: object) -> bool:
    return isinstance(x, dict) and all(is_number(x.get(k)) for k in ("p50", "p99", "max", "n"))


def cases(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["case"]: r for r in rows[1:]}


def test_cold_sync_reports_times_and_memory() -> None:
    got = cases(run_quick("cold_sync.py"))
    assert {r["source"] for r in got.values()} == {"api", "agent-file", "file"}
    for row in got.values():
        for key in (
            "start_to_commit_s",
            "sync_s",
            "render_s",
            "commit_s",
            "peak_tree_mb",
            "peak_agent_mb",
            "peak_children_mb",
            "peak_hwm_sum_mb",
            "steady_tree_mb",
        ):
            assert is_number(row[key]), (row["case"], key)
        assert row["ops"] > 0 and row["chains"] > 0, row["case"]
        assert row["start_to_commit_s"] >= row["sync_s"] > 0, row["case"]
        assert row["peak_tree_mb"] >= row["steady_tree_mb"] > 0, row["case"]
        assert row["peak_hwm_sum_mb"] >= row["peak_tree_mb"] >= row["peak_agent_mb"], row["case"]
        assert row["max_processes"] >= 1, row["case"]
    for row in got.values():
        if row["source"] == "file":
            for key in ("peak_rss_mb", "rss_after_sync_mb", "rss_after_ctx_free_mb"):
                assert is_number(row[key]), (row["case"], key)
        else:  # the real agent: its first sync was the full one, after complete lists
            assert row["syncs_at_commit"] == 1, row["case"]
    api = got["200x5/api"]
    assert api["informer_services"] == api["informer_endpointslices"] == 200
    assert api["api_list_requests"] >= 4  # services, endpointslices, nodes, servicecidrs
    assert got["200x5/agent-file"]["chains"] == api["chains"]  # same objects, same table


def test_tree_sampler_counts_every_descendant() -> None:
    """A parent (~10 MB) whose child and grandchild each hold 64 MB for a
    second: the tree's peak has all three, the agent's own peak only the
    parent, and once they exited the tree is back to the parent."""
    sys.path.insert(0, str(BENCH))
    from proctree import TreeSampler, tree_rss_mb

    code = textwrap.dedent(
        """
        import os, sys, time
        def hold():
            block = bytearray(64 * 1024 * 1024)
            block[::4096] = b"x" * len(block[::4096])
            time.sleep(1.5)
            os._exit(0)
        if os.fork() == 0:
            if os.fork() == 0:
                hold()
            hold()
        print("forked", flush=True)
        time.sleep(3)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        with TreeSampler(proc.pid, interval=0.05) as sampler:
            assert proc.stdout is not None and proc.stdout.readline() == "forked\n"
            time.sleep(2.5)
            after = tree_rss_mb(proc.pid)
        seen = sampler.result()
    finally:
        proc.kill()
        proc.wait()
    assert seen.max_processes == 3
    assert seen.peak_children_mb >= 2 * 64
    assert seen.peak_mb >= seen.peak_root_mb + 2 * 64
    assert seen.peak_root_mb < 64
    assert seen.hwm_sum_mb >= seen.peak_mb
    assert after < seen.peak_mb - 2 * 60  # the children's memory left with them


def test_partial_sync_reports_each_step() -> None:
    got = cases(run_quick("partial_sync.py"))
    steps = {r["step"] for r in got.values()}
    assert {"add", "change", "delete", "noop", "probe_flush", "probe_rule", "probe_elem"} <= steps
    for row in got.values():
        assert is_summary(row["sync_ms"]) and is_summary(row["commit_ms"]), row["case"]
        assert is_number(row["ops"])
    assert all(r["ops"] == 0 for r in got.values() if r["step"] == "noop")
    assert all(r["ops"] > 0 for r in got.values() if r["step"] in ("add", "change", "delete"))


def test_partial_sync_single_endpoint_shape_changes_an_endpoint() -> None:
    got = cases(run_quick("partial_sync.py", "--sizes", "150x1", "--variants", "baseline"))
    assert {r["endpoints_per_service"] for r in got.values()} == {1}
    for step in ("add", "change", "delete"):
        assert got[f"baseline/150x1/{step}"]["ops"] > 0, step


def test_lever_prototypes_keep_the_semantics_they_claim() -> None:
    got = cases(run_quick("probes/levers.py"))
    assert {"verify/baseline", "verify/shard4"} <= set(got)
    for case, row in got.items():
        assert row["hairpin_exact"] is True, (case, row)  # a loose hairpin fails here
        assert row["sep_chains"] == 0 and row["fw_chains"] == 0, (case, row)
        assert row["errors"] == 0, (case, row)
        assert row["client_masqueraded"] is True, (case, row)
        assert row["spread_over_endpoints"] is True, (case, row)
        assert row["affinity_sticks"] is True, (case, row)
        assert row["source_ranges_enforced"] is True, (case, row)


def test_churn_reports_programming_latency_and_cpu() -> None:
    got = cases(run_quick("churn.py"))
    assert got
    for row in got.values():
        assert row["changes_handed"] > 0
        assert row["changes_programmed"] == row["changes_handed"]
        assert is_summary(row["latency_ms"]) and is_summary(row["sync_ms"])
        assert is_number(row["cpu_proxy"]) and is_number(row["cpu_total"])


def test_sync_phases_reports_each_phase_of_a_first_sync() -> None:
    got = cases(run_quick("sync_phases.py"))
    (row,) = got.values()
    assert row["case"] == "600x5/first_sync"
    assert is_number(row["sync_s"]) and is_number(row["cpu_s"]) and row["json_mb"] > 0
    assert row["transactions"] >= 2, "the skeleton, then the chunks: steps"
    phases = row["phases"]
    assert set(phases) == {"render", "compact", "stage", "encode", "record", "snapshot",
                           "commit", "nft"}
    for name, times in phases.items():
        assert is_number(times["cpu_s"]) and is_number(times["wall_s"]), name
    for name in ("render", "encode", "nft"):  # each was wrapped, and ran
        assert phases[name]["cpu_s"] > 0, name


def test_dataplane_reports_rates_latencies_and_ratios() -> None:
    got = cases(run_quick("dataplane.py"))
    measured = [r for c, r in got.items() if not c.startswith("ratio/")]
    assert {r["mode"] for r in measured} == {"latency", "rate"}
    for row in measured:
        assert row["conn_per_s"] > 0 and is_summary(row["latency_us"]), row["case"]
        assert row["errors"] == 0, row["case"]
    ratios = [r for c, r in got.items() if c.startswith("ratio/")]
    assert ratios and all(is_number(r.get("latency_p50_ratio")) for r in ratios)
