"""The sandbox client: many connection attempts from inside one namespace.

Layer: edge. One job, two halves:

- the program (`python -m nftproxy.tools.sandbox.probe`, standard library only),
  run inside a namespace by `ip netns exec`:

      probe tcp|udp|sctp ADDR PORT [ADDR PORT ...] [--count N]
            [--src ADDR [--src ADDR ...]] [--timeout S] [--interval S] [--until-eof]

  For each target and each source (or the kernel's choice without --src),
  `count` attempts in turn (or round-robin until stdin reaches EOF with
  `--until-eof`), each on a fresh socket, so a fresh source port and
  conntrack entry. It prints one JSON document:
  `{"attempts": [{"target", "src", "answer", "error", "seconds", "at"}, ...]}`.
  An attempt either has the backend's answer line or one error kind:
  `refused` (TCP RST, or ICMP port unreachable for UDP/SCTP), `timeout`
  (nothing came back: the drop case), `unreachable` (ICMP host/net
  unreachable), `reset` (connection reset after it was accepted), `closed`
  (accepted, then closed without an answer), or the errno name otherwise.
- the caller's side (`run`, `Continuous`): start that program in a
  namespace and parse its report into `Attempt` values.

Timeouts bound connect and read separately; a drop costs exactly one
timeout, so keep them short (0.5 s) where a drop is expected.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = [
    "Attempt",
    "Continuous",
    "ProbeError",
    "answered_by",
    "errors",
    "main",
    "run",
    "subprocess_env",
]

PROTOCOLS = ("tcp", "udp", "sctp")
_IPPROTO_SCTP: int = getattr(socket, "IPPROTO_SCTP", 132)
_UNREACHABLE = {errno.EHOSTUNREACH, errno.ENETUNREACH}


class ProbeError(RuntimeError):
    """The probe program itself failed (bad arguments, crashed, hung)."""


@dataclass(frozen=True, slots=True)
class Attempt:
    """One connection attempt, as the client saw it."""

    target: str
    """`ip:port` or `[ip6]:port`."""
    src: str | None
    """The source address bound (None: the kernel chose)."""
    answer: str | None
    """The backend's line, e.g. `pod1 peer=10.244.0.1:40000`; None on error."""
    error: str | None
    seconds: float
    at: float = 0.0
    """When the attempt started: `time.monotonic()` of the probe process
    (CLOCK_MONOTONIC, the same clock in every process and namespace of the
    machine), so a failure can be placed among the caller's own events."""

    @property
    def ok(self) -> bool:
        return self.answer is not None

    @property
    def pod(self) -> str | None:
        """Which backend answered."""
        return self.answer.split(" ", 1)[0] if self.answer else None

    @property
    def peer(self) -> str | None:
        """The source *address* the backend saw (no port, no brackets)."""
        if not self.answer or " peer=" not in self.answer:
            return None
        hostport = self.answer.split(" peer=", 1)[1]
        host = hostport.rsplit(":", 1)[0]
        return host.strip("[]")


def answered_by(attempts: Iterable[Attempt]) -> Counter[str]:
    """How many attempts each backend answered."""
    return Counter(a.pod for a in attempts if a.pod is not None)


def errors(attempts: Iterable[Attempt]) -> Counter[str]:
    """How many attempts failed, by error kind."""
    return Counter(a.error for a in attempts if a.error is not None)


# --- the program --------------------------------------------------------------


def _format_target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _error_kind(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, ConnectionResetError):
        return "reset"
    if isinstance(exc, OSError) and exc.errno in _UNREACHABLE:
        return "unreachable"
    if isinstance(exc, OSError) and exc.errno:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return type(exc).__name__


def _socket(
    proto: str, host: str, src: str | None, sport: int, timeout: float
) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if proto == "udp":
        sock = socket.socket(family, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
    elif proto == "sctp":
        sock = socket.socket(family, socket.SOCK_STREAM, _IPPROTO_SCTP)
    else:
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.settimeout(timeout)
    if src or sport:
        sock.bind((src or "", sport))
    return sock


def _read_line(sock: socket.socket) -> str | None:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    text = data.decode(errors="replace").strip()
    return text or None


def attempt(
    proto: str, host: str, port: int, *, src: str | None, timeout: float, sport: int = 0
) -> Attempt:
    """One attempt on a fresh socket (the program's unit of work); `sport`
    0 lets the kernel pick a source port."""
    target = _format_target(host, port)
    start = time.monotonic()
    answer: str | None = None
    error: str | None = None
    try:
        with _socket(proto, host, src, sport, timeout) as sock:
            sock.connect((host, port))
            if proto == "udp":
                sock.send(b"probe\n")
                answer = sock.recv(4096).decode(errors="replace").strip() or None
            else:
                answer = _read_line(sock)
            if answer is None:
                error = "closed"
    except OSError as exc:
        error = _error_kind(exc)
    return Attempt(target, src, answer, error, round(time.monotonic() - start, 4), start)


def _pairs(values: Sequence[str]) -> list[tuple[str, int]]:
    if len(values) % 2:
        raise SystemExit("targets come as ADDR PORT pairs")
    return [(values[i], int(values[i + 1])) for i in range(0, len(values), 2)]


def _stdin_closed() -> threading.Event:
    done = threading.Event()

    def watch() -> None:
        try:
            while sys.stdin.buffer.read(4096):
                pass
        finally:
            done.set()

    threading.Thread(target=watch, daemon=True).start()
    return done


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nftproxy.tools.sandbox.probe")
    parser.add_argument("proto", choices=PROTOCOLS)
    parser.add_argument("targets", nargs="+", metavar="ADDR PORT")
    parser.add_argument("--count", type=int, default=1, help="attempts per target")
    parser.add_argument(
        "--src", action="append", default=[], help="source address to bind (repeatable)"
    )
    parser.add_argument(
        "--sport", type=int, default=0, help="fixed source port (UDP: the same flow again)"
    )
    parser.add_argument("--timeout", type=float, default=1.0, help="connect/read timeout (s)")
    parser.add_argument("--interval", type=float, default=0.0, help="pause between attempts (s)")
    parser.add_argument(
        "--until-eof", action="store_true", help="repeat the targets until stdin closes"
    )
    args = parser.parse_args(argv)
    targets = _pairs(args.targets)
    sources: list[str | None] = list(args.src) or [None]
    out: list[Attempt] = []

    def one(host: str, port: int, src: str | None) -> None:
        out.append(
            attempt(args.proto, host, port, src=src, timeout=args.timeout, sport=args.sport)
        )
        if args.interval:
            time.sleep(args.interval)

    if args.until_eof:
        stop = _stdin_closed()
        while not stop.is_set():
            for host, port in targets:
                for src in sources:
                    one(host, port, src)
    else:
        for host, port in targets:
            for src in sources:
                for _ in range(args.count):
                    one(host, port, src)
    json.dump({"attempts": [_as_json(a) for a in out]}, sys.stdout)
    sys.stdout.write("\n")
    return 0


def _as_json(a: Attempt) -> dict[str, Any]:
    return {
        "target": a.target,
        "src": a.src,
        "answer": a.answer,
        "error": a.error,
        "seconds": a.seconds,
        "at": a.at,
    }


# --- the caller's side -----------------------------------------------------------


def subprocess_env() -> dict[str, str]:
    """Environment for sandbox programs: they import this very nftproxy
    (a checkout, an installed copy, whatever the caller runs)."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def _argv(
    ns: str,
    proto: str,
    targets: Sequence[tuple[str, int]],
    *,
    count: int,
    src: str | Sequence[str] | None,
    timeout: float,
    interval: float,
    until_eof: bool,
    sport: int = 0,
) -> list[str]:
    if proto not in PROTOCOLS:
        raise ValueError(f"unknown protocol {proto!r}")
    argv = ["ip", "netns", "exec", ns, sys.executable, "-m", "nftproxy.tools.sandbox.probe", proto]
    for host, port in targets:
        argv += [host, str(port)]
    argv += ["--count", str(count), "--timeout", str(timeout), "--interval", str(interval)]
    for address in [src] if isinstance(src, str) else src or ():
        argv += ["--src", address]
    if sport:
        argv += ["--sport", str(sport)]
    if until_eof:
        argv.append("--until-eof")
    return argv


def _parse(stdout: str, stderr: str, rc: int) -> list[Attempt]:
    if rc != 0:
        raise ProbeError(f"probe exited with {rc}: {stderr.strip()}")
    try:
        doc = json.loads(stdout)
        return [
            Attempt(
                a["target"], a["src"], a["answer"], a["error"], float(a["seconds"]), float(a["at"])
            )
            for a in doc["attempts"]
        ]
    except (ValueError, KeyError, TypeError) as exc:
        raise ProbeError(f"unreadable probe output {stdout[:200]!r}: {exc}") from exc


def run(
    ns: str,
    proto: str,
    targets: Sequence[tuple[str, int]],
    *,
    count: int = 1,
    src: str | Sequence[str] | None = None,
    timeout: float = 1.0,
    interval: float = 0.0,
    sport: int = 0,
) -> list[Attempt]:
    """Run the probe program in namespace `ns` and return its attempts, in
    order: per target, per source, `count` attempts. `sport` fixes the
    source port (UDP: every attempt is then the same conntrack flow)."""
    argv = _argv(
        ns,
        proto,
        targets,
        count=count,
        src=src,
        timeout=timeout,
        interval=interval,
        until_eof=False,
        sport=sport,
    )
    sources = 1 if src is None or isinstance(src, str) else max(1, len(src))
    budget = 10.0 + len(targets) * sources * count * (2 * timeout + interval)
    try:
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=budget,
            check=False,
            env=subprocess_env(),
        )
    except subprocess.TimeoutExpired as exc:
        raise ProbeError(f"probe in {ns} did not finish within {budget:.0f}s") from exc
    return _parse(proc.stdout, proc.stderr, proc.returncode)


class Continuous:
    """A probe that keeps connecting until `stop()` (closing its stdin):
    for traffic that must not break while the rules change underneath."""

    def __init__(
        self,
        ns: str,
        proto: str,
        targets: Sequence[tuple[str, int]],
        *,
        src: str | Sequence[str] | None = None,
        timeout: float = 1.0,
        interval: float = 0.0,
    ) -> None:
        self._argv = _argv(
            ns,
            proto,
            targets,
            count=1,
            src=src,
            timeout=timeout,
            interval=interval,
            until_eof=True,
        )
        self._proc: subprocess.Popen[str] | None = None

    def start(self) -> Continuous:
        self._proc = subprocess.Popen(
            self._argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=subprocess_env(),
        )
        return self

    def stop(self, wait: float = 30.0) -> list[Attempt]:
        """Close stdin, let the attempt in flight finish, return everything."""
        proc, self._proc = self._proc, None
        if proc is None:
            raise ProbeError("probe not running")
        try:
            out, err = proc.communicate(timeout=wait)
        except subprocess.TimeoutExpired as exc:
            proc.kill()
            proc.communicate()
            raise ProbeError("continuous probe did not stop") from exc
        return _parse(out, err, proc.returncode)

    def __enter__(self) -> Continuous:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:  # stop() was not called: just make sure it ends
            proc.kill()
            proc.communicate()


if __name__ == "__main__":
    sys.exit(main())
