"""kube-proxy's chain names where ruleset v2 keeps them: in comments.

Layer: core/trace (pure; the names are core/rules/names.py's). One job:
read the KUBE-* identity a comment carries. Ruleset v2 has no KUBE-SEP or
KUBE-FW chains; the element of the endpoints map that DNATs to an
endpoint (ruleset v3; the cascade rule, for a port with ClientIP
affinity) ends its comment with the endpoint's `KUBE-SEP-<h>`
("ns/svc:port -> 10.0.1.5:8080 KUBE-SEP-<h>", `names.tagged` keeps it
inside the comment budget), and an
element of `firewall-vips` starts with the port's `KUBE-FW-<h>`
("KUBE-FW-<h> ns/svc:port"). A port whose cluster IP goes to a shared
chooser (ruleset v7: `service-ips` element -> goto `dispatch-<p>-<g>-<N>`)
has no KUBE-SVC/SVL chain: its element's comment ends with the one it
stands for ("ns/svc:port KUBE-SVC-<h>", or KUBE-SVL-<h> for
internalTrafficPolicy=Local). `nftproxy trace` and `nftproxy dump` name
endpoints, source-range checks and those services by them, as
`iptables-save` on a kube-proxy node does.
"""

from __future__ import annotations

import re

__all__ = ["ENDPOINT", "FIREWALL", "LOCAL", "SERVICE", "Tagged", "chooser", "identity", "split"]

ENDPOINT = "KUBE-SEP-"
FIREWALL = "KUBE-FW-"
SERVICE = "KUBE-SVC-"
LOCAL = "KUBE-SVL-"

_NAME = re.compile(r"\bKUBE-(?:SEP|FW|SVC|SVL)-[A-Z2-7]{16}\b")
"""A KUBE-* name with names.py's 16 base32 characters of hash."""

Tagged = tuple[str, str]
"""(identity, the rest of the comment) -- ("", comment) without one."""


def split(comment: str | None) -> Tagged:
    """The comment's KUBE-SEP / KUBE-FW / KUBE-SVC / KUBE-SVL name (the last one, as `tagged`
    puts it at the end) and the comment without it."""
    text = comment or ""
    found = list(_NAME.finditer(text))
    if not found:
        return "", text
    m = found[-1]
    rest = (text[: m.start()] + text[m.end() :]).strip()
    return m.group(), " ".join(rest.split())


def identity(comment: str | None, kind: str) -> str:
    """The comment's name of `kind` (ENDPOINT, FIREWALL, SERVICE, LOCAL), or ""."""
    name, _ = split(comment)
    return name if name.startswith(kind) else ""


def chooser(comment: str | None) -> str:
    """The KUBE-SVC-<h> or KUBE-SVL-<h> a comment names (a `service-ips`
    element going to a shared chooser), or ""."""
    name, _ = split(comment)
    return name if name.startswith((SERVICE, LOCAL)) else ""
