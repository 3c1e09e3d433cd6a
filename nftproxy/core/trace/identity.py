"""kube-proxy's chain names where nftproxy's ruleset keeps them: in comments.

Layer: core/trace (pure; the names are core/rules/names.py's). One job:
read the KUBE-* identity a comment carries. The ruleset has no KUBE-SEP
or KUBE-FW chains; the element of the endpoints map that DNATs to an
endpoint (the cascade rule, for a port with ClientIP affinity) ends its
comment with the endpoint's `KUBE-SEP-<h>`
("ns/svc:port -> 10.0.1.5:8080 KUBE-SEP-<h>", `names.tagged` keeps it
inside the comment budget), and an
element of `firewall-vips` starts with the port's `KUBE-FW-<h>`
("KUBE-FW-<h> ns/svc:port"). A port whose destinations go to shared
choosers (a `service-ips` / `service-nodeports` element -> goto
`dispatch-<p>-<g>-<N>` / `dispatch-nodeport-<p>-<g>-<N>`) has no chain of
its own: each element's comment ends with the chain kube-proxy would send
it to ("ns/svc:port KUBE-SVC-<h>" for the cluster IP, KUBE-SVL-<h> for
internalTrafficPolicy=Local; "ns/svc:port KUBE-EXT-<h>" for an external IP,
LB VIP or the node port, as do their `masquerade-vips` /
`masquerade-nodeports` elements). `nftproxy trace` and `nftproxy dump`
name endpoints, source-range checks and those services by them, as
`iptables-save` on a kube-proxy node does.
"""

from __future__ import annotations

import re

__all__ = [
    "ENDPOINT",
    "EXTERNAL",
    "FIREWALL",
    "LOCAL",
    "SERVICE",
    "Tagged",
    "chooser",
    "identity",
    "split",
]

ENDPOINT = "KUBE-SEP-"
FIREWALL = "KUBE-FW-"
SERVICE = "KUBE-SVC-"
LOCAL = "KUBE-SVL-"
EXTERNAL = "KUBE-EXT-"

_NAME = re.compile(r"\bKUBE-(?:SEP|FW|SVC|SVL|EXT)-[A-Z2-7]{16}\b")
"""A KUBE-* name with names.py's 16 base32 characters of hash."""

Tagged = tuple[str, str]
"""(identity, the rest of the comment) -- ("", comment) without one."""


def split(comment: str | None) -> Tagged:
    """The comment's KUBE-SEP / KUBE-FW / KUBE-SVC / KUBE-SVL / KUBE-EXT name
    (the last one, as `tagged` puts it at the end) and the comment without it."""
    text = comment or ""
    found = list(_NAME.finditer(text))
    if not found:
        return "", text
    m = found[-1]
    rest = (text[: m.start()] + text[m.end() :]).strip()
    return m.group(), " ".join(rest.split())


def identity(comment: str | None, kind: str | tuple[str, ...]) -> str:
    """The comment's name of `kind` (ENDPOINT, FIREWALL, SERVICE, LOCAL,
    EXTERNAL, or a tuple of them), or ""."""
    name, _ = split(comment)
    return name if name.startswith(kind) else ""


def chooser(comment: str | None) -> str:
    """The KUBE-SVC-<h>, KUBE-SVL-<h> or KUBE-EXT-<h> a comment names (an
    element going to a shared chooser, or marking its destination), or ""."""
    return identity(comment, (SERVICE, LOCAL, EXTERNAL))
