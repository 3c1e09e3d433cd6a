"""The benchmark scripts still run: each one in --quick mode (small sizes).

Aspects:
- every script under bench/ that measures something exits 0 in --quick mode
  within its time budget (all together well under 2 minutes);
- its stdout is JSON lines, each an object with "bench" and "case", and it
  reports the cases and fields its documentation promises, with numbers
  where numbers belong.

No assertion here is about how fast anything is: benchmarks print numbers,
they never decide pass/fail on timing (bench/RESULTS.md has the numbers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
    return rows


def is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x >= 0


def is_summary(x: object) -> bool:
    return isinstance(x, dict) and all(is_number(x.get(k)) for k in ("p50", "p99", "max", "n"))


def cases(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["case"]: r for r in rows[1:]}


def test_cold_sync_reports_times_and_memory() -> None:
    got = cases(run_quick("cold_sync.py"))
    assert got, "no results"
    for row in got.values():
        for key in (
            "start_to_commit_s",
            "render_s",
            "commit_s",
            "peak_rss_mb",
            "rss_after_sync_mb",
            "rss_after_trim_mb",
            "rss_after_ctx_free_mb",
        ):
            assert is_number(row[key]), (row["case"], key)
        assert row["ops"] > 0 and row["chains"] > 0


def test_partial_sync_reports_each_step() -> None:
    got = cases(run_quick("partial_sync.py"))
    steps = {r["step"] for r in got.values()}
    assert {"add", "change", "delete", "noop", "probe_flush", "probe_rule", "probe_elem"} <= steps
    for row in got.values():
        assert is_summary(row["sync_ms"]) and is_summary(row["commit_ms"]), row["case"]
        assert is_number(row["ops"])
    assert all(r["ops"] == 0 for r in got.values() if r["step"] == "noop")
    assert all(r["ops"] > 0 for r in got.values() if r["step"] in ("add", "change", "delete"))


def test_lever_prototypes_keep_the_semantics_they_claim() -> None:
    got = cases(run_quick("levers.py"))
    assert got["verify/baseline"]["hairpin_exact"] is True
    assert got["verify/inline"]["hairpin_exact"] is True
    assert got["verify/inline"]["sep_chains"] == 0
    assert got["verify/inline-loose"]["hairpin_exact"] is False  # the looser semantics
    for row in got.values():
        assert row["errors"] == 0 and row["client_masqueraded"] and row["affinity_sticks"]


def test_churn_reports_programming_latency_and_cpu() -> None:
    got = cases(run_quick("churn.py"))
    assert got
    for row in got.values():
        assert row["changes_handed"] > 0
        assert row["changes_programmed"] == row["changes_handed"]
        assert is_summary(row["latency_ms"]) and is_summary(row["sync_ms"])
        assert is_number(row["cpu_proxy"]) and is_number(row["cpu_total"])


def test_dataplane_reports_rates_latencies_and_ratios() -> None:
    got = cases(run_quick("dataplane.py"))
    measured = [r for c, r in got.items() if not c.startswith("ratio/")]
    assert {r["mode"] for r in measured} == {"latency", "rate"}
    for row in measured:
        assert row["conn_per_s"] > 0 and is_summary(row["latency_us"]), row["case"]
        assert row["errors"] == 0, row["case"]
    ratios = [r for c, r in got.items() if c.startswith("ratio/")]
    assert ratios and all(is_number(r.get("latency_p50_ratio")) for r in ratios)
