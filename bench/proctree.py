"""Memory of a whole process tree: the RSS of one process plus every live descendant.

Layer: bench tooling (not part of the nftproxy package; benchlib re-exports
it). One job: what "the agent's memory" means in bench/ -- the agent process
and every process it starts (a helper child that renders or commits a full
sync, an `nft` child as kube-proxy runs one), summed, sampled on a thread at
a short interval; the peak of the sum, and one reading on demand (the steady
value after an idle period).

How: every sample lists /proc once (processes only, not threads), reads the
parent of each pid it has not seen before (cached; a pid that vanished is
forgotten, and the members of the last tree are re-read, so a child
re-parented away when its parent died stops counting), walks the tree from
the root and adds up /proc/<pid>/statm's resident pages (VmRSS: anonymous,
file and shared memory). RSS counts a page shared by two processes twice
(a forked child's copy-on-write pages): the sum is an upper bound, as
`ps`/`top` totals are. Processes that exit between two samples are missed;
at the default 50 ms a helper that lives for a full sync is not.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TreeMemory", "TreeSampler", "tree_cpu_s", "tree_rss_mb"]

_PAGE = os.sysconf("SC_PAGE_SIZE")
_HZ = os.sysconf("SC_CLK_TCK")
_MB = 1024 * 1024


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from field 3 (state) on, None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def _parent(pid: int) -> int | None:
    """The parent pid of `pid` (stat field 4), None if gone."""
    fields = _stat(pid)
    return None if fields is None else int(fields[1])


def _cpu_ticks(pid: int) -> int:
    """utime + stime + cutime + cstime of `pid` (its own CPU and that of the
    children it waited for), 0 if gone."""
    fields = _stat(pid)
    return 0 if fields is None else sum(int(f) for f in fields[11:15])


def _rss_bytes(pid: int) -> int:
    """Resident bytes of `pid` now (statm's second field), 0 if gone."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def _hwm_bytes(pid: int) -> int:
    """Peak resident bytes of `pid` so far (VmHWM, kept by the kernel), 0 if gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _live_pids() -> set[int]:
    return {int(name) for name in os.listdir("/proc") if name.isdigit()}


class _Parents:
    """pid -> parent pid of every process on the machine, kept up to date
    cheaply between samples (see the module docstring)."""

    def __init__(self) -> None:
        self._parent: dict[int, int] = {}
        self._members: list[int] = []

    def tree(self, root: int) -> list[int]:
        """`root` and its live descendants (empty if `root` is gone)."""
        live = _live_pids()
        for pid in self._parent.keys() - live:
            del self._parent[pid]
        for pid in [*(live - self._parent.keys()), *self._members]:
            ppid = _parent(pid)
            if ppid is None:
                self._parent.pop(pid, None)
            else:
                self._parent[pid] = ppid
        if root not in self._parent:
            self._members = []
            return []
        children: dict[int, list[int]] = {}
        for pid, ppid in self._parent.items():
            children.setdefault(ppid, []).append(pid)
        members, todo = [], [root]
        while todo:
            pid = todo.pop()
            members.append(pid)
            todo.extend(children.get(pid, ()))
        self._members = members
        return members


def tree_rss_mb(root: int) -> float:
    """RSS of `root` plus its live descendants now, MB (0 if `root` is gone)."""
    return round(sum(_rss_bytes(p) for p in _Parents().tree(root)) / _MB, 1)


def tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) used so far by `root`, its live
    descendants and every descendant that exited and was waited for."""
    return round(sum(_cpu_ticks(p) for p in _Parents().tree(root)) / _HZ, 2)


@dataclass(frozen=True)
class TreeMemory:
    """What a TreeSampler saw, in MB."""

    peak_mb: float
    """Peak of the sum over the tree (root + descendants) at one sample."""
    peak_root_mb: float
    """Peak RSS of the root process alone."""
    peak_children_mb: float
    """Peak of the sum over the descendants alone (0: it never had any)."""
    hwm_sum_mb: float
    """Sum over every process seen in the tree of its own peak RSS (VmHWM,
    as last read): an upper bound of the tree's peak that no spike between
    two samples escapes (the processes' peaks need not coincide)."""
    max_processes: int
    samples: int
    interval_s: float


class TreeSampler:
    """Samples the tree of `root` every `interval` seconds on a thread,
    from start() (or `with`) to stop(); sample() also reads it on demand."""

    def __init__(self, root: int, interval: float = 0.05) -> None:
        self.root = root
        self.interval = interval
        self._parents = _Parents()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._peak = self._peak_root = self._peak_children = 0
        self._max_processes = self._samples = 0
        self._hwm: dict[int, int] = {}

    def __enter__(self) -> TreeSampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="tree-rss", daemon=True)
        self._thread.start()

    def stop(self) -> TreeMemory:
        """Stop sampling (idempotent); what was seen."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return self.result()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> float:
        """One reading now: the tree's RSS in MB (0 once the root is gone)."""
        with self._lock:
            sizes = [(pid, _rss_bytes(pid)) for pid in self._parents.tree(self.root)]
            self._fold(sizes)
        return round(sum(s for _, s in sizes) / _MB, 1)

    def _fold(self, sizes: Iterable[tuple[int, int]]) -> None:
        sizes = list(sizes)
        if not sizes:
            return
        for pid, rss in sizes:
            # VmHWM, read after statm, can miss a peak that statm saw (the
            # process exited, or freed memory before the kernel's hiwater update).
            self._hwm[pid] = max(self._hwm.get(pid, 0), _hwm_bytes(pid), rss)
        root = sum(s for pid, s in sizes if pid == self.root)
        total = sum(s for _, s in sizes)
        self._peak = max(self._peak, total)
        self._peak_root = max(self._peak_root, root)
        self._peak_children = max(self._peak_children, total - root)
        self._max_processes = max(self._max_processes, len(sizes))
        self._samples += 1

    def result(self) -> TreeMemory:
        with self._lock:
            return TreeMemory(
                peak_mb=round(self._peak / _MB, 1),
                peak_root_mb=round(self._peak_root / _MB, 1),
                peak_children_mb=round(self._peak_children / _MB, 1),
                hwm_sum_mb=round(sum(self._hwm.values()) / _MB, 1),
                max_processes=self._max_processes,
                samples=self._samples,
                interval_s=self.interval,
            )
