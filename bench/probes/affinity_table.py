"""What the affinity table buys a partial add, against a main table that holds its chains.

Layer: bench probe. One question (issue 35 item 5): the product keeps the
chains of the ports with ClientIP affinity in `<table>-affinity`
(fragment.AFFINITY_TABLE), so that the kernel's validation of the main
table after an add to its `service-ips` verdict map does not walk them. How
much shorter is a partial add for that, at 10k x 10 with the bench mix?

Each round builds the product's tables in a throwaway netns (benchlib: the
real Proxier, a real NftBackend, one full sync), then:

- A (product): --reps timed partial adds of one new plain ClusterIP service
  (Service + EndpointSlice fed, one sync), each deleted again untimed, as
  partial_sync.py's "add" step;
- B (emulated tree without the affinity table): the affinity table's own
  objects (its per-port chains and its `affinity` set, not its base chains,
  KUBE-SERVICES, KUBE-MARK-MASQ or maps) re-created in the main table from
  `list table` text, the main maps' `accept` elements of those ports
  replaced by the affinity maps' `goto` elements, and the affinity table's
  maps flushed (it stays, with unreferenced chains); then the same adds
  through the product (they touch only the main map and shared choosers).

Rounds: build, A, move, B; again in a new netns. Chains of the main table are
counted (`list chains`) in A and B. JSON lines on stdout, a table on stderr.

    python bench/probes/affinity_table.py [--rounds 3] [--reps 50] [--size 10000x10]
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: benchlib
import benchlib as bl

BENCH = "affinity_table"
MAIN = "nftproxy"
AFF = "nftproxy-affinity"
SHARED = {"nat-prerouting", "nat-output", "KUBE-SERVICES", "KUBE-MARK-MASQ"}
MAPS = ("service-ips", "service-nodeports")
BLOCK = re.compile(r"^\t(chain|set|map) (\S+) \{\n(.*?)^\t\}\n", re.M | re.S)
ELEMENT = re.compile(r'\s*([^,{}"]+?)((?: comment "[^"]*")? : (?:goto|jump) \S+?)(?=,|\s*$)')


def nft(backend: Any, cmd: str) -> str:
    def text(ctx: Any) -> tuple[int, str, str]:  # nft's syntax, whatever the context's output
        was = ctx.set_json_output(False)
        try:
            return ctx.cmd(cmd)  # type: ignore[no-any-return]
        finally:
            ctx.set_json_output(was)

    rc, out, err = backend._call(text)
    if rc != 0:
        raise RuntimeError(f"{cmd}: {err}")
    return str(out)


def main_chains(backend: Any) -> int:
    listing = nft(backend, "list chains ip")  # every ip table's chains, table by table
    body = re.search(rf"^table ip {MAIN} {{\n(.*?)^}}", listing, re.M | re.S)
    return len(re.findall(r"^\tchain ", body.group(1) if body else "", re.M))


def move(backend: Any) -> dict[str, int]:
    """Re-create the affinity table's own objects inside the main table."""
    blocks = {
        name: (kind, body)
        for kind, name, body in BLOCK.findall(nft(backend, f"list table ip {AFF}"))
    }
    own = [
        f"\t{k} {n} {{\n{b}\t}}"
        for n, (k, b) in blocks.items()
        if k != "map" and n not in SHARED and n != "nodeport-ips"
    ]
    doc = [f"table ip {MAIN} {{\n" + "\n".join(own) + "\n}"]
    moved = 0
    for m in MAPS:
        body = blocks[m][1]
        if "elements = {" not in body:
            continue
        elems = ELEMENT.findall(body.split("elements = {", 1)[1].rsplit("}", 1)[0])
        moved += len(elems)
        keys = ", ".join(k.strip() for k, _ in elems)
        doc.append(f"delete element ip {MAIN} {m} {{ {keys} }}")
        doc.append(f"add element ip {MAIN} {m} {{ " + ", ".join(k + v for k, v in elems) + " }")
        doc.append(f"flush map ip {AFF} {m}")
    bl.raw(backend, "\n".join(doc) + "\n")
    return {"moved_objects": len(own), "moved_elements": moved}


def adds(proxier: Any, shape: bl.ClusterShape, reps: int, warmup: int, base: int) -> list[Any]:
    plain = bl.ClusterShape(shape.services, shape.endpoints, mix=False)
    out = []
    for rep in range(warmup + reps):
        i, name = shape.services + base + rep, f"aff-add-{base + rep}"
        svc, eps = bl.service_obj(i, plain, name=name), bl.slice_obj(i, plain, name=name)
        proxier.on_service(None, svc)
        proxier.on_endpoint_slice(None, eps)
        t0 = time.perf_counter()
        r = proxier.sync()
        wall = time.perf_counter() - t0
        if rep >= warmup:
            out.append((wall, r.commit_seconds, r.ops))
        proxier.on_service(svc, None)
        proxier.on_endpoint_slice(eps, None)
        proxier.sync()
    return out


def one_round(rnd: int, shape: bl.ClusterShape, reps: int, warmup: int) -> list[dict[str, Any]]:
    from nftproxy.kernel.libnftables import NftBackend

    rows: list[dict[str, Any]] = []
    services, slices = bl.make_cluster(shape)
    with bl.bench_netns("aff") as ns, NftBackend(netns=ns) as backend:
        proxier = bl.make_proxier(backend)
        bl.feed(proxier, services, slices)
        del services, slices
        proxier.sync()
        extra: dict[str, int] = {}
        for variant in ("A-product", "B-chains-in-main"):
            if variant.startswith("B"):
                extra = move(backend)
            chains = main_chains(backend)
            bl.progress(f"round {rnd} {variant}: {chains} chains in ip {MAIN} {extra}")
            bl.wait_quiet()
            noise = bl.Noise()
            s = adds(proxier, shape, reps, warmup, base=10_000 * len(rows))
            rows.append(
                bl.emit(
                    BENCH,
                    f"{variant}/{shape.label}/add/r{rnd}",
                    variant=variant,
                    round=rnd,
                    services=shape.services,
                    endpoints_per_service=shape.endpoints,
                    step="add",
                    sync_ms=bl.summary([x[0] for x in s], 1000),
                    commit_ms=bl.summary([x[1] for x in s], 1000),
                    ops=sorted(x[2] for x in s)[len(s) // 2],
                    main_chains=chains,
                    foreign_cpu=noise.foreign(),
                    **extra,
                )
            )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--size", default="10000x10")
    args = ap.parse_args()
    bl.require_root()
    from nftproxy.kernel.libnftables import tune_malloc

    tune_malloc()
    bl.emit(BENCH, "machine", **bl.machine_info(), mix=bl.MIX_DESCRIPTION)
    shape = bl.parse_shape(args.size)
    rows = [
        r
        for rnd in range(1, args.rounds + 1)
        for r in one_round(rnd, shape, args.reps, args.warmup)
    ]
    header = ["case", "chains", "sync p50", "sync p99", "commit p50", "commit p99", "ops"]
    table = [
        [
            r["case"],
            r["main_chains"],
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
