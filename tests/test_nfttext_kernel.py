"""In the kernel, a sync printed in nft's syntax makes what the same sync printed in JSON makes.

Aspects (core/nft/nfttext.py, core/nft/jsontext.py, kernel/libnftables.py):
the same Proxier history -- a full sync of the example cluster and of the
proxier tests' sample (affinity, source ranges, eTP=Local, UDP,
dual-stack), then partial syncs that add, change and delete -- in two
namespaces, one backend printing nft syntax and one printing JSON, leaves
listings equal object for object, comments and rule order included; a
first start in chunks too. The JSON printer needs libnftables 1.1.x: on
1.0.6 these check that the backend refuses it at start, and the trixie
stage compares. Also: a refused transaction is sent once and raises its
typed error; and `sync` refuses a table name nft's syntax cannot say, as a
config error (nft's syntax is the printer on 1.0.6).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import kernel
import pytest
from feed import intake
from k8s import endpoint_slice, service
from test_proxier_kernel import fed, sample

from nftproxy.agent.proxier import Proxier
from nftproxy.core.config import ProxyConfig
from nftproxy.core.nft.commands import AddTable, DeleteChain, Where
from nftproxy.core.nft.errors import NftNotFound
from nftproxy.kernel.libnftables import NftBackend
from nftproxy.kernel.netns import run_in
from nftproxy.tools import cli
from nftproxy.tools.dry_run import proxier_from_files

EXAMPLE = "nftproxy/examples/cluster.yaml"


def ruleset(ns: str) -> list[dict[str, Any]]:
    """`nft -j list ruleset`, in order, without handles, and without the
    comments of sets and maps: libnftables' JSON parser drops them (1.0.6
    and 1.1.3), so only nft's syntax programs them (`_set_comments`)."""
    items = json.loads(kernel.nft(ns, "-j", "list", "ruleset"))["nftables"]
    out = []
    for item in items:
        for kind, body in item.items():
            if isinstance(body, dict):
                drop = {"handle", "comment"} if kind in ("set", "map") else {"handle"}
                body = {k: v for k, v in body.items() if k not in drop}
            out.append({kind: body})
    return out


def _set_comments(ns: str) -> list[str]:
    items = json.loads(kernel.nft(ns, "-j", "list", "ruleset"))["nftables"]
    return [str(body["comment"]) for item in items for kind, body in item.items()
            if kind in ("set", "map") and "comment" in body]


@pytest.fixture
def pair() -> Iterator[tuple[tuple[str, NftBackend], tuple[str, NftBackend]] | None]:
    """(namespace, backend) printing nft syntax, and one printing JSON; None
    where libnftables takes no JSON printer (1.0.6, checked by json_backend):
    the trixie stage (scripts/test-userspaces.sh) compares the two."""
    with (
        kernel.fresh_netns() as ns_text,
        kernel.fresh_netns() as ns_json,
        NftBackend(netns=ns_text) as text,
        kernel.json_backend(ns_json) as json_only,
    ):
        yield None if json_only is None else ((ns_text, text), (ns_json, json_only))


Pair = tuple[tuple[str, NftBackend], tuple[str, NftBackend]] | None


def test_the_example_cluster_programs_the_same_tables(pair: Pair) -> None:
    if pair is None:
        return  # 1.0.6: the JSON printer was refused at start (the fixture checked)
    (ns_text, text), (ns_json, json_only) = pair
    config = ProxyConfig(node_name="", table_name="nftproxy")
    for backend in (text, json_only):
        assert proxier_from_files([EXAMPLE], config, backend).sync().full
    programmed = ruleset(ns_text)
    assert len(programmed) > 100 and "KUBE-SVC-" in json.dumps(programmed)
    assert programmed == ruleset(ns_json)
    assert "ClusterIP, ExternalIP and LoadBalancer IP traffic" in _set_comments(ns_text)
    assert _set_comments(ns_json) == []


def _history(proxier: Proxier) -> Iterator[None]:
    """Partial syncs: add a service, change an affinity port's endpoints,
    delete a service."""
    objects = sample()
    extra_svc = service("extra", "10.96.0.40", ports=[("http", 80, "TCP"), ("dns", 53, "UDP")])
    extra_eps = endpoint_slice("extra", ["10.244.0.21", "10.244.2.22"])
    intake(proxier).on_service(None, extra_svc)
    intake(proxier).on_endpoint_slice(None, extra_eps)
    yield
    sticky = endpoint_slice("sticky", ["10.244.0.11", "10.244.0.13", "10.244.3.14"])
    intake(proxier).on_endpoint_slice(objects["eps/sticky"], sticky)
    yield
    intake(proxier).on_service(objects["svc/lb"], None)
    intake(proxier).on_endpoint_slice(objects["eps/lb"], None)
    yield


def test_a_history_of_partial_syncs_programs_the_same_tables(pair: Pair) -> None:
    if pair is None:
        return  # 1.0.6: the JSON printer was refused at start (the fixture checked)
    (ns_text, text), (ns_json, json_only) = pair
    proxiers = [fed(text, sample()), fed(json_only, sample())]
    for p in proxiers:
        assert p.sync().full
    assert ruleset(ns_text) == ruleset(ns_json)
    for _ in zip(*map(_history, proxiers), strict=True):
        reports = [p.sync() for p in proxiers]
        assert not any(r.full for r in reports) and reports[0].ops == reports[1].ops > 0
        assert ruleset(ns_text) == ruleset(ns_json)


def test_a_first_start_in_chunks_programs_the_same_tables(pair: Pair) -> None:
    if pair is None:
        return  # 1.0.6: the JSON printer was refused at start (the fixture checked)
    (ns_text, text), (ns_json, json_only) = pair
    objects = {}
    for i in range(40):
        affinity = 60 if i % 7 else None
        objects[f"svc/s{i}"] = service(f"s{i}", f"10.96.1.{i}", affinity_timeout=affinity)
        objects[f"eps/s{i}"] = endpoint_slice(f"s{i}", [f"10.244.0.{i}", f"10.244.1.{i}"])
    for backend in (text, json_only):
        assert fed(backend, objects, fresh_chunk=10).sync().full
    assert ruleset(ns_text) == ruleset(ns_json)


def test_a_refused_transaction_is_sent_once_and_raises_its_typed_error(netns: str) -> None:
    """A refusal in nft syntax is typed by its errno text: no second attempt
    in the other syntax (table names nft's syntax cannot say are refused at
    start-up: test_sync_refuses_a_table_name_...)."""
    where = Where("ip", "t")
    with NftBackend(netns=netns) as backend:
        backend.commit([AddTable(where)])
        sent: list[str] = []
        send = backend._send

        def counted(text: str, *, fresh: bool) -> tuple[int, str]:
            sent.append(text)
            return send(text, fresh=fresh)

        backend._send = counted  # type: ignore[method-assign]
        with pytest.raises(NftNotFound):
            backend.commit([DeleteChain(where, "gone")])
    assert len(sent) == 1 and not sent[0].startswith("{"), sent


@pytest.mark.parametrize(
    ("name", "sayable"),
    [("nftproxy", True), ("kube-proxy", True), ("filter", True), ("mark", False), ("ip", False)],
)
def test_nft_syntax_says_every_table_name_but_its_keywords(
    netns: str, name: str, sayable: bool
) -> None:
    with NftBackend(netns=netns) as backend:
        assert backend.parses_table_name(name) is sayable
    assert kernel.nft(netns, "list", "tables") == "", "a dry run programs nothing"


def test_sync_refuses_a_table_name_nft_syntax_cannot_say(
    netns: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sync", "--source", EXAMPLE, "--table-name", "mark"]
    assert run_in(netns, cli.main, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("nftproxy: config: tableName 'mark' is a word of nft's own syntax")
    assert kernel.nft(netns, "list", "tables") == ""
