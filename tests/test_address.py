"""The one IP:PORT parser (nftproxy.core.address).

Aspects: the accepted forms (IPv4, bracketed IPv6, empty host = every
address, a bare IP with a default port); what is refused and how the error
names it (no port, a host that is not an IP, an empty host when one is
required, a port out of range); normalised hosts; format_address round-trips.
"""

from __future__ import annotations

import pytest

from nftproxy.core.address import format_address, parse_address


def test_parse_address() -> None:
    assert parse_address("0.0.0.0:10256") == ("0.0.0.0", 10256)
    assert parse_address("[::1]:10256") == ("::1", 10256)
    assert parse_address(":0") == ("", 0)
    for bad in ("10256", "host:port", "1.2.3.4:70000"):
        with pytest.raises(ValueError):
            parse_address(bad)


@pytest.mark.parametrize(
    ("text", "kwargs", "parsed"),
    [
        ("127.0.0.1:10249", {}, ("127.0.0.1", 10249)),
        (" 127.0.0.1:10249 ", {}, ("127.0.0.1", 10249)),
        ("[fd00:0::1]:80", {}, ("fd00::1", 80)),
        ("[::]:0", {}, ("::", 0)),
        (":10256", {}, ("", 10256)),
        ("127.0.0.1", {"default_port": 10256}, ("127.0.0.1", 10256)),
        ("::", {"default_port": 10256}, ("::", 10256)),
        ("[::1]", {"default_port": 10256}, ("::1", 10256)),
        ("[::1]:", {"default_port": 10256}, ("::1", 10256)),
        ("1.2.3.4:65535", {"min_port": 1}, ("1.2.3.4", 65535)),
    ],
    ids=[
        "IPv4 and port",
        "surrounding blanks",
        "bracketed IPv6, normalised",
        "every IPv6 address, ephemeral port",
        "empty host: every address",
        "bare IPv4 takes the default port",
        "bare IPv6 takes the default port",
        "bracketed IPv6 without port takes the default port",
        "bracketed IPv6 with an empty port takes the default port",
        "highest port",
    ],
)
def test_accepted_forms(text: str, kwargs: dict[str, int], parsed: tuple[str, int]) -> None:
    assert parse_address(text, **kwargs) == parsed  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "kwargs", "message"),
    [
        ("127.0.0.1", {}, "'127.0.0.1' has no port"),
        ("localhost:10256", {}, "'localhost:10256' is not an address:port"),
        ("[::1]:x", {}, "'[::1]:x' is not an address:port"),
        ("nope", {"default_port": 10256}, "'nope' is not an address:port (e.g. 0.0.0.0:10256)"),
        ("1.2.3.4:x", {}, "'1.2.3.4:x': port 'x' is not in 0..65535"),
        ("1.2.3.4:", {}, "'1.2.3.4:': port '' is not in 0..65535"),
        ("127.0.0.1:99999", {}, "'127.0.0.1:99999': port '99999' is not in 0..65535"),
        ("127.0.0.1:0", {"min_port": 1}, "'127.0.0.1:0': port '0' is not in 1..65535"),
        (":10256", {"require_host": True}, "':10256' is not an address:port"),
    ],
    ids=[
        "no port and no default",
        "a host name",
        "bracketed IPv6 with a port that is not a number",
        "garbage with a default port",
        "a port that is not a number",
        "an empty port",
        "port above 65535",
        "port 0 when the caller needs a real port",
        "empty host when the caller needs one",
    ],
)
def test_refused_forms_name_the_text_and_the_problem(
    text: str, kwargs: dict[str, int], message: str
) -> None:
    with pytest.raises(ValueError) as err:
        parse_address(text, **kwargs)  # type: ignore[arg-type]
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("text", ["10.0.0.1:80", "[fd00::1]:80", ":80", "[::]:0"])
def test_format_address_is_read_back(text: str) -> None:
    assert format_address(*parse_address(text)) == text
