"""The nftables ruleset generation of the calling thread's network namespace.

Layer: kernel edge (standard library only: one raw netlink request). One
job: `read_generation()`, the kernel's NFT_MSG_GETGEN. The kernel keeps one
generation counter per network namespace and adds one for every committed
nftables transaction, by any process, to any table (a refused transaction
and a listing change nothing). So "the generation our last commit left" is
an exact, cheap test of "nobody else has touched nftables here since"
(agent/drift.py). Caller: kernel/libnftables.py `NftBackend.generation`,
which runs it on its worker thread, inside the backend's namespace.

Cost: one socket, one request, one answer: 0.03 ms (bench/drift_check.py),
whatever the size of the ruleset. libnftables has no call for it (it reads
the generation internally, to validate its cache, and never reports it).

Known limits: the counter is 32 bits and skips 0 when it wraps
(agent/drift.py `next_generation`).
"""

from __future__ import annotations

import os
import socket
import struct

__all__ = ["read_generation"]

_NETLINK_NETFILTER = 12
_NFNL_SUBSYS_NFTABLES = 10
_NFT_MSG_GETGEN = 16
_NFTA_GEN_ID = 1
_NLMSG_ERROR = 2
_NLM_F_REQUEST = 1
_HEADER = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_NFGENMSG = struct.Struct("=BBH")  # family, version, res_id (big endian, 0 here)
_ATTR = struct.Struct("=HH")  # nlattr: len, type
_TIMEOUT = 2.0


def read_generation() -> int:
    """The current ruleset generation of this thread's namespace; OSError
    if the kernel cannot be asked (no nf_tables, no permission)."""
    request = _NFGENMSG.pack(socket.AF_UNSPEC, 0, 0)
    header = _HEADER.pack(
        _HEADER.size + len(request),
        (_NFNL_SUBSYS_NFTABLES << 8) | _NFT_MSG_GETGEN,
        _NLM_F_REQUEST,
        1,
        0,
    )
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_NETFILTER) as sock:
        sock.settimeout(_TIMEOUT)
        sock.bind((0, 0))
        sock.send(header + request)
        answer = sock.recv(8192)
    return _parse(answer)


def _parse(answer: bytes) -> int:
    if len(answer) < _HEADER.size:
        raise OSError("short netlink answer to NFT_MSG_GETGEN")
    length, kind, _, _, _ = _HEADER.unpack_from(answer)
    if kind == _NLMSG_ERROR:
        (code,) = struct.unpack_from("=i", answer, _HEADER.size)
        raise OSError(-code, f"NFT_MSG_GETGEN: {os.strerror(-code)}")
    pos = _HEADER.size + _NFGENMSG.size
    end = min(length, len(answer))
    while pos + _ATTR.size <= end:
        attr_len, attr_type = _ATTR.unpack_from(answer, pos)
        if attr_len < _ATTR.size:
            break
        if attr_type & 0x3FFF == _NFTA_GEN_ID:
            (generation,) = struct.unpack_from("!I", answer, pos + _ATTR.size)
            return int(generation)
        pos += (attr_len + 3) & ~3
    raise OSError("no NFTA_GEN_ID in the answer to NFT_MSG_GETGEN")
