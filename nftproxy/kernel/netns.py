"""Named network namespaces: create, enter, run in, delete.

Layer: edge (next to nft.backend; imports nothing from nftproxy). One job:
the few netns operations that the nftables backend (a libnftables context
must be created by a thread that is already inside the namespace), the tests,
the demo and the benchmarks need. Names are `ip netns` names, i.e. files
under /run/netns.

Entering a namespace is per *thread*: `setns(fd, CLONE_NEWNET)` moves only
the calling thread, so `run_in` and the backend use a dedicated thread and
the rest of the process stays where it was. Python 3.11 has no `os.setns`
(3.12+), hence ctypes (docs/nft-python-notes.md §1). pyroute2's
`netns.setns` is avoided on purpose: its default `flags=os.O_CREAT` creates a
missing namespace instead of failing.

Creating and deleting go through `ip netns add/del` (a subprocess): that is
what sets up the /run/netns bind mount the way every other tool expects, and
it is never on a hot path.

Known limits:
- Linux and glibc only (ctypes `libc.so.6`).
- `temporary` can only clean up what it created; a SIGKILL of the process
  leaks the namespace (tests check for leaks at the end of a session).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import secrets
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Generic, TypeVar

__all__ = [
    "NETNS_DIR",
    "NetnsError",
    "Worker",
    "WorkerOwner",
    "create",
    "delete",
    "enter",
    "exec_in",
    "exists",
    "run_in",
    "sysctl",
    "temporary",
]

NETNS_DIR = Path("/run/netns")
_CLONE_NEWNET = 0x40000000

T = TypeVar("T")
R = TypeVar("R")
_Owner = TypeVar("_Owner", bound="WorkerOwner[Any]")


class NetnsError(OSError):
    """A namespace could not be created, entered or deleted."""


def _path(name: str) -> Path:
    if not name or "/" in name or name in {".", ".."}:
        raise ValueError(f"invalid network namespace name {name!r}")
    return NETNS_DIR / name


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")


def exists(name: str) -> bool:
    """True if the named namespace exists (/run/netns/<name>)."""
    return _path(name).exists()


def create(name: str) -> None:
    """`ip netns add <name>`, then bring its loopback up (a fresh namespace
    has `lo` down, and nearly every use wants it). Fails if it exists."""
    _path(name)
    _ip("netns", "add", name)
    try:
        _ip("-n", name, "link", "set", "lo", "up")
    except BaseException:
        delete(name)
        raise


def delete(name: str) -> None:
    """`ip netns del <name>`. Fails if it does not exist."""
    _path(name)
    _ip("netns", "del", name)


def enter(name: str) -> None:
    """Move the *calling thread* into the named namespace, for good.

    Only for threads that exist to work in that namespace (`run_in`, the
    backend's worker): the thread never comes back. Raises NetnsError if the
    namespace does not exist; never creates one.
    """
    try:
        fd = os.open(_path(name), os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise NetnsError(f"cannot open network namespace {name!r}: {exc}") from exc
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise NetnsError(err, f"setns({name!r}): {os.strerror(err)}")
    finally:
        os.close(fd)


def run_in(name: str, fn: Callable[..., T], *args: Any) -> T:
    """Run `fn(*args)` on a new thread that first entered namespace `name`;
    return its result or re-raise its exception here. The thread (and so its
    namespace membership) ends with the call."""
    result: list[T] = []
    failure: list[BaseException] = []

    def body() -> None:
        try:
            enter(name)
            result.append(fn(*args))
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=body, name=f"netns-{name}", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


def exec_in(name: str, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[Any]:
    """`ip netns exec <name> argv...` through `subprocess.run(**kw)`.

    Defaults: `check=True`, `capture_output=True`, `text=True`; any keyword
    given overrides them.
    """
    _path(name)
    opts: dict[str, Any] = {"check": True, "capture_output": True, "text": True, **kw}
    return subprocess.run(["ip", "netns", "exec", name, *argv], **opts)


def sysctl(name: str, key: str, value: str | int) -> None:
    """Set sysctl `key` (dotted, e.g. "net.ipv4.ip_forward") inside the
    namespace. Per-netns keys (net.*) only: others would change the host."""
    if not key.startswith("net."):
        raise ValueError(f"sysctl {key!r} is not per network namespace")
    path = Path("/proc/sys", *key.split("."))

    def write() -> None:
        # /proc/sys/net resolves against the netns of the *opening* thread.
        path.write_text(f"{value}\n")

    run_in(name, write)


@contextlib.contextmanager
def temporary(prefix: str) -> Iterator[str]:
    """A fresh, uniquely named namespace `<prefix>-<pid>-<hex>` for the body
    of the `with`; deleted afterwards whatever happens (exceptions,
    KeyboardInterrupt, a failure half-way through `create`)."""
    name = f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        create(name)
        yield name
    finally:
        if exists(name):
            delete(name)


class Worker(Generic[R]):
    """A thread that lives in one network namespace and owns a resource
    there, serving calls on it one at a time.

    For kernel handles bound to the namespace of the thread that opened them
    and unsafe to share between threads: a libnftables context (nft.backend)
    and the conntrack socket (conntrack). `open_resource` runs on the
    worker after it entered `netns` (None: stay in the caller's namespace);
    its exception -- wrapped by `wrap_error` -- is raised from start().
    `close_resource` runs on the worker when it stops.
    """

    def __init__(
        self,
        netns: str | None,
        open_resource: Callable[[], R],
        *,
        name: str,
        close_resource: Callable[[R], None] | None = None,
        wrap_error: Callable[[BaseException], BaseException] | None = None,
    ) -> None:
        self._netns = netns
        self._open = open_resource
        self._close = close_resource
        self._wrap = wrap_error
        self._name = f"{name}-{netns}" if netns else name
        self._jobs: queue.SimpleQueue[tuple[Callable[[R], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # no job may queue up behind the stop
        self._stopped = False

    def start(self) -> None:
        """Start the thread and open the resource (raises what opening raised).
        A worker runs once: starting it twice, or after stop(), is an error."""
        with self._lock:
            if self._thread is not None or self._stopped:
                raise RuntimeError(f"{self._name} already started")
            ready: Future[None] = Future()
            self._thread = threading.Thread(
                target=self._serve, args=(ready,), name=self._name, daemon=True
            )
        self._thread.start()
        try:
            ready.result()
        except BaseException:
            self._thread.join()
            with self._lock:
                self._stopped = True
            raise

    def _serve(self, ready: Future[None]) -> None:
        try:
            if self._netns is not None:
                enter(self._netns)  # never creates the namespace
            resource = self._open()
        except BaseException as exc:  # the caller waits on `ready`: always answer it
            if self._wrap is not None:
                wrapped = self._wrap(exc)
                if wrapped is not exc:
                    wrapped.__cause__ = exc
                exc = wrapped
            ready.set_exception(exc)
            return
        ready.set_result(None)
        try:
            while (job := self._jobs.get()) is not None:
                fn, future = job
                try:
                    future.set_result(fn(resource))
                except BaseException as exc:
                    future.set_exception(exc)
                del job, fn, future
        finally:
            if self._close is not None:
                self._close(resource)
            del resource  # freed on the thread that made it

    @property
    def running(self) -> bool:
        """Started and not stopped: call() would be served."""
        return self._thread is not None and not self._stopped

    def call(self, fn: Callable[[R], T]) -> T:
        future: Future[T] = Future()
        with self._lock:
            if not self.running:
                raise RuntimeError(f"{self._name} not started (or closed)")
            self._jobs.put((fn, future))
        return future.result()

    def stop(self) -> None:
        """Close the resource and end the thread. Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._jobs.put(None)
        if self._thread is not None:
            self._thread.join()


class WorkerOwner(Generic[R]):
    """start() / close() / `with` for an edge whose I/O runs on one Worker
    (nft.backend.NftBackend, conntrack.Conntrack). Subclasses set `_worker`
    in their constructor, which does no I/O: Worker() only stores."""

    _worker: Worker[R]

    def __enter__(self: _Owner) -> _Owner:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self._worker.start()

    def close(self) -> None:
        """Close the resource and stop the worker. Idempotent."""
        self._worker.stop()
