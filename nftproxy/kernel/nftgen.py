"""The nftables ruleset generation of the calling thread's network namespace.

Layer: kernel edge (standard library only: one raw netlink request). One
job: `read_generation()`, the kernel's NFT_MSG_GETGEN. The kernel keeps one
generation counter per network namespace and adds one for every committed
nftables transaction, by any process, to any table (a refused transaction
and a listing change nothing). So "the generation our last commit left" is
an exact, cheap test of "nobody else has touched nftables here since"
(agent/drift.py). Caller: kernel/libnftables.py `NftBackend.generation`,
which runs it on its worker thread, inside the backend's namespace.

Cost: one socket, one request, one answer, whatever the size of the
ruleset (bench/probes/drift_check.py). libnftables has no call for it (it reads
the generation internally, to validate its cache, and never reports it).

Known limits: the counter is 32 bits and skips 0 when it wraps
(agent/drift.py `next_generation`).
"""

from __future__ import annotations

import os
import struct

from nftproxy.kernel.nfnetlink import HEADER, NLMSG_ERROR, attributes, requested

__all__ = ["read_generation"]

_NFT_MSG_GETGEN = 16
_NFTA_GEN_ID = 1


def read_generation() -> int:
    """The current ruleset generation of this thread's namespace; OSError
    if the kernel cannot be asked (no nf_tables, no permission)."""
    with requested(_NFT_MSG_GETGEN) as sock:
        answer = sock.recv(8192)
    return _parse(answer)


def _parse(answer: bytes) -> int:
    if len(answer) < HEADER.size:
        raise OSError("short netlink answer to NFT_MSG_GETGEN")
    length, kind, _, _, _ = HEADER.unpack_from(answer)
    if kind == NLMSG_ERROR:
        (code,) = struct.unpack_from("=i", answer, HEADER.size)
        raise OSError(-code, f"NFT_MSG_GETGEN: {os.strerror(-code)}")
    for attr_type, value in attributes(answer, length):
        if attr_type == _NFTA_GEN_ID:
            (generation,) = struct.unpack_from("!I", value)
            return int(generation)
    raise OSError("no NFTA_GEN_ID in the answer to NFT_MSG_GETGEN")
