"""KUBE-* names, exactly as kube-proxy's iptables mode spells them.

Layer: rules (pure). One job: every chain/set/map name and every comment
string nftproxy writes, with the kernel's limits enforced here and nowhere
else, so an operator can line `nftproxy dump` up against `iptables-save` from
a kube-proxy node.

Hashes (kube-proxy pkg/proxy/iptables): h = base32(sha256(spn + proto))[:16]
where spn is "ns/name" or "ns/name:port" and proto is lower case; endpoint
chains hash spn + proto + "ip:port" ("[ip]:port" for IPv6).
"""

from __future__ import annotations

import hashlib

from nftproxy.core.model import Endpoint, ServicePortName

__all__ = [
    "COMMENT_MAX_BYTES",
    "NAME_MAX",
    "affinity_key",
    "affinity_table",
    "check_comment",
    "comment",
    "endpoint_chain",
    "external_chain",
    "firewall_chain",
    "local_chain",
    "service_chain",
    "service_hash",
    "table_pair",
    "tagged",
]

NAME_MAX = 256
"""NFT_CHAIN_MAXNAMELEN / NFT_SET_MAXNAMELEN (kernel >= 4.x): names are < 256 bytes."""

_B32 = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
"""RFC 4648 base32 alphabet."""

COMMENT_MAX_BYTES = 128
"""libnftables rejects comments over 128 bytes (NFT_USERDATA comment limit);
kubernetes#139515 shows one long comment failing the whole transaction."""


_B32_PAIRS = tuple(a + b for a in _B32 for b in _B32)
"""The two base32 characters of every 10-bit value."""


def _hash16(text: str) -> str:
    """base32(sha256(text))[:16]: the first 80 bits, 10 at a time (the
    render's hot spot; faster than 5 at a time or base64.b32encode)."""
    b = int.from_bytes(hashlib.sha256(text.encode()).digest()[:10], "big")
    t = _B32_PAIRS
    return (
        t[b >> 70] + t[(b >> 60) & 1023] + t[(b >> 50) & 1023] + t[(b >> 40) & 1023]
        + t[(b >> 30) & 1023] + t[(b >> 20) & 1023] + t[(b >> 10) & 1023] + t[b & 1023]
    )


def service_hash(spn: ServicePortName) -> str:
    """>>> service_hash(ServicePortName("ns1", "svc1", "p80", L4Protocol.TCP))
    'XPGD46QRK7WJZT7O'  # pinned in tests/test_names.py
    """
    return _hash16(str(spn) + spn.protocol.nft)


def service_chain(spn: ServicePortName) -> str:
    """KUBE-SVC-<h>: the Cluster-policy endpoint chooser of a service port."""
    return "KUBE-SVC-" + service_hash(spn)


def local_chain(spn: ServicePortName) -> str:
    """KUBE-SVL-<h>: the Local-policy endpoint chooser (local endpoints only)."""
    return "KUBE-SVL-" + service_hash(spn)


def external_chain(spn: ServicePortName) -> str:
    """KUBE-EXT-<h>: external destinations (node port, external IP, LB IP)."""
    return "KUBE-EXT-" + service_hash(spn)


def firewall_chain(spn: ServicePortName) -> str:
    """KUBE-FW-<h>: kube-proxy's name for a service port's
    loadBalancerSourceRanges check; it names the port's `firewall-vips`
    elements (the check is one shared rule, evaluated before DNAT)."""
    return "KUBE-FW-" + service_hash(spn)


def endpoint_chain(spn: ServicePortName, endpoint: Endpoint) -> str:
    """KUBE-SEP-<h>: kube-proxy's name for one endpoint of a service port. No
    chain carries it any more (the DNAT is inline); it names the endpoint in
    the comment of the rule that DNATs to it."""
    return "KUBE-SEP-" + _hash16(str(spn) + spn.protocol.nft + endpoint.address)


def endpoints_key(chain: str) -> tuple[int, int]:
    """The fixed part of a chooser chain's keys in the endpoints maps (and,
    of an endpoint chain's name, of its clients' in the affinity set): two
    31-bit halves of sha256(chain) (62 bits: no collision expected among
    millions of chains, as kube-proxy's own 80-bit chain names; each below
    2^31, which 1.0.6's JSON lists as a signed number otherwise)."""
    digest = hashlib.sha256(chain.encode()).digest()
    mask = 0x7FFFFFFF
    return int.from_bytes(digest[:4], "big") & mask, int.from_bytes(digest[4:8], "big") & mask


def affinity_key(spn: ServicePortName, endpoint: Endpoint) -> tuple[int, int]:
    """The endpoint's part of its clients' keys in the shared affinity set:
    `endpoints_key` of its KUBE-SEP-<h> (the same for the port's Cluster and
    Local choosers, as kube-proxy's one set per endpoint chain)."""
    return endpoints_key(endpoint_chain(spn, endpoint))


_AFFINITY_SUFFIX = "-affinity"


def affinity_table(table: str) -> str:
    """The name of the table that holds the chains of the ports with ClientIP
    affinity, beside the main table `table` (fragment.AFFINITY_TABLE)."""
    return table + _AFFINITY_SUFFIX


def table_pair(table: str) -> tuple[str, str]:
    """The two names nftproxy's main table takes in turn: a full sync in
    steps builds the one that is not live, unhooked, and then switches to it
    in one transaction (agent/chunked.py). `table_pair("nftproxy")` ==
    `("nftproxy", "nftproxy-b")`."""
    return table, table + "-b"


def _sayable(text: str) -> bool:
    return text.isprintable() and '"' not in text and "\\" not in text


def comment(text: str) -> str:
    """`text` as a comment both printers can write: a character nft's syntax
    cannot quote (a double quote, a backslash, an unprintable one) becomes
    "?", and a text over the kernel's budget is cut to end in a short hash
    of the whole text (so two long comments stay distinguishable). UTF-8
    aware: never splits a character."""
    if text.isascii() and len(text) <= COMMENT_MAX_BYTES and _sayable(text):
        return text  # a byte a character
    if not _sayable(text):
        text = "".join(c if _sayable(c) else "?" for c in text)
    raw = text.encode()
    if len(raw) <= COMMENT_MAX_BYTES:
        return text
    tail = "..." + _hash16(text)[:8]
    budget = COMMENT_MAX_BYTES - len(tail)
    head = raw[:budget].decode(errors="ignore")
    return head + tail


def check_comment(text: str) -> str:
    """`text` if it is a comment as `comment` makes them, else ValueError."""
    if len(text.encode()) > COMMENT_MAX_BYTES or not _sayable(text):
        raise ValueError(f"comment {text!r}: not as names.comment makes it")
    return text


def tagged(text: str, tag: str) -> str:
    """`text tag` within the comment budget: `text` is cut (as `comment`
    cuts) so that the KUBE-* identity `tag` always survives."""
    whole = f"{text} {tag}"
    if len(whole.encode()) <= COMMENT_MAX_BYTES:
        return whole
    room = COMMENT_MAX_BYTES - len(tag.encode()) - 1
    head = text.encode()[: room - 11].decode(errors="ignore")
    return f"{head}...{_hash16(text)[:8]} {tag}"
