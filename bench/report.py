"""Markdown tables from the JSON lines bench/run_all.sh wrote (for RESULTS.md).

Each section reads `<name>.jsonl` (host userspace) and `<name>.<userspace>.jsonl`
(e.g. `.trixie`, written by run_all.sh --userspaces host,trixie) and names
the userspace on every row. The first section, "Targets", is one line per
size and userspace: cold start from the API server (and as a pod), whole-tree
peak RSS at a first start and at a restart, steady RSS, partial
add/change/delete p50/p99 -- the figures of RESULTS.md's targets and
ceilings table.

python bench/report.py [DIR]   # DIR: run_all.sh's --out, bench/out by default
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def load(root: Path, name: str) -> list[dict[str, Any]]:
    """The rows of `name` from every userspace, host first."""
    rows = []
    for path in [root / f"{name}.jsonl", *sorted(root.glob(f"{name}.*.jsonl"))]:
        if path.exists():
            lines = path.read_text().splitlines()
            file_rows = [_named(json.loads(line)) for line in lines if line.strip()]
            _userspaces(file_rows)
            rows += file_rows
    return rows


def _named(row: dict[str, Any]) -> dict[str, Any]:
    """Rows from before every line named its userspace: the machine line's
    libnftables version stands in."""
    if "userspace" not in row and "libnftables1" in row:
        row["userspace"] = f"libnftables {row['libnftables1'].split('-')[0]}"
    return row


def _userspaces(rows: list[dict[str, Any]]) -> None:
    """Give every row of a file its machine line's userspace if it has none."""
    current = ""
    for row in rows:
        if row["case"] == "machine":
            current = row.get("userspace", "")
        row.setdefault("userspace", current)


def measured(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["case"] != "machine"]


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"
    return "" if v is None else str(v)


def machine(rows: list[dict[str, Any]]) -> str:
    keys = ("kernel", "cpu", "cores", "mem_gb", "nft", "libnftables1", "iptables", "python", "git")
    return "\n\n".join(
        f"{m.get('userspace', '')}: " + ", ".join(f"{k} {m.get(k)}" for k in keys)
        for m in rows
        if m["case"] == "machine"
    )


def cold(rows: list[dict[str, Any]]) -> str:
    """Cold starts; rows from before the whole-tree sampler in the old layout."""
    if not any("source" in r for r in measured(rows)):
        return cold_legacy(rows)
    header = [
        "case",
        "userspace",
        "start→commit s",
        "sync s (render / commit)",
        "ops",
        "chains",
        "peak RSS MB, whole tree (agent / children)",
        "Σ per-process peaks MB",
        "steady RSS MB (after s)",
        "processes",
        "CPU s to commit",
        "foreign CPU",
    ]
    body = [
        [
            r["case"],
            r["userspace"],
            r["start_to_commit_s"],
            f"{r['sync_s']:.2f} ({r['render_s']:.2f} / {r['commit_s']:.2f})",
            r["ops"],
            r["chains"],
            f"{r['peak_tree_mb']:.0f} ({r['peak_agent_mb']:.0f} / {r['peak_children_mb']:.0f})",
            r.get("peak_hwm_sum_mb"),
            f"{r['steady_tree_mb']:.0f} ({r['steady_after_s']:.0f})",
            r["max_processes"],
            r.get("cpu_to_commit_s"),
            r.get("foreign_cpu"),
        ]
        for r in measured(rows)
    ]
    return table(header, body)


def cold_legacy(rows: list[dict[str, Any]]) -> str:
    header = [
        "case",
        "userspace",
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
            r["userspace"],
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
        "userspace",
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
            r["userspace"],
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
        "userspace",
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
            r["userspace"],
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


def phases(rows: list[dict[str, Any]]) -> str:
    """A first full sync's CPU by phase (bench/sync_phases.py)."""
    names = ("render", "compact", "stage", "encode", "record", "snapshot", "nft")
    return table(
        ["case", "userspace", "sync s", "CPU s", *(f"{n} CPU s" for n in names)],
        [
            [r["case"], r["userspace"], r["sync_s"], r["cpu_s"],
             *(r["phases"].get(n, {}).get("cpu_s") for n in names)]
            for r in measured(rows)
        ],
    )  # fmt: skip


def dataplane(rows: list[dict[str, Any]]) -> str:
    measured = [r for r in rows if r["case"] != "machine" and not r["case"].startswith("ratio/")]
    header = [
        "variant",
        "userspace",
        "ruleset",
        "conn/s (1 proc)",
        "p50 µs",
        "p99 µs",
        "round p50 range",
        "conn/s (2 procs)",
        "errors",
    ]
    by = {(r["userspace"], r["variant"], r["mode"]): r for r in measured}
    body = []
    for us, v in dict.fromkeys((r["userspace"], r["variant"]) for r in measured):
        lat, rate = by.get((us, v, "latency")), by.get((us, v, "rate"))
        if lat is None or rate is None:
            continue
        body.append(
            [
                v,
                lat["userspace"],
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
        ["ratio", "userspace", "latency p50", "latency p99", "conn/s (2 procs)"],
        [
            [
                f"{r['numerator']} / {r['denominator']}",
                r["userspace"],
                r.get("latency_p50_ratio"),
                r.get("latency_p99_ratio"),
                r.get("rate_ratio"),
            ]
            for r in ratios
        ],
    )
    return table(header, body) + "\n\n" + rt


TARGET_SIZES = ((1000, 10), (10000, 10), (5000, 50), (45000, 1))


def targets(root: Path) -> str:
    """One line per size and userspace: the product's numbers that RESULTS.md's
    targets and ceilings table holds (cold_sync api/api-restart/pod/agent-file,
    partial_sync[_45k] baseline)."""
    colds = measured(load(root, "cold_sync"))
    partials = [
        r
        for name in ("partial_sync", "partial_sync_45k")
        for r in measured(load(root, name))
        if r.get("variant") == "baseline"
    ]
    body = []
    for us in dict.fromkeys(r["userspace"] for r in colds + partials):
        for services, endpoints in TARGET_SIZES:
            key = (us, services, endpoints)
            cold_by = {r.get("source"): r for r in colds if _where(r) == key}
            steps = {r["step"]: r for r in partials if _where(r) == key}
            if cold_by or steps:
                body.append([f"{services}x{endpoints}", us, *_target_cells(cold_by, steps)])
    header = [
        "size",
        "userspace",
        "cold start→committed, API s",
        "…as a pod s",
        "…from a file s",
        "peak RSS MB, whole tree",
        "…at a restart",
        "steady RSS MB",
        "peak / steady MB as a pod",
        "partial add p50 / p99 ms",
        "change endpoint",
        "delete service",
    ]
    return table(header, body)


def _where(r: dict[str, Any]) -> tuple[str, int, int]:
    return r["userspace"], r["services"], r["endpoints_per_service"]


def _target_cells(
    cold_by: dict[Any, dict[str, Any]], steps: dict[str, dict[str, Any]]
) -> list[Any]:
    api, pod, from_file = cold_by.get("api"), cold_by.get("pod"), cold_by.get("agent-file")
    restart = cold_by.get("api-restart")

    def pct(step: str) -> str | None:
        r = steps.get(step)
        return None if r is None else f"{r['sync_ms']['p50']:.1f} / {r['sync_ms']['p99']:.1f}"

    return [
        api and api["start_to_commit_s"],
        pod and pod["start_to_commit_s"],
        from_file and from_file["start_to_commit_s"],
        api and api["peak_tree_mb"],
        restart and restart["peak_tree_mb"],
        api and f"{api['steady_tree_mb']:.0f} (after {api['steady_after_s']:.0f} s)",
        pod and f"{pod['peak_tree_mb']:.0f} / {pod['steady_tree_mb']:.0f}",
        pct("add"),
        pct("change"),
        pct("delete"),
    ]


SECTIONS = (
    ("Cold start → committed: the agent from the API server and from a file, "
     "and the file harness; whole-tree memory", "cold_sync", cold),
    ("Partial sync", "partial_sync", partial),
    ("Partial sync, 45,000 x 1", "partial_sync_45k", partial),
    ("Churn", "churn", churn),
    ("Dataplane", "dataplane", dataplane),
    ("A first full sync's CPU, phase by phase", "sync_phases", phases),
)  # fmt: skip


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "out")
    print(f"### Targets\n\n{targets(root)}\n")
    for title, name, fn in SECTIONS:
        rows = load(root, name)
        if rows:
            print(f"### {title}\n\n{machine(rows)}\n\n{fn(rows)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
