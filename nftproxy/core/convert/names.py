"""Object and port names, checked as the API server checks them.

Layer: convert (imports nothing of nftproxy). One job: say whether a name
is one the API server would have accepted, and why not: a file source
hands over names no API server saw, and a name reaches the kernel (in
comments) and the KUBE-* hashes (`ns/name:port`), which stay distinct only
for names without ':' or '/' (tests/test_names.py).

What the API server requires (k8s.io/apimachinery validation):
- namespace: a DNS-1123 label;
- Service name: a DNS-1035 label;
- EndpointSlice and Node names: DNS-1123 subdomains;
- Service and EndpointSlice port names: empty or a DNS-1123 label
  (core/v1 validateServicePort; container ports, not these, are IANA_SVC_NAMEs).

Each check is a regular expression and a length: a few hundred nanoseconds,
done once per object, never per endpoint.
"""

from __future__ import annotations

import re

__all__ = ["dns1035_label", "dns1123_label", "dns1123_subdomain", "printable"]

_LABEL_MAX = 63
_SUBDOMAIN_MAX = 253
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(
    r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
)


def dns1123_label(value: str) -> str | None:
    """Why `value` is not a DNS-1123 label (None: it is).

    >>> dns1123_label("web-1") is None
    True
    >>> dns1123_label("b:c").split(" (")[0]
    "'b:c' is not a DNS-1123 label"
    """
    if len(value) <= _LABEL_MAX and _DNS1123_LABEL.fullmatch(value):
        return None
    return _why(value, "a DNS-1123 label", _LABEL_MAX,
                "lowercase letters, digits and '-', starting and ending with a letter or digit")


def dns1035_label(value: str) -> str | None:
    """Why `value` is not a DNS-1035 label (a Service name; None: it is)."""
    if len(value) <= _LABEL_MAX and _DNS1035_LABEL.fullmatch(value):
        return None
    return _why(value, "a DNS-1035 label", _LABEL_MAX,
                "lowercase letters, digits and '-', starting with a letter, "
                "ending with a letter or digit")


def dns1123_subdomain(value: str) -> str | None:
    """Why `value` is not a DNS-1123 subdomain (None: it is)."""
    if len(value) <= _SUBDOMAIN_MAX and _DNS1123_SUBDOMAIN.fullmatch(value):
        return None
    return _why(value, "a DNS-1123 subdomain", _SUBDOMAIN_MAX,
                "DNS-1123 labels joined by '.'")


def _why(value: str, what: str, limit: int, rule: str) -> str:
    shown = printable(value if len(value) <= 64 else value[:61] + "...")
    if len(value) > limit:
        return f"{shown!r} is not {what} (at most {limit} characters)"
    return f"{shown!r} is not {what} ({rule})"


def printable(text: str) -> str:
    """`text`, with every non-printable character escaped as repr() would
    (a newline as \\n, ESC as \\x1b): what may be shown on a terminal.

    >>> printable("a\\nb\\x1b[31m")
    'a\\\\nb\\\\x1b[31m'
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
