"""kube-proxy's chain names where ruleset v2 keeps them: in comments.

Layer: core/trace (pure; the names are core/rules/names.py's). One job:
read the KUBE-* identity a comment carries. Ruleset v2 has no KUBE-SEP or
KUBE-FW chains; the element of the endpoints map that DNATs to an
endpoint (ruleset v3; the cascade rule, for a port with ClientIP
affinity) ends its comment with the endpoint's `KUBE-SEP-<h>`
("ns/svc:port -> 10.0.1.5:8080 KUBE-SEP-<h>", `names.tagged` keeps it
inside the comment budget), and an
element of `firewall-vips` starts with the port's `KUBE-FW-<h>`
("KUBE-FW-<h> ns/svc:port"). `nftproxy trace` and `nftproxy dump` name
endpoints and source-range checks by them, as `iptables-save` on a
kube-proxy node does.
"""

from __future__ import annotations

import re

__all__ = ["ENDPOINT", "FIREWALL", "Tagged", "identity", "split"]

ENDPOINT = "KUBE-SEP-"
FIREWALL = "KUBE-FW-"

_NAME = re.compile(r"\bKUBE-(?:SEP|FW)-[A-Z2-7]{16}\b")
"""A KUBE-* name with names.py's 16 base32 characters of hash."""

Tagged = tuple[str, str]
"""(identity, the rest of the comment) -- ("", comment) without one."""


def split(comment: str | None) -> Tagged:
    """The comment's KUBE-SEP / KUBE-FW name (the last one, as `tagged`
    puts it at the end) and the comment without it."""
    text = comment or ""
    found = list(_NAME.finditer(text))
    if not found:
        return "", text
    m = found[-1]
    rest = (text[: m.start()] + text[m.end() :]).strip()
    return m.group(), " ".join(rest.split())


def identity(comment: str | None, kind: str) -> str:
    """The comment's name of `kind` (ENDPOINT or FIREWALL), or ""."""
    name, _ = split(comment)
    return name if name.startswith(kind) else ""
