"""The nftables tables of the calling thread's network namespace, with their comments.

Layer: kernel edge (standard library only: one raw netlink dump). One job:
`read_tables()`, the kernel's NFT_MSG_GETTABLE dump: every table's family,
name and comment (the comment nft writes into the table's userdata, as
libnftnl's NFTNL_UDATA_TABLE_COMMENT). Caller: kernel/libnftables.py
`NftBackend.find_tables`, on its worker thread, inside the backend's
namespace.

Why not libnftables: 1.0.6's JSON lists no table comment, and its text
listing of one table fetches and prints every rule of it; this dump reads
the tables alone, whatever the size of the ruleset (as kernel/nftgen.py
reads the generation).
"""

from __future__ import annotations

import os
import socket
import struct

__all__ = ["read_tables"]

_NETLINK_NETFILTER = 12
_NFNL_SUBSYS_NFTABLES = 10
_NFT_MSG_GETTABLE = 1
_NFT_MSG_NEWTABLE = 0
_NFTA_TABLE_NAME = 1
_NFTA_TABLE_USERDATA = 6
_NFTNL_UDATA_TABLE_COMMENT = 0
_NLMSG_ERROR = 2
_NLMSG_DONE = 3
_NLM_F_REQUEST = 1
_NLM_F_DUMP = 0x300
_HEADER = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_NFGENMSG = struct.Struct("=BBH")  # family, version, res_id
_ATTR = struct.Struct("=HH")  # nlattr: len, type
_TIMEOUT = 2.0
_FAMILIES = {1: "inet", 2: "ip", 3: "arp", 5: "netdev", 7: "bridge", 10: "ip6"}


def read_tables() -> list[tuple[str, str, str | None]]:
    """(family, name, comment or None) of every table in this thread's
    namespace; OSError if the kernel cannot be asked."""
    request = _NFGENMSG.pack(socket.AF_UNSPEC, 0, 0)
    header = _HEADER.pack(
        _HEADER.size + len(request),
        (_NFNL_SUBSYS_NFTABLES << 8) | _NFT_MSG_GETTABLE,
        _NLM_F_REQUEST | _NLM_F_DUMP,
        1,
        0,
    )
    tables: list[tuple[str, str, str | None]] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_NETFILTER) as sock:
        sock.settimeout(_TIMEOUT)
        sock.bind((0, 0))
        sock.send(header + request)
        while True:
            if _parse(sock.recv(65536), tables):
                return tables


def _parse(answer: bytes, tables: list[tuple[str, str, str | None]]) -> bool:
    """Append the tables of one datagram; True once the dump is done."""
    pos = 0
    while pos + _HEADER.size <= len(answer):
        length, kind, _, _, _ = _HEADER.unpack_from(answer, pos)
        if length < _HEADER.size:
            raise OSError("malformed netlink answer to NFT_MSG_GETTABLE")
        if kind == _NLMSG_DONE:
            return True
        if kind == _NLMSG_ERROR:
            (code,) = struct.unpack_from("=i", answer, pos + _HEADER.size)
            if code == 0:
                return True
            raise OSError(-code, f"NFT_MSG_GETTABLE: {os.strerror(-code)}")
        if kind == (_NFNL_SUBSYS_NFTABLES << 8) | _NFT_MSG_NEWTABLE:
            tables.append(_table(answer[pos : pos + length]))
        pos += (length + 3) & ~3
    return False


def _table(message: bytes) -> tuple[str, str, str | None]:
    family, _, _ = _NFGENMSG.unpack_from(message, _HEADER.size)
    name, comment = "", None
    pos = _HEADER.size + _NFGENMSG.size
    while pos + _ATTR.size <= len(message):
        attr_len, attr_type = _ATTR.unpack_from(message, pos)
        if attr_len < _ATTR.size:
            break
        value = message[pos + _ATTR.size : pos + attr_len]
        if attr_type & 0x3FFF == _NFTA_TABLE_NAME:
            name = value.rstrip(b"\0").decode(errors="replace")
        elif attr_type & 0x3FFF == _NFTA_TABLE_USERDATA:
            comment = _comment(value)
        pos += (attr_len + 3) & ~3
    return _FAMILIES.get(family, str(family)), name, comment


def _comment(userdata: bytes) -> str | None:
    """The comment in a table's userdata (type-length-value entries)."""
    pos = 0
    while pos + 2 <= len(userdata):
        kind, size = userdata[pos], userdata[pos + 1]
        if kind == _NFTNL_UDATA_TABLE_COMMENT:
            return userdata[pos + 2 : pos + 2 + size].rstrip(b"\0").decode(errors="replace")
        pos += 2 + size
    return None
