"""Dataplane: new TCP connections per second and connect latency to a ClusterIP.

Spec item 4. One sandbox per variant (nftproxy.tools.sandbox.topology: client
namespace -> node namespace -> one pod namespace, veth pairs, /32 routes), all
built first and kept for the whole run, so variants can be INTERLEAVED
(each round runs every variant once, in a shuffled order):

- `direct`      the client connects straight to the pod address; the node
                namespace holds no ruleset at all (no NAT, no conntrack
                hooks): the physical limit of this path;
- `direct-ct`   the same path with conntrack switched on in the node (one
                `ct state new counter` rule): what connection tracking alone
                costs;
- `natmin`      the least any ClusterIP NAT can do: one hand-written DNAT rule
                for the VIP and one masquerade rule (no kube-proxy semantics):
                conntrack + DNAT + SNAT, no service rules;
- `nft-N`       nftproxy (the real Proxier) with N ClusterIP services
                programmed; the target service is added last and has the
                highest VIP (its map lookup is O(1) whatever the order);
- `nftpart-N`   the same, the target added by a partial sync after the
                full sync of the others (the same elements a full sync
                writes: a check that the two paths cost the same);
- `iptnft-N`    kube-proxy's iptables-mode ruleset for the same services
                (bench/probes/iptables_ruleset.py, KUBE-SERVICES a linear list, the
                target LAST), loaded with iptables-nft-restore (this host's
                default `iptables` is the nf_tables backend);
- `iptleg-N`    the same loaded with iptables-legacy-restore (x_tables);
- `loopback`    client -> 127.0.0.1 inside the client namespace: the load
                generator's own floor (Python + a kernel TCP handshake).

Load generator: Python, blocking connect() on a fresh socket per connection,
closed with RST (SO_LINGER 0: no TIME_WAIT, no port exhaustion); the pod runs
a tight accept()+close() loop. `latency` mode: one client process
(concurrency 1), connect() time per connection (SYN -> SYN/ACK through the
node, NAT included). `rate` mode: `--procs` client processes at once
(CPU-bound on a 2-core VM: shows the CPU cost per new connection). The
generator's own per-connection overhead outside connect() (socket, setsockopt,
close, bookkeeping) is measured and printed (`gen_overhead_us`).

Ratios are computed from the same run (pooled samples of all rounds).

    python bench/dataplane.py [--quick] [--services 10000] [--rounds 5]
        [--seconds 3] [--variants direct,nft-1,nft-N,...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import benchlib as bl

BENCH = "dataplane"
PORT = 8080
VIP = "10.96.200.1"
POD_IP = "10.244.0.11"
CLUSTER_CIDR = "10.244.0.0/16"
HERE = os.path.abspath(__file__)


# --- the two programs run inside namespaces -------------------------------------------


def serve(port: int, host: str = "0.0.0.0") -> None:
    """accept() + close() as fast as possible; ends when stdin closes."""
    import selectors

    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port))
    srv.listen(4096)
    srv.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(srv, selectors.EVENT_READ)
    sel.register(sys.stdin, selectors.EVENT_READ)
    print("ready", flush=True)
    while True:
        for key, _ in sel.select():
            if key.fileobj is sys.stdin:
                return
            while True:
                try:
                    conn, _ = srv.accept()
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    continue
                conn.close()


def connect_loop(ip: str, port: int, seconds: float) -> dict[str, Any]:
    """Connections in a tight loop for `seconds`; connect() latencies in ns."""
    linger = struct.pack("ii", 1, 0)
    addr = (ip, port)
    lat: list[int] = []
    errors = 0
    now = time.perf_counter_ns
    start = now()
    end = start + int(seconds * 1e9)
    t1 = start
    while t1 < end:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_SYNCNT, 1)
        t0 = now()
        try:
            s.connect(addr)
        except OSError:
            errors += 1
        t1 = now()
        s.close()
        lat.append(t1 - t0)
    wall = (now() - start) / 1e9
    # the generator's own cost per connection outside connect(): the same
    # loop without the connect
    scratch: list[int] = []
    n = 2000
    o0 = now()
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_SYNCNT, 1)
        t0 = now()
        t1 = now()
        s.close()
        scratch.append(t1 - t0)
    overhead = (now() - o0) / n / 1000
    return {
        "count": len(lat),
        "seconds": wall,
        "errors": errors,
        "lat_ns": lat,
        "overhead_us": overhead,
    }


# --- sandboxes ---------------------------------------------------------------------------


@dataclass
class Sandbox:
    variant: str
    client_ns: str
    target: tuple[str, int]
    load_s: float = 0.0
    ruleset: str = ""


def _exec(ns: str, argv: list[str], **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, HERE, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


@contextlib.contextmanager
def _server(ns: str, port: int, host: str = "0.0.0.0") -> Iterator[None]:
    proc = _exec(ns, ["--serve", str(port), "--host", host])
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("ready"):
            raise RuntimeError(
                f"server in {ns} failed: {proc.stderr.read() if proc.stderr else ''}"
            )
        yield
    finally:
        with contextlib.suppress(OSError):
            if proc.stdin:
                proc.stdin.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _nft_services(n: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from k8s import endpoint_slice, service  # tests/k8s.py
    from probes import iptables_ruleset as ipt

    svcs, slices = [], []
    for s in [*ipt.filler(n - 1), ipt.IptService("bench", "target", VIP, 80, ((POD_IP, PORT),))]:
        svcs.append(service(s.name, s.vip, ns=s.namespace, ports=(("http", s.port, "TCP"),)))
        slices.append(
            endpoint_slice(
                s.name,
                [ip for ip, _ in s.endpoints],
                ns=s.namespace,
                ports=(("http", PORT, "TCP"),),
            )
        )
    return svcs, slices


def _load_nft(node_ns: str, n: int, *, partial: bool = False) -> str:
    """N services by the real Proxier; `partial`: the target (the last) in
    a partial sync of its own after the full sync of the others."""
    from nftproxy.kernel.libnftables import NftBackend

    config = bl.bench_config(cluster_cidrs=(CLUSTER_CIDR,))
    svcs, slices = _nft_services(n)
    split = n - 1 if partial else n
    with NftBackend(netns=node_ns) as backend:
        proxier = bl.make_proxier(backend, config)
        bl.feed(proxier, svcs[:split], slices[:split])
        first = proxier.sync()
        if partial:
            bl.feed(proxier, svcs[split:], slices[split:])
            assert first.full and not proxier.sync().full
        listing = backend.run_json({"list": {"chains": {"family": "ip"}}})
        chains = sum(1 for item in listing["nftables"] if "chain" in item)
    how = ", the target by a partial sync" if partial else ""
    return f"nftables, {chains} chains{how}"


CONNTRACK_ONLY = """
table ip bench-ct {
    chain pre { type filter hook prerouting priority 0; ct state new counter; }
}
"""
NAT_MIN = f"""
table ip bench-nat {{
    chain pre {{
        type nat hook prerouting priority -100;
        ip daddr {VIP} tcp dport 80 dnat to {POD_IP}:{PORT}
    }}
    chain post {{
        type nat hook postrouting priority 100;
        ct status dnat ip saddr != {CLUSTER_CIDR} masquerade fully-random
    }}
}}
"""


def _load_nft_text(node_ns: str, text: str) -> str:
    subprocess.run(
        ["ip", "netns", "exec", node_ns, "nft", "-f", "-"],
        input=text,
        check=True,
        capture_output=True,
        text=True,
    )
    return " ".join(text.split())


def _load_iptables(node_ns: str, n: int, tool: str) -> str:
    from probes import iptables_ruleset as ipt

    target = ipt.IptService("bench", "target", VIP, 80, ((POD_IP, PORT),))
    text = ipt.ruleset([*ipt.filler(n - 1), target], CLUSTER_CIDR)
    with tempfile.NamedTemporaryFile("w", suffix=".rules", delete=False) as f:
        f.write(text)
        path = f.name
    try:
        with open(path) as inp:
            subprocess.run(
                ["ip", "netns", "exec", node_ns, tool],
                stdin=inp,
                check=True,
                capture_output=True,
                text=True,
                timeout=1800,
            )
    finally:
        os.unlink(path)
    rules = text.count("\n-A ")
    version = subprocess.run([tool, "--version"], capture_output=True, text=True).stdout.strip()
    return f"{version}, {rules} rules"


@contextlib.contextmanager
def sandbox(variant: str, stack: contextlib.ExitStack) -> Iterator[Sandbox]:
    from nftproxy.tools.sandbox import topology as tp

    spec = tp.Spec(
        pods=(tp.PodSpec("pod1", POD_IP),),
        tcp_ports=(PORT,),
        udp_ports=(),
        sctp_ports=(),
        backends=False,
    )
    with tp.build(spec) as topo:
        pod_ns = topo.pods["pod1"].netns
        subprocess.run(
            ["ip", "-n", topo.client, "route", "add", "10.244.0.0/16", "via", tp.NODE_IPV4],
            check=True,
        )
        kind, _, size = variant.partition("-")
        t0 = time.perf_counter()
        desc = "no ruleset"
        target: tuple[str, int] = (VIP, 80)
        if kind == "direct":
            target = (POD_IP, PORT)
            if size == "ct":
                desc = _load_nft_text(topo.node, CONNTRACK_ONLY)
        elif kind == "natmin":
            desc = _load_nft_text(topo.node, NAT_MIN)
        elif kind == "loopback":
            target = ("127.0.0.1", PORT)
        elif kind == "nft":
            desc = _load_nft(topo.node, int(size))
        elif kind == "nftpart":
            desc = _load_nft(topo.node, int(size), partial=True)
        elif kind == "iptnft":
            desc = _load_iptables(topo.node, int(size), "iptables-nft-restore")
        elif kind == "iptleg":
            desc = _load_iptables(topo.node, int(size), "iptables-legacy-restore")
        else:
            raise ValueError(f"unknown variant {variant!r}")
        load_s = time.perf_counter() - t0
        if kind == "loopback":
            with _server(topo.client, PORT, "127.0.0.1"):
                yield Sandbox(variant, topo.client, target, load_s, desc)
        else:
            with _server(pod_ns, PORT):
                yield Sandbox(variant, topo.client, target, load_s, desc)


# --- measuring -------------------------------------------------------------------------------


def measure(box: Sandbox, procs: int, seconds: float) -> list[dict[str, Any]]:
    ip, port = box.target
    children = [
        _exec(box.client_ns, ["--connect", ip, str(port), "--seconds", str(seconds)])
        for _ in range(procs)
    ]
    out = []
    for c in children:
        stdout, stderr = c.communicate(timeout=seconds + 60)
        if c.returncode != 0:
            raise RuntimeError(f"client failed in {box.variant}: {stderr[-1000:]}")
        out.append(json.loads(stdout))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--services", type=int)
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--seconds", type=float)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--variants")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--host", default="0.0.0.0", help=argparse.SUPPRESS)
    ap.add_argument("--connect", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.host)
        return 0
    if args.connect:
        print(json.dumps(connect_loop(args.connect[0], int(args.connect[1]), args.seconds)))
        return 0
    bl.require_root()
    n = args.services or (100 if args.quick else 10000)
    rounds = args.rounds or (1 if args.quick else 5)
    seconds = args.seconds or (0.5 if args.quick else 3.0)
    default = (
        f"loopback,direct,direct-ct,natmin,nft-1,nft-{n},"
        f"iptnft-1,iptnft-{n},iptleg-1,iptleg-{n}"
    )
    if args.quick:
        default = f"direct,nft-1,nft-{n},iptnft-{n}"
    variants = (args.variants or default).split(",")
    bl.emit(BENCH, "machine", **bl.machine_info())
    samples: dict[tuple[str, str], dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        boxes = {}
        for v in variants:
            bl.progress(f"building sandbox {v}")
            boxes[v] = stack.enter_context(sandbox(v, stack))
            bl.progress(f"  {v}: {boxes[v].ruleset} (loaded in {boxes[v].load_s:.1f}s)")
        for box in boxes.values():  # warm up: caches, conntrack, ARP
            measure(box, 1, min(seconds, 0.5))
        rng = random.Random(11)
        if not args.quick:
            bl.wait_quiet()
        noise = bl.Noise()
        for rnd in range(rounds):
            order = list(variants)
            rng.shuffle(order)
            bl.progress(f"round {rnd + 1}/{rounds}: {' '.join(order)}")
            for v in order:
                for mode, procs in (("latency", 1), ("rate", args.procs)):
                    res = measure(boxes[v], procs, seconds)
                    acc = samples.setdefault(
                        (v, mode), {"lat": [], "rates": [], "p50s": [], "errors": 0, "ovh": []}
                    )
                    lat = [x / 1000 for r in res for x in r["lat_ns"]]
                    acc["lat"] += lat
                    acc["rates"].append(sum(r["count"] / r["seconds"] for r in res))
                    acc["p50s"].append(bl.percentile(lat, 50))
                    acc["errors"] += sum(r["errors"] for r in res)
                    acc["ovh"] += [r["overhead_us"] for r in res]
        foreign = noise.foreign()
        rows = {}
        for (v, mode), acc in samples.items():
            rates = sorted(acc["rates"])
            rows[(v, mode)] = bl.emit(
                BENCH,
                f"{v}/{mode}",
                variant=v,
                mode=mode,
                procs=1 if mode == "latency" else args.procs,
                ruleset=boxes[v].ruleset,
                load_s=round(boxes[v].load_s, 2),
                conn_per_s=round(rates[len(rates) // 2]),
                conn_per_s_min=round(rates[0]),
                conn_per_s_max=round(rates[-1]),
                latency_us=bl.summary(acc["lat"]),
                round_p50_us_min=round(min(acc["p50s"]), 1),
                round_p50_us_max=round(max(acc["p50s"]), 1),
                errors=acc["errors"],
                gen_overhead_us=round(sorted(acc["ovh"])[len(acc["ovh"]) // 2], 2),
                rounds=rounds,
                seconds=seconds,
                foreign_cpu=foreign,
            )
    _ratios(rows, variants)
    return 0


def _ratios(rows: dict[tuple[str, str], dict[str, Any]], variants: list[str]) -> None:
    def get(v: str, mode: str, key: str) -> float | None:
        r = rows.get((v, mode))
        if r is None:
            return None
        return float(r["conn_per_s"] if key == "rate" else r["latency_us"][key])

    big = [v for v in variants if v.startswith("nft-") and v != "nft-1"]
    pairs = [
        ("nft-1", "direct"),
        ("direct-ct", "direct"),
        ("natmin", "direct"),
        ("nft-1", "natmin"),
    ]
    for v in big:
        n = v.split("-")[1]
        pairs += [
            (v, "nft-1"),
            (v, "direct"),
            (f"iptnft-{n}", "iptnft-1"),
            (f"iptleg-{n}", "iptleg-1"),
            (f"iptnft-{n}", v),
            (f"iptleg-{n}", v),
            (v, "natmin"),
            (f"nftpart-{n}", v),
            (f"nftpart-{n}", "natmin"),
        ]
    table = []
    for a, b in pairs:
        if a not in variants or b not in variants:
            continue
        fields = {}
        for key in ("p50", "p99"):
            x, y = get(a, "latency", key), get(b, "latency", key)
            if x and y:
                fields[f"latency_{key}_ratio"] = round(x / y, 3)
        x, y = get(a, "rate", "rate"), get(b, "rate", "rate")
        if x and y:
            fields["rate_ratio"] = round(x / y, 3)
        bl.emit(BENCH, f"ratio/{a}:{b}", numerator=a, denominator=b, **fields)
        table.append(
            [
                f"{a} / {b}",
                fields.get("latency_p50_ratio"),
                fields.get("latency_p99_ratio"),
                fields.get("rate_ratio"),
            ]
        )
    header = ["ratio", "latency p50", "latency p99", "conn/s"]
    print(bl.fmt_table(table, header), file=sys.stderr)
    lines = [
        [r["case"], r["conn_per_s"], r["latency_us"]["p50"], r["latency_us"]["p99"], r["errors"]]
        for r in rows.values()
    ]
    print(bl.fmt_table(lines, ["case", "conn/s", "p50 us", "p99 us", "errors"]), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
