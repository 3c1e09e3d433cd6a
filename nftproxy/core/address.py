"""IP:PORT bind addresses: the one parser of `--healthz-bind-address` and friends.

Layer: core (pure; stdlib only). One job: read an "IP:PORT" text into a
(host, port) pair, with every check the callers need. Callers:
tools.config_values (healthzBindAddress / metricsBindAddress, with a default
port and port 0 refused), serving.health and serving.metrics (the address
they bind, port 0 = ephemeral).

Forms: "10.0.0.1:10256", "[fd00::1]:10256" (IPv6 in brackets), ":10256"
(host "" = every address, unless `require_host`), and with `default_port`
a bare IP: "10.0.0.1", "fd00::1", "[fd00::1]". The host must be an IP
literal (no names: nothing here resolves); it comes back normalised
("fd00:0::1" -> "fd00::1") and without brackets.
"""

from __future__ import annotations

import ipaddress
import re

__all__ = ["format_address", "parse_address"]

_BRACKETED = re.compile(r"\[([^\]]+)\](?::(\d*))?")
_MAX_PORT = 65535


def parse_address(
    text: str, *, default_port: int | None = None, min_port: int = 0, require_host: bool = False
) -> tuple[str, int]:
    """'0.0.0.0:10256' -> ('0.0.0.0', 10256); '[::1]:10256' -> ('::1', 10256);
    ':10256' -> ('', 10256) (every address). ValueError naming the text and
    the problem otherwise: no port (and no `default_port`), a host that is
    not an IP, an empty host with `require_host`, a port outside
    `min_port`..65535."""
    text = text.strip()
    host, port_text = _split(text, default_port)
    if host or require_host:
        try:
            host = str(ipaddress.ip_address(host))
        except ValueError:
            example = f"0.0.0.0:{default_port if default_port is not None else 10256}"
            raise ValueError(f"{text!r} is not an address:port (e.g. {example})") from None
    if port_text is None:
        raise ValueError(f"{text!r} has no port (want IP:PORT)")
    if not port_text.isdigit() or not min_port <= int(port_text) <= _MAX_PORT:
        raise ValueError(f"{text!r}: port {port_text!r} is not in {min_port}..{_MAX_PORT}")
    return host, int(port_text)


def _split(text: str, default_port: int | None) -> tuple[str, str | None]:
    """(host, port text) before any check; the port text is None when there
    is none and no default."""
    default = str(default_port) if default_port is not None else None
    bracketed = _BRACKETED.fullmatch(text)
    if bracketed:
        return bracketed.group(1), bracketed.group(2) or default
    if text.count(":") == 1:
        host, port_text = text.split(":")
        return host, port_text
    return text, default  # a bare IPv4 or IPv6 address (or garbage, refused as a host)


def format_address(host: str, port: int) -> str:
    """The text parse_address reads back: '[fd00::1]:80', '10.0.0.1:80', ':80'."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
