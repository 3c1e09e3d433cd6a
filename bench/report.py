"""Markdown tables from the JSON lines of bench/results/ (for RESULTS.md).

python bench/report.py [bench/results]
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def load(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"
    return "" if v is None else str(v)


def machine(rows: list[dict[str, Any]]) -> str:
    m = next((r for r in rows if r["case"] == "machine"), None)
    if m is None:
        return ""
    keys = ("kernel", "cpu", "cores", "mem_gb", "nft", "libnftables1", "iptables", "python", "git")
    return ", ".join(f"{k} {m.get(k)}" for k in keys)


def cold(rows: list[dict[str, Any]]) -> str:
    header = [
        "case",
        "start→commit s",
        "feed s",
        "render s",
        "commit s (user/sys)",
        "ops",
        "chains",
        "peak RSS MB",
        "RSS after sync",
        "after trim",
        "after 1 partial",
        "ctx freed",
        "foreign CPU",
    ]
    body = [
        [
            r["case"],
            r["start_to_commit_s"],
            r["feed_s"],
            r["render_s"],
            f"{r['commit_s']:.1f} ({r.get('commit_user_s', 0):.1f}/{r.get('commit_sys_s', 0):.1f})",
            r["ops"],
            r["chains"],
            r["peak_rss_mb"],
            r["rss_after_sync_mb"],
            r["rss_after_trim_mb"],
            r["rss_after_partial_mb"],
            r["rss_after_ctx_free_mb"],
            r.get("foreign_cpu"),
        ]
        for r in rows
        if r["case"] != "machine"
    ]
    return table(header, body)


def partial(rows: list[dict[str, Any]]) -> str:
    header = [
        "variant",
        "size",
        "step",
        "sync p50 ms",
        "sync p99 ms",
        "commit p50 ms",
        "commit p99 ms",
        "ops",
        "chains",
        "foreign CPU",
    ]
    body = [
        [
            r["variant"],
            f"{r['services']}x{r['endpoints_per_service']}"
            + ("" if r.get("affinity", True) else " no-aff"),
            r["step"],
            r["sync_ms"]["p50"],
            r["sync_ms"]["p99"],
            r["commit_ms"]["p50"],
            r["commit_ms"]["p99"],
            r["ops"],
            r["chains"],
            r.get("foreign_cpu"),
        ]
        for r in rows
        if r["case"] != "machine"
    ]
    return table(header, body)


def churn(rows: list[dict[str, Any]]) -> str:
    header = [
        "case",
        "changes",
        "latency p50 ms",
        "p99 ms",
        "max ms",
        "syncs",
        "sync p50 ms",
        "sync p99 ms",
        "ops p50",
        "CPU proxy",
        "CPU feeder",
        "foreign CPU",
    ]
    body = [
        [
            r["case"],
            f"{r['changes_programmed']}/{r['changes_handed']}",
            r["latency_ms"]["p50"],
            r["latency_ms"]["p99"],
            r["latency_ms"]["max"],
            r["syncs"],
            r["sync_ms"]["p50"],
            r["sync_ms"]["p99"],
            r["ops_p50"],
            r["cpu_proxy"],
            r["cpu_feeder"],
            r.get("foreign_cpu"),
        ]
        for r in rows
        if r["case"] != "machine" and r.get("latency_ms")
    ]
    return table(header, body)


def dataplane(rows: list[dict[str, Any]]) -> str:
    measured = [r for r in rows if r["case"] != "machine" and not r["case"].startswith("ratio/")]
    header = [
        "variant",
        "ruleset",
        "conn/s (1 proc)",
        "p50 µs",
        "p99 µs",
        "round p50 range",
        "conn/s (2 procs)",
        "errors",
    ]
    by = {(r["variant"], r["mode"]): r for r in measured}
    body = []
    for v in dict.fromkeys(r["variant"] for r in measured):
        lat, rate = by.get((v, "latency")), by.get((v, "rate"))
        if lat is None or rate is None:
            continue
        body.append(
            [
                v,
                lat["ruleset"][:60],
                lat["conn_per_s"],
                lat["latency_us"]["p50"],
                lat["latency_us"]["p99"],
                f"{lat['round_p50_us_min']}-{lat['round_p50_us_max']}",
                f"{rate['conn_per_s']} ({rate['conn_per_s_min']}-{rate['conn_per_s_max']})",
                lat["errors"] + rate["errors"],
            ]
        )
    ratios = [r for r in rows if r["case"].startswith("ratio/")]
    rt = table(
        ["ratio", "latency p50", "latency p99", "conn/s (2 procs)"],
        [
            [
                f"{r['numerator']} / {r['denominator']}",
                r.get("latency_p50_ratio"),
                r.get("latency_p99_ratio"),
                r.get("rate_ratio"),
            ]
            for r in ratios
        ],
    )
    return table(header, body) + "\n\n" + rt


def levers(rows: list[dict[str, Any]]) -> str:
    keys = (
        "sep_chains",
        "fw_chains",
        "hairpin_exact",
        "client_masqueraded",
        "spread_over_endpoints",
        "affinity_sticks",
        "source_ranges_enforced",
        "errors",
    )
    return table(
        ["variant", *keys],
        [[r["variant"], *(r.get(k) for k in keys)] for r in rows if r["case"] != "machine"],
    )


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "results")
    sections = [
        ("Cold full sync", "cold_sync", cold),
        ("Cold full sync, long-lived context", "cold_sync_nofresh", cold),
        ("Cold full sync, full sync committed shard by shard", "cold_sync_split", cold),
        ("Partial sync", "partial_sync", partial),
        ("Partial sync, re-run on a quiet machine", "partial_sync_rerun", partial),
        ("Partial sync, lever ladder", "partial_sync_ladder", partial),
        ("Partial sync, mix without affinity", "partial_sync_noaff", partial),
        ("Churn", "churn", churn),
        ("Churn, gc.freeze() after full syncs", "churn_gcfreeze", churn),
        ("Dataplane", "dataplane", dataplane),
        ("Lever prototypes, checked by traffic", "levers", levers),
    ]
    for title, name, fn in sections:
        rows = load(root / f"{name}.jsonl")
        if not rows:
            continue
        print(f"### {title}\n\n{machine(rows)}\n\n{fn(rows)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
