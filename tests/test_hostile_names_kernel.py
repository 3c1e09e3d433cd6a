"""Hostile strings never reach the kernel unchecked, through either printer (real kernel).

Aspects: a Service whose namespace, name or port name holds quotes,
backslashes, braces, semicolons, newlines, non-ASCII or an ANSI escape --
beside a well-formed one -- is either refused at intake with a Problem that
names the object and the field (and programs nothing), or programmed with
its name in comments that list back: `nft list ruleset | nft -c -f -`
accepts the listing. The same for a backend that prints nft's syntax and,
on libnftables 1.1.x, one that prints JSON; the well-formed Service is
programmed by both.
"""

from __future__ import annotations

from collections.abc import Iterator

import kernel
import pytest
from feed import intake
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from k8s import endpoint_slice, node, service

from nftproxy.agent.intake import InvalidField
from nftproxy.agent.proxier import Proxier
from nftproxy.cluster.events import KIND_ENDPOINT_SLICES, KIND_SERVICES
from nftproxy.core.config import ProxyConfig
from nftproxy.kernel.libnftables import NftBackend

CONFIG = ProxyConfig(node_name="node-a", cluster_cidrs=("10.244.0.0/16",))
HOSTILE = st.lists(
    st.sampled_from(['"', "'", "\\", "{", "}", ";", "\n", "é", "\u2028", "\x1b[31m",
                     "a", "b", "-", ".", ":", "/", " ", "#", "$"]),
    min_size=1, max_size=12,
).map("".join)
FIELDS = ("namespace", "name", "port name")


@pytest.fixture(scope="module")
def backends() -> Iterator[list[tuple[str, NftBackend]]]:
    """A backend printing nft syntax, and one printing JSON where
    libnftables takes it (1.1.x; on 1.0.6 its refusal to start is checked)."""
    with (
        kernel.fresh_netns() as ns_text,
        kernel.fresh_netns() as ns_json,
        NftBackend(netns=ns_text) as text,
        kernel.json_backend(ns_json) as json_only,
    ):
        yield [(ns_text, text)] + ([] if json_only is None else [(ns_json, json_only)])


def _sync(backend: NftBackend, field: str, hostile: str) -> list[InvalidField]:
    ns, name, port = {"namespace": (hostile, "web", "http"), "name": ("ns", hostile, "http"),
                      "port name": ("ns", "web", hostile)}[field]
    problems: list[InvalidField] = []
    proxier = Proxier(CONFIG, backend)
    events = intake(proxier, problems=problems)
    events.on_node(node("node-a", ["192.168.50.1"], pod_cidrs=["10.244.0.0/24"]))
    events.on_service(None, service("good", "10.96.0.9", ns="good"))
    events.on_endpoint_slice(None, endpoint_slice("good", ["10.244.0.9"], ns="good"))
    events.on_service(None, service(name, "10.96.0.10", ns=ns, ports=[(port, 80, "TCP")]))
    events.on_endpoint_slice(None, endpoint_slice(
        name, ["10.244.0.11"], ns=ns, name="web-1", ports=[(port, 80, "TCP")]))
    events.on_synced(KIND_SERVICES)
    events.on_synced(KIND_ENDPOINT_SLICES)
    assert proxier.sync().full
    return problems


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), hostile=HOSTILE)
def test_a_hostile_name_is_refused_or_lists_back(
    backends: list[tuple[str, NftBackend]], field: str, hostile: str
) -> None:
    for ns, backend in backends:
        problems = _sync(backend, field, hostile)
        listed = kernel.nft(ns, "list", "ruleset")
        assert "good/good:http" in listed
        if problems:
            assert all(p.problem.field and p.name for p in problems), problems
            assert "10.96.0.10" not in listed
        else:
            assert "10.96.0.10" in listed
        kernel.nft(ns, "-c", "-f", "-", stdin=listed)
