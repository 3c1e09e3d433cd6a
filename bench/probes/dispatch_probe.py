"""What a service add costs in a table of per-service choosers vs shared ones.

Layer: bench tooling. One job: price the next ruleset lever for partial
adds, on a minimal table in nft text (not the product's): N services
dispatched by one `ip daddr . meta l4proto . th dport` verdict map, each
to a chooser chain (a masquerade jump, then `meta l4proto tcp dnat ip to
ip daddr . tcp dport . numgen random mod E map @ep`), whose endpoints are
E elements per service in one data map. Two shapes:

- `distinct`: one chooser chain per service (the product's KUBE-SVC chains);
- `shared`:   one chooser chain per endpoint count (upstream's WIP
              `dispatch-N`), every service of that count going to it.

Times (p50 of R add-then-remove cycles, the removal untimed):

- `add_service`: one goto element into the verdict map (to an existing
                 chooser) + the E endpoint elements: what adding a service
                 costs when its chooser exists;
- `change_endpoint`: one data-map element replaced (no validation);
- `new_chooser`: a new chain with the map rule + its goto element: what the
                 product pays per added service (the kernel validates the
                 table, and walks every element of the map the new chain
                 binds);
- `new_chooser_small_map`: the same, binding a map of 3,000 elements.

    python bench/probes/dispatch_probe.py [--services 10000] [--endpoints 10] [--reps 20]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: benchlib
import benchlib as bl

BENCH = "dispatch_probe"
T = "ip nftpx_probe"


def _vip(i: int) -> str:
    return f"10.96.{i // 250}.{i % 250 + 1}"


def _table(services: int, endpoints: int, shared: bool) -> list[str]:
    lines = [
        f"add table {T}",
        f"add chain {T} pre {{ type nat hook prerouting priority -100; }}",
        f"add chain {T} out {{ type nat hook output priority -100; }}",
        f"add chain {T} svcs",
        f"add chain {T} masq",
        f"add rule {T} masq meta mark set meta mark | 0x4000",
        f"add rule {T} pre jump svcs",
        f"add rule {T} out jump svcs",
        f"add map {T} svc {{ type ipv4_addr . inet_proto . inet_service : verdict; }}",
        f"add rule {T} svcs ip daddr . meta l4proto . th dport vmap @svc",
        f"add map {T} ep {{ typeof ip daddr . tcp dport . numgen random mod 1 : "
        "ip daddr . tcp dport; }",
        f"add map {T} small {{ typeof ip daddr . tcp dport . numgen random mod 1 : "
        "ip daddr . tcp dport; }",
    ]
    for c in range(endpoints if shared else services):
        lines += [
            f"add chain {T} c{c}",
            f"add rule {T} c{c} ip saddr != 10.0.0.0/8 jump masq",
            f"add rule {T} c{c} meta l4proto tcp dnat ip to ip daddr . tcp dport . "
            f"numgen random mod {endpoints} map @ep",
        ]
    return lines


def _elements(services: int, endpoints: int, shared: bool) -> list[str]:
    goto = [
        f"{_vip(i)} . tcp . 80 : goto c{i % endpoints if shared else i}" for i in range(services)
    ]
    eps = [
        f"{_vip(i)} . 80 . {j} : 10.1.{j}.{i % 250 + 1} . 8080"
        for i in range(services)
        for j in range(endpoints)
    ]
    small = [f"{_vip(i)} . 80 . {j} : 10.2.0.1 . 8080" for i in range(300) for j in range(10)]
    out = []
    for name, items in (("svc", goto), ("ep", eps), ("small", small)):
        out += [
            f"add element {T} {name} {{ {', '.join(items[k : k + 20000])} }}"
            for k in range(0, len(items), 20000)
        ]
    return out


def _cases(endpoints: int) -> dict[str, tuple[str, str]]:
    new_eps = ", ".join(f"10.200.0.1 . 80 . {j} : 10.3.0.{j + 1} . 8080" for j in range(endpoints))
    old_keys = ", ".join(f"10.200.0.1 . 80 . {j}" for j in range(endpoints))

    def chooser(table_map: str) -> tuple[str, str]:
        return (
            f"add chain {T} cnew\nadd rule {T} cnew meta l4proto tcp dnat ip to "
            f"ip daddr . tcp dport . numgen random mod 3 map @{table_map}\n"
            f"add element {T} svc {{ 10.200.0.2 . tcp . 80 : goto cnew }}",
            f"delete element {T} svc {{ 10.200.0.2 . tcp . 80 }}\n"
            f"flush chain {T} cnew\ndelete chain {T} cnew",
        )

    return {
        "add_service": (
            f"add element {T} svc {{ 10.200.0.1 . tcp . 80 : goto c1 }}\n"
            f"add element {T} ep {{ {new_eps} }}",
            f"delete element {T} svc {{ 10.200.0.1 . tcp . 80 }}\n"
            f"delete element {T} ep {{ {old_keys} }}",
        ),
        "change_endpoint": (
            f"delete element {T} ep {{ 10.96.0.1 . 80 . 0 }}\n"
            f"add element {T} ep {{ 10.96.0.1 . 80 . 0 : 10.3.0.1 . 8080 }}",
            f"delete element {T} ep {{ 10.96.0.1 . 80 . 0 }}\n"
            f"add element {T} ep {{ 10.96.0.1 . 80 . 0 : 10.1.0.1 . 8080 }}",
        ),
        "new_chooser": chooser("ep"),
        "new_chooser_small_map": chooser("small"),
    }


def _p50(run: Callable[[str], None], do: str, undo: str, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run(do)
        times.append(time.perf_counter() - t0)
        run(undo)
    return bl.summary(times, 1000)["p50"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--services", type=int, default=10000)
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    bl.require_root()
    from nftproxy.kernel.libnftables import NftBackend

    where = bl.userspace()
    bl.emit(BENCH, "machine", **bl.machine_info())
    rows = []
    for shape in ("distinct", "shared"):
        shared = shape == "shared"
        with bl.bench_netns("disp") as ns, NftBackend(netns=ns) as backend:
            bl.raw(backend, "\n".join(_table(args.services, args.endpoints, shared)))
            for command in _elements(args.services, args.endpoints, shared):
                bl.raw(backend, command)
            bl.wait_quiet()
            for case, (do, undo) in _cases(args.endpoints).items():
                p50 = _p50(lambda text: bl.raw(backend, text), do, undo, args.reps)
                label = f"{shape}/{args.services}x{args.endpoints}/{case}"
                bl.emit(BENCH, label, commit_ms_p50=round(p50, 3), userspace=where)
                rows.append([label, round(p50, 2)])
    print(f"userspace: {where}", file=sys.stderr)
    print(bl.fmt_table(rows, ["case", "commit p50 ms"]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
