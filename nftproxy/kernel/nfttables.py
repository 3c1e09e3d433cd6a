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
import struct

from nftproxy.kernel.nfnetlink import (
    HEADER,
    NFGENMSG,
    NFNL_SUBSYS_NFTABLES,
    NLM_F_DUMP,
    NLM_F_REQUEST,
    NLMSG_DONE,
    NLMSG_ERROR,
    attributes,
    requested,
)

__all__ = ["read_tables"]

_NFT_MSG_GETTABLE = 1
_NFT_MSG_NEWTABLE = 0
_NFTA_TABLE_NAME = 1
_NFTA_TABLE_USERDATA = 6
_NFTNL_UDATA_TABLE_COMMENT = 0
_FAMILIES = {1: "inet", 2: "ip", 3: "arp", 5: "netdev", 7: "bridge", 10: "ip6"}


def read_tables() -> list[tuple[str, str, str | None]]:
    """(family, name, comment or None) of every table in this thread's
    namespace; OSError if the kernel cannot be asked."""
    tables: list[tuple[str, str, str | None]] = []
    with requested(_NFT_MSG_GETTABLE, NLM_F_REQUEST | NLM_F_DUMP) as sock:
        while True:
            if _parse(sock.recv(65536), tables):
                return tables


def _parse(answer: bytes, tables: list[tuple[str, str, str | None]]) -> bool:
    """Append the tables of one datagram; True once the dump is done."""
    pos = 0
    while pos + HEADER.size <= len(answer):
        length, kind, _, _, _ = HEADER.unpack_from(answer, pos)
        if length < HEADER.size:
            raise OSError("malformed netlink answer to NFT_MSG_GETTABLE")
        if kind == NLMSG_DONE:
            return True
        if kind == NLMSG_ERROR:
            (code,) = struct.unpack_from("=i", answer, pos + HEADER.size)
            if code == 0:
                return True
            raise OSError(-code, f"NFT_MSG_GETTABLE: {os.strerror(-code)}")
        if kind == (NFNL_SUBSYS_NFTABLES << 8) | _NFT_MSG_NEWTABLE:
            tables.append(_table(answer[pos : pos + length]))
        pos += (length + 3) & ~3
    return False


def _table(message: bytes) -> tuple[str, str, str | None]:
    family, _, _ = NFGENMSG.unpack_from(message, HEADER.size)
    name, comment = "", None
    for attr_type, value in attributes(message):
        if attr_type == _NFTA_TABLE_NAME:
            name = value.rstrip(b"\0").decode(errors="replace")
        elif attr_type == _NFTA_TABLE_USERDATA:
            comment = _comment(value)
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
