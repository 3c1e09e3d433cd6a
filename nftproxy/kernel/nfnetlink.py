"""One raw nf_tables netlink request, and the attributes of its answers.

Layer: kernel edge (standard library only). One job: the plumbing that
kernel/nftgen.py (the ruleset generation) and kernel/nfttables.py (the
tables and their comments) share: send an NFT_MSG_* request for every
family on a netlink socket of the calling thread's namespace
(`requested`), and walk a message's attributes (`attributes`). Each caller
parses what its message means. kernel/conntrack.py shares its headers and
constants, not its walk (it reads attributes in place, without copies).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = [
    "ATTR",
    "HEADER",
    "NFGENMSG",
    "NFNL_SUBSYS_NFTABLES",
    "NLMSG_DONE",
    "NLMSG_ERROR",
    "NLM_F_DUMP",
    "NLM_F_REQUEST",
    "attributes",
    "requested",
]

NETLINK_NETFILTER = 12
NLA_TYPE_MASK = 0x3FFF  # an attribute's type without its NESTED and BYTEORDER flags
NFNL_SUBSYS_NFTABLES = 10
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 1
NLM_F_DUMP = 0x300
HEADER = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
NFGENMSG = struct.Struct("=BBH")  # family, version, res_id (big endian, 0 here)
ATTR = struct.Struct("=HH")  # nlattr: len, type
_TIMEOUT = 2.0


@contextmanager
def requested(message: int, flags: int = NLM_F_REQUEST) -> Iterator[socket.socket]:
    """A socket that has sent nf_tables request `message` (an NFT_MSG_*)
    for every family; the caller reads the answer from it."""
    body = NFGENMSG.pack(socket.AF_UNSPEC, 0, 0)
    header = HEADER.pack(
        HEADER.size + len(body), (NFNL_SUBSYS_NFTABLES << 8) | message, flags, 1, 0
    )
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER) as sock:
        sock.settimeout(_TIMEOUT)
        sock.bind((0, 0))
        sock.send(header + body)
        yield sock


def attributes(message: bytes, end: int | None = None) -> Iterator[tuple[int, bytes]]:
    """(type, value) of each attribute of one nf_tables message (after its
    headers, up to `end`, default its end); stops at a malformed one."""
    pos = HEADER.size + NFGENMSG.size
    end = len(message) if end is None else min(end, len(message))
    while pos + ATTR.size <= end:
        attr_len, attr_type = ATTR.unpack_from(message, pos)
        if attr_len < ATTR.size:
            return
        yield attr_type & NLA_TYPE_MASK, message[pos + ATTR.size : pos + attr_len]
        pos += (attr_len + 3) & ~3
