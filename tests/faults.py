"""The harness of the fault tests (tests/test_faults.py, tests/test_faults_kill.py).

Layer: tests. One job: run the real agent against a namespace's kernel and
watch it from outside -- an in-process Agent fed from a file, `nftproxy run`
as a process, listings by `nft`, a UDP client that keeps one flow, another
tool that owns a table, a thread without CAP_NET_ADMIN.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import kernel
import yaml
from k8s import endpoint_slice, node, service

from nftproxy.agent.agent import Agent
from nftproxy.cluster.events import ClusterEvents
from nftproxy.cluster.file import FileSource, WatchedFiles
from nftproxy.core.config import ProxyConfig
from nftproxy.core.nft.listing import merged_document
from nftproxy.core.rules import names
from nftproxy.kernel import netns
from nftproxy.kernel.conntrack import Conntrack
from nftproxy.kernel.libnftables import NftBackend
from nftproxy.tools.sandbox.probe import subprocess_env
from nftproxy.tools.sandbox.topology import stop_process

NODE = "node-a"
NODE_IP = "192.168.50.1"
TABLE = "nftproxy"
CIDRS = ("10.244.0.0/16", "fd00:244::/48")
B = TypeVar("B", bound="Background")


# --- an in-process agent on a namespace's kernel ------------------------------------------


def config(**kw: Any) -> ProxyConfig:
    values: dict[str, Any] = {
        "node_name": NODE,
        "table_name": TABLE,
        "cluster_cidrs": CIDRS,
        "healthz_bind_address": "",
        "metrics_bind_address": "",
        "min_sync_period": 0.0,
        "sync_period": 30.0,
        **kw,
    }
    return ProxyConfig(**values)


def write_cluster(path: Path, objects: Sequence[Mapping[str, Any]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump_all(list(objects)))
    tmp.replace(path)  # the poller never reads half a file


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until `check()` held (polled every 20 ms)."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout:.1f}s")
        time.sleep(0.02)
    return time.monotonic() - start


@contextlib.contextmanager
def running_agent(
    ns: str, path: Path, cfg: ProxyConfig, *, conntrack: Conntrack | None = None, **kw: Any
) -> Iterator[Agent]:
    """An Agent on the real kernel of `ns`, fed from `path` (polled every 50 ms)."""

    def source_factory(handler: ClusterEvents) -> WatchedFiles:
        return WatchedFiles(FileSource([path], handler, node_name=NODE, poll_interval=0.05))

    agent = Agent(
        cfg, backend=NftBackend(netns=ns), source_factory=source_factory, conntrack=conntrack, **kw
    )
    try:
        agent.start()
        assert agent.synced.wait(30), "the agent never synced"
        yield agent
    finally:
        agent.stop()


def sample(agent: Agent, name: str, **labels: str) -> float:
    value = agent.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def repairs(agent: Agent, reason: str) -> float:
    return sample(agent, "nftproxy_drift_repairs_total", reason=reason)


def _one_table(doc: Mapping[str, Any], family: str, name: str) -> dict[str, Any] | None:
    items = [
        item
        for item in doc["nftables"]
        for obj in item.values()
        if obj.get("family") == family and obj.get("table", obj.get("name")) == name
    ]
    return {"nftables": items} if any("table" in item for item in items) else None


def our_table(doc: Mapping[str, Any], family: str) -> dict[str, Any] | None:
    """Our live tables of `family` (the main table and its affinity table,
    read as one: listing.merged_document; of the pair names.table_pair, the
    one with a base chain, which traffic reaches) out of a listed ruleset
    (libnftables JSON), as a document of its own; None when neither is
    there or hooked (a full sync in steps builds its table unhooked)."""
    name = next((n for n in names.table_pair(TABLE) if _hooked(doc, family, n)), None)
    if name is None:
        return None
    main = _one_table(doc, family, name)
    return merged_document(main, _one_table(doc, family, names.affinity_table(name)), name)


def _hooked(doc: Mapping[str, Any], family: str, table: str) -> bool:
    """Whether `family table` or its affinity table has a base chain."""
    tables = (table, names.affinity_table(table))
    return any(
        "hook" in item["chain"]
        for item in doc["nftables"]
        if "chain" in item
        and item["chain"].get("family") == family
        and item["chain"].get("table") in tables
    )


def tables(ns: str) -> dict[str, Any]:
    """Our two tables by family, compared by content (None: absent)."""
    doc = json.loads(kernel.nft(ns, "-j", "list", "ruleset"))
    out: dict[str, Any] = {}
    for family in ("ip", "ip6"):
        table = our_table(doc, family)
        out[family] = kernel.canonical(table) if table is not None else None
    return out


Counts = tuple[int, int, int, int]


def counts(ns: str) -> dict[str, Counts | None]:
    """Chains, rules, sets and elements of each of our tables (None: absent)."""

    def count(t: Any) -> Counts | None:
        if t is None:
            return None
        return (len(t["chains"]), sum(map(len, t["rules"].values())), len(t["sets"]),
                sum(len(s[-1]) for s in t["sets"].values()))

    return {family: count(t) for family, t in tables(ns).items()}


def drop_tables(ns: str) -> None:
    """Delete our tables (each family's main and affinity tables)."""
    kernel.nft(ns, "-f", "-", stdin="".join(
        f"add table {f} {t}\ndelete table {f} {t}\n"
        for f in ("ip", "ip6") for t in (TABLE, names.affinity_table(TABLE))))


class Failures:
    """on_sync_failure: when and why, plus what `also()` saw at that moment."""

    def __init__(self, also: Callable[[], Any] = lambda: None) -> None:
        self.seen: list[tuple[float, Exception, Any]] = []
        self.also = also

    def __call__(self, error: Exception) -> None:
        self.seen.append((time.monotonic(), error, self.also()))


# --- things that keep running beside the agent ------------------------------------------------


class Background:
    """A loop in a thread, from `with` to its end: `step()` again and again."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=type(self).__name__, daemon=True)

    def step(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set():
            self.step()

    def __enter__(self: B) -> B:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


class UdpFlow(Background):
    """A statsd-like client: one UDP socket with a fixed source port (so one
    conntrack flow), a datagram every `interval`; each answer's pod name, or
    "refused" (ICMP port unreachable) or "timeout", with its time."""

    def __init__(self, ns: str, dst: str, port: int, sport: int, interval: float = 0.01) -> None:
        super().__init__()
        self.sock = netns.run_in(ns, self._open, dst, port, sport)  # lives in `ns`
        self.interval = interval
        self.seen: list[tuple[float, str]] = []

    @staticmethod
    def _open(dst: str, port: int, sport: int) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("", sport))
        sock.connect((dst, port))
        sock.settimeout(0.2)
        return sock

    def step(self) -> None:
        try:
            self.sock.send(b"probe\n")
            who = self.sock.recv(4096).decode().split(" ", 1)[0]
        except ConnectionRefusedError:
            who = "refused"
        except TimeoutError:
            who = "timeout"
        self.seen.append((time.monotonic(), who))
        self._stop.wait(self.interval)

    def since(self, t: float) -> list[str]:
        return [who for at, who in self.seen if at >= t]

    def __exit__(self, *exc: object) -> None:
        super().__exit__()
        self.sock.close()


def _elem_key(key: Any) -> Any:
    val = key["elem"]["val"] if isinstance(key, dict) and "elem" in key else key
    return tuple(val["concat"]) if isinstance(val, dict) and "concat" in val else val


def _key_part(part: Mapping[str, Any], dest: tuple[str, int] | None) -> Any:
    """A fixed part of an endpoints-map key: `numgen random mod 1 offset F`
    is F; `ip daddr` / `tcp dport` are the service's destination `dest`."""
    if "numgen" in part:
        return part["numgen"].get("offset", 0)
    if dest is None:
        raise ValueError(f"a key part that needs the destination: {part}")
    return dest[0] if part["payload"]["field"] == "daddr" else dest[1]


def _map_targets(
    addr: Mapping[str, Any], sets: Mapping[str, list[Any]], dest: tuple[str, int] | None
) -> list[str]:
    """The addresses a `dnat to <fixed> . numgen random mod N map @m` picks
    from (<fixed>: constants, or the destination address . port of a shared
    chooser): elements (<fixed>, 0..N-1) of m, those present."""
    parts = addr["map"]["key"]["concat"]
    fixed = tuple(_key_part(p, dest) for p in parts[:-1])
    count = parts[-1]["numgen"]["mod"]
    values = {_elem_key(k): v for k, v in sets.get(addr["map"]["data"].lstrip("@"), [])}
    picked = (values.get((*fixed, i)) for i in range(count))
    return [v["concat"][0] for v in picked if v is not None]


def _objects(doc: Mapping[str, Any]) -> tuple[list[Any], dict[str, list[Any]]]:
    objs = [next(iter(o.items())) for o in doc.get("nftables", ())]
    sets = {o["name"]: o.get("elem", []) for k, o in objs if k in ("set", "map")}
    return objs, sets


def _dnat_addrs(objs: list[Any]) -> dict[str, list[Any]]:
    """Per chain, the `addr` of each of its dnat statements."""
    out: dict[str, list[Any]] = {}
    for kind, o in objs:
        if kind == "rule":
            out.setdefault(o["chain"], []).extend(
                e["dnat"]["addr"] for e in o["expr"] if "dnat" in e
            )
    return out


def _targets(addrs: list[Any], sets: Mapping[str, list[Any]], dest: Any) -> list[str]:
    return [
        t
        for addr in addrs
        for t in (_map_targets(addr, sets, dest) if isinstance(addr, dict) else [addr])
    ]


def service_shapes(doc: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """Per cluster IP in `service-ips` of a listed table (libnftables JSON):
    (the endpoints the chain it goes to DNATs it to, how many of them have
    their hairpin element) -- a whole service of n endpoints, k of them on
    this node (or on none), is (n, k)."""
    objs, sets = _objects(doc)
    addrs = _dnat_addrs(objs)
    hairpin = {e["concat"][0] for e in sets.get("hairpin-endpoints", [])}
    out = {}
    for key, verdict in sets.get("service-ips", []):
        vip, _, port = (key["elem"]["val"] if "elem" in key else key)["concat"]
        chain = verdict["goto"]["target"]
        eps = _targets(addrs.get(chain, []), sets, (vip, port))
        out[vip] = (len(eps), sum(ep in hairpin for ep in eps))
    return out


class ServiceWatcher(Background):
    """Another process listing our ip table, again and again: the shape of
    every service in each listing (None: no table)."""

    def __init__(self, ns: str) -> None:
        super().__init__()
        self.ns = ns
        self.seen: list[dict[str, tuple[int, int]] | None] = []

    def step(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            table = our_table(json.loads(kernel.nft(self.ns, "-j", "list", "ruleset")), "ip")
            self.seen.append(service_shapes(table) if table is not None else None)


class Watcher(Background):
    """Another process listing the ruleset, again and again, while the
    agent starts: every listing it saw."""

    def __init__(self, ns: str) -> None:
        super().__init__()
        self.ns = ns
        self.seen: list[dict[str, Counts | None]] = []

    def step(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self.seen.append(counts(self.ns))


@contextlib.contextmanager
def squatter(ns: str, family: str) -> Iterator[subprocess.Popen[str]]:
    """Another tool holding `family nftproxy` as an owner table (NFT_TABLE_F_OWNER):
    only its netlink socket may change it, so every commit of ours that
    touches it is refused (EPERM); it goes when the tool exits."""
    proc = subprocess.Popen(["ip", "netns", "exec", ns, "nft", "-i"], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdin is not None
        proc.stdin.write(f"add table {family} {TABLE} {{ flags owner; }}\n")
        proc.stdin.flush()
        wait_until(lambda: f"table {family} {TABLE}" in kernel.nft(ns, "list", "tables"),
                   5, "the owner table")
        yield proc
    finally:
        stop_process(proc)  # EOF on stdin ends `nft -i`


# --- faults -----------------------------------------------------------------------------------


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def net_admin(on: bool) -> None:
    """Raise or drop CAP_NET_ADMIN in the calling thread's effective set
    (capabilities are per thread; the permitted set keeps it, so it can come
    back). Without it the kernel answers every nfnetlink request EPERM."""
    libc = ctypes.CDLL(None, use_errno=True)
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (_CapData * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    bit = 1 << 12  # CAP_NET_ADMIN
    data[0].effective = data[0].effective | bit if on else data[0].effective & ~bit
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


# --- `nftproxy run` as a process -----------------------------------------------------------------


def big_cluster(path: Path, services: int) -> None:
    """`services` ClusterIP Services with two endpoints each, as one JSON List."""
    items = [node(NODE, [NODE_IP])]
    for i in range(services):
        a, b = divmod(i, 250)
        items += [service(f"s{i}", f"10.96.{a}.{b + 1}"),
                  endpoint_slice(f"s{i}", [(f"10.244.{a}.{b + 1}", NODE),
                                           (f"10.245.{a}.{b + 1}", "node-b")])]
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))


class AgentProcess:
    """`nftproxy run --source` as a process in `ns`; its log lines, as read."""

    def __init__(self, ns: str, path: Path) -> None:
        argv = [sys.executable, "-m", "nftproxy", "run", "--source", str(path),
                "--node-name", NODE, "--cluster-cidr", CIDRS[0],
                "--healthz-bind-address", "", "--metrics-bind-address", ""]
        self.proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env=subprocess_env())
        self.lines: list[tuple[float, str]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def wait_line(self, text: str, timeout: float = 60) -> tuple[float, str]:
        wait_until(lambda: any(text in line for _, line in self.lines), timeout, repr(text))
        return next((t, line) for t, line in self.lines if text in line)

    def stop(self, sig: signal.Signals) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(30)
