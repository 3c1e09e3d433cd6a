"""The server every sandbox pod runs: answer with my name and the peer I saw.

Layer: edge (a standalone program; standard library only, so it starts fast).
One job: listen on the given TCP, UDP and SCTP ports, IPv4 and IPv6 (one
socket each, IPV6_V6ONLY), and answer

- each TCP / SCTP connection with one line `<name> peer=<ip>:<port>` (IPv6 as
  `[ip]:port`), then close it;
- each UDP datagram with the same line, sent back to its source.

The peer is what the kernel reports for the connection, i.e. the address
after any masquerade on the way in: a test compares it with the client's own
address to tell whether the node masqueraded the packet.

Run inside a pod namespace by `topology`:

    ip netns exec POD python -m nftproxy.tools.sandbox.backends --name pod1 \
        --tcp 8080 --udp 5353 [--sctp 9090]

It prints `ready` on stdout once every socket is bound, and exits when its
stdin (a pipe from the parent) reaches EOF, so it never outlives the test
that started it even if that test is killed.

Known limits: single-threaded and sequential (a handful of ms per answer is
plenty for tests); SCTP only where the kernel has it (`sctp_support()`).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import selectors
import socket
import stat
import sys
from collections.abc import Iterable, Sequence

__all__ = ["IPPROTO_SCTP", "answer_line", "format_peer", "main", "sctp_support"]

IPPROTO_SCTP: int = getattr(socket, "IPPROTO_SCTP", 132)

_FAMILIES = ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::"))


def sctp_support() -> str | None:
    """None when this kernel (this netns) can open SCTP sockets, else why not.

    Creating the socket is the probe: it is what loads the sctp module where
    modules exist, and what fails with EPROTONOSUPPORT where SCTP is absent.
    """
    try:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, IPPROTO_SCTP)
    except OSError as exc:
        name = errno.errorcode.get(exc.errno or 0, "?")
        return f"{exc.strerror or exc} ({name})"
    sock.close()
    return None


def format_peer(host: str, port: int) -> str:
    """`ip:port`, `[ip6]:port`; IPv4-mapped IPv6 shown as plain IPv4."""
    if host.startswith("::ffff:") and "." in host:
        host = host[len("::ffff:") :]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def answer_line(name: str, peer: tuple[str, int] | tuple[str, int, int, int]) -> bytes:
    return f"{name} peer={format_peer(peer[0], peer[1])}\n".encode()


def _bind(kind: int, proto: int, ports: Iterable[int]) -> list[socket.socket]:
    out: list[socket.socket] = []
    for port in ports:
        for family, any_addr in _FAMILIES:
            try:
                sock = socket.socket(family, kind, proto)
            except OSError as exc:
                if family == socket.AF_INET6 and exc.errno == errno.EAFNOSUPPORT:
                    continue  # no IPv6 in this kernel: serve IPv4 only
                raise
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((any_addr, port))
            if kind == socket.SOCK_STREAM:
                sock.listen(256)
            sock.setblocking(False)
            out.append(sock)
    return out


def _serve_stream(name: str, listener: socket.socket) -> None:
    try:
        conn, peer = listener.accept()
    except (BlockingIOError, InterruptedError, ConnectionAbortedError):
        return
    with conn:
        conn.settimeout(2.0)
        with contextlib.suppress(OSError):  # the client gave up: nobody to tell
            conn.sendall(answer_line(name, peer))


def _serve_datagram(name: str, sock: socket.socket) -> None:
    try:
        _, peer = sock.recvfrom(2048)
    except (BlockingIOError, InterruptedError, ConnectionRefusedError):
        return
    with contextlib.suppress(OSError):
        sock.sendto(answer_line(name, peer), peer)


def serve(
    name: str,
    tcp: Sequence[int],
    udp: Sequence[int],
    sctp: Sequence[int],
    *,
    watch_stdin: bool,
) -> None:
    """Bind everything, print `ready`, answer until stdin closes (if watched)."""
    sel = selectors.DefaultSelector()
    for sock in _bind(socket.SOCK_STREAM, socket.IPPROTO_TCP, tcp):
        sel.register(sock, selectors.EVENT_READ, "stream")
    for sock in _bind(socket.SOCK_STREAM, IPPROTO_SCTP, sctp):
        sel.register(sock, selectors.EVENT_READ, "stream")
    for sock in _bind(socket.SOCK_DGRAM, socket.IPPROTO_UDP, udp):
        sel.register(sock, selectors.EVENT_READ, "dgram")
    if watch_stdin:
        sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "stdin")
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        for key, _ in sel.select():
            if key.data == "stdin":
                if not os.read(sys.stdin.fileno(), 4096):
                    return
            elif key.data == "stream":
                _serve_stream(name, key.fileobj)  # type: ignore[arg-type]
            else:
                _serve_datagram(name, key.fileobj)  # type: ignore[arg-type]


def _stdin_is_pipe() -> bool:
    try:
        return stat.S_ISFIFO(os.fstat(sys.stdin.fileno()).st_mode)
    except (OSError, ValueError):
        return False


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nftproxy.tools.sandbox.backends")
    parser.add_argument("--name", required=True, help="what to answer with (the pod name)")
    parser.add_argument("--tcp", type=int, action="append", default=[], metavar="PORT")
    parser.add_argument("--udp", type=int, action="append", default=[], metavar="PORT")
    parser.add_argument("--sctp", type=int, action="append", default=[], metavar="PORT")
    parser.add_argument("--sctp-check", action="store_true", help="print SCTP support and exit")
    args = parser.parse_args(argv)
    if args.sctp_check:
        reason = sctp_support()
        print("ok" if reason is None else f"unsupported: {reason}")
        return 0 if reason is None else 1
    try:
        serve(args.name, args.tcp, args.udp, args.sctp, watch_stdin=_stdin_is_pipe())
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
