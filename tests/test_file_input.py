"""File input taken as the API server would take it (tracker issue 36).

Aspects:
- names are checked as the API server checks them (namespace: DNS-1123
  label; Service: DNS-1035 label; EndpointSlice, Node: DNS-1123 subdomain;
  port names: DNS-1123 labels), an invalid Service or port skipped with a
  Problem naming the object and the field, the rest kept;
- through the file source, two distinct service ports never share a
  KUBE-SVC hash: its input "ns/name[:port]" + protocol decodes back to the
  one service port for every name the checks let through, and the
  `a/b:c` vs `a/b` port `c` pair is refused;
- a reload that would take every Service away (an emptied, truncated or
  null file) keeps the previous state with one WARNING, unless allow_empty;
  one that takes some away says how many;
- several Nodes and no node name: an error naming them, in the source and
  as `sync`'s configuration error (exit 2);
- problems print escaped: a name's newline or ESC never reaches a terminal raw.
"""

from __future__ import annotations

import base64
import hashlib
import logging
from pathlib import Path
from typing import Any

import k8s
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from nftproxy.cluster.events import Obj
from nftproxy.cluster.file import FileSource
from nftproxy.cluster.recorder import Recorder
from nftproxy.core import convert
from nftproxy.core.config import ProxyConfig
from nftproxy.core.convert import Problem
from nftproxy.core.model import IPFamily, L4Protocol, ServicePortName
from nftproxy.core.rules import names
from nftproxy.kernel.fake import FakeBackend
from nftproxy.tools import cli
from nftproxy.tools.dry_run import files_input

# -- builders -------------------------------------------------------------------------


def service(
    name: str,
    namespace: str = "a",
    *,
    ports: tuple[tuple[str, int], ...] = (("", 80),),
    ip: str = "10.96.0.1",
) -> dict[str, Any]:
    """A TCP Service in namespace `a` (k8s.service) with `ports` (name, port)."""
    return k8s.service(name, ip, ns=namespace, ports=[(n, p, "TCP") for n, p in ports])


def endpoint_slice(name: str, service_name: str, namespace: str = "a", port: str = "") -> Obj:
    """One ready endpoint on port 8080 named `port` (k8s.endpoint_slice)."""
    return k8s.endpoint_slice(service_name, [{"ip": "10.244.0.5", "ready": True}], ns=namespace,
                              name=name, ports=((port, 8080, "TCP"),))


def node(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}


def write(path: Path, *docs: Any) -> Path:
    path.write_text(yaml.safe_dump_all(docs))
    return path


def programmed(path: Path, caplog: pytest.LogCaptureFixture) -> set[ServicePortName]:
    """The service ports a sync of `path` would program (IPv4)."""
    log = logging.getLogger("test.file_input")
    with caplog.at_level(logging.WARNING, logger="test.file_input"):
        proxier, _ = files_input([str(path)], ProxyConfig(), FakeBackend(), log=log)
    state = proxier.plan_full().input.families[IPFamily.IPV4].state
    return set(state.services)


# -- names checked as the API server checks them ------------------------------------


def test_a_service_named_like_another_ones_port_is_refused_not_merged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 36 case 4: Service `b:c` in `a` and Service `b` port `c` hashed
    alike, and both VIPs went to one service's endpoints."""
    path = write(
        tmp_path / "c.yaml",
        service("b:c", ip="10.96.0.1"),
        service("b", ports=(("c", 80),), ip="10.96.0.2"),
    )
    assert programmed(path, caplog) == {ServicePortName("a", "b", "c", L4Protocol.TCP)}
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "Service a/b:c: metadata.name: 'b:c' is not a DNS-1035 label" in warning


BAD_NAMES = ["b:c", "web{", 'we"b', "web\nx", "we\x1b[31mb", "Web", "-web", "a" * 64]


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_an_invalid_service_name_or_namespace_skips_the_service(bad: str) -> None:
    cases = ((service(bad), "metadata.name"), (service("web", bad), "metadata.namespace"))
    for obj, field in cases:
        ports, problems = convert.service_ports(obj, IPFamily.IPV4)
        assert ports == {}
        assert [p.field for p in problems] == [field]


@pytest.mark.parametrize("bad", [*BAD_NAMES[:5], "p_1", "a" * 64])
def test_an_invalid_port_name_skips_that_port_only(bad: str) -> None:
    ports, problems = convert.service_ports(
        service("web", ports=((bad, 80), ("http", 81))), IPFamily.IPV4
    )
    assert [spn.port for spn in ports] == ["http"]
    assert [p.field for p in problems] == ["spec.ports[0].name"]


def test_port_names_the_api_server_accepts_are_kept() -> None:
    """Service port names are DNS-1123 labels (core/v1 validateServicePort),
    not the 15-character IANA_SVC_NAMEs of container ports."""
    long_name, digits = "metrics-port-for-prometheus", "8080"
    ports, problems = convert.service_ports(
        service("web", ports=((long_name, 80), (digits, 81))), IPFamily.IPV4
    )
    assert problems == [] and {spn.port for spn in ports} == {long_name, digits}


@pytest.mark.parametrize(
    ("obj", "field"),
    [
        (endpoint_slice("web{x}", "web"), "metadata.name"),
        (endpoint_slice("web-1", "web", namespace="a/b"), "metadata.namespace"),
        (endpoint_slice("web-1", "web", port="c:d"), "ports[0].name"),
    ],
)
def test_invalid_endpoint_slice_names_are_problems(obj: Obj, field: str) -> None:
    info, problems = convert.slice_info(obj, "n1")
    assert [p.field for p in problems] == [field]
    if field == "ports[0].name":
        assert info is not None and info.ports == {}
    else:
        assert info is None


def test_endpoint_slice_names_may_be_dns_subdomains() -> None:
    info, problems = convert.slice_info(endpoint_slice("web-abc.1", "web"), "n1")
    assert problems == [] and info is not None and info.slice_name == "web-abc.1"


def test_an_invalid_node_name_is_a_problem_and_no_node() -> None:
    info, problems = convert.node_info(node("node\n1"))
    assert info is None
    assert [p.field for p in problems] == ["metadata.name"]
    assert convert.node_info(node("node-1.example.com"))[0] is not None


def test_a_problem_prints_control_characters_escaped() -> None:
    problem = Problem("Service", "a/we\nb\x1b[31m", "metadata.name", "bad")
    assert str(problem) == "Service a/we\\nb\\x1b[31m: metadata.name: bad"


# -- the KUBE-SVC hash input is injective for the names the file source lets through --

_LABEL = st.from_regex(r"\A[a-z0-9]([-a-z0-9]{0,10}[a-z0-9])?\Z")
_SERVICE_NAME = st.from_regex(r"\A[a-z]([-a-z0-9]{0,10}[a-z0-9])?\Z")
_PORT_NAME = st.one_of(st.just(""), _LABEL)
_PROTOCOL = st.sampled_from(list(L4Protocol))


def _hash_input(spn: ServicePortName) -> str:
    """What names.service_hash hashes (pinned against it in the test)."""
    return str(spn) + spn.protocol.nft


def _decode(text: str) -> ServicePortName:
    """The one service port whose hash input `text` is: the protocol by its
    last 3 characters ("tcp", "udp", "ctp" of sctp), the namespace up to the
    first '/', the name up to the first ':' -- valid names hold neither."""
    protocol = {"tcp": L4Protocol.TCP, "udp": L4Protocol.UDP, "ctp": L4Protocol.SCTP}[text[-3:]]
    rest = text[: -len(protocol.nft)]
    namespace, _, name_port = rest.partition("/")
    name, _, port = name_port.partition(":")
    return ServicePortName(namespace, name, port, protocol)


@settings(max_examples=300, deadline=None)
@given(namespace=_LABEL, name=_SERVICE_NAME, port=_PORT_NAME, protocol=_PROTOCOL)
def test_the_kube_svc_hash_input_decodes_back_for_every_valid_name(
    namespace: str, name: str, port: str, protocol: L4Protocol
) -> None:
    obj = service(name, namespace, ports=((port, 80),))
    obj["spec"]["ports"][0]["protocol"] = protocol.value
    ports, problems = convert.service_ports(obj, IPFamily.IPV4)
    assert problems == []
    (spn,) = ports
    text = _hash_input(spn)
    digest = base64.b32encode(hashlib.sha256(text.encode()).digest()).decode()[:16]
    assert names.service_hash(spn) == digest
    assert _decode(text) == spn  # so no other service port has this input


@settings(max_examples=200, deadline=None)
@given(
    namespace=st.text(alphabet="ab/:", min_size=1, max_size=4),
    name=st.text(alphabet="ab/:", min_size=1, max_size=4),
    port=st.text(alphabet="ab/:", max_size=3),
)
def test_names_whose_hash_input_would_not_decode_are_refused(
    namespace: str, name: str, port: str
) -> None:
    spn = ServicePortName(namespace, name, port, L4Protocol.TCP)
    ports, _ = convert.service_ports(service(name, namespace, ports=((port, 80),)), IPFamily.IPV4)
    if _decode(_hash_input(spn)) != spn:
        assert ports == {}


# -- an empty source never empties silently -------------------------------------------


def _loaded(path: Path, **kw: Any) -> tuple[FileSource, Recorder]:
    recorder = Recorder()
    source = FileSource([path], recorder, **kw)
    source.load()
    return source, recorder


@pytest.mark.parametrize("empty", ["", "---\n", "null\n", "kind: List\nitems: []\n"])
def test_a_reload_without_any_service_keeps_the_previous_state(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, empty: str
) -> None:
    """Issue 36 case 2: `: > FILE` removed every rule within 3 s, silently."""
    path = write(tmp_path / "c.yaml", service("web"), service("api", ip="10.96.0.2"))
    source, recorder = _loaded(path)
    path.write_text(empty)
    with caplog.at_level(logging.WARNING, logger="nftproxy.cluster.file"):
        assert source.reload() is False
    assert set(recorder.snapshot().services) == {("a", "web"), ("a", "api")}
    (warning,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "no Service left (2 were delivered); keeping the previous state" in warning.message
    assert "--allow-empty" in warning.message
    write(path, service("web"))  # the next good edit is diffed against what was delivered
    assert source.reload() is True
    assert set(recorder.snapshot().services) == {("a", "web")}


def test_allow_empty_lets_an_empty_source_remove_every_service(tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", service("web"))
    source, recorder = _loaded(path, allow_empty=True)
    path.write_text("")
    assert source.reload() is True
    assert recorder.snapshot().services == {}


def test_a_reload_that_removes_some_services_says_how_many(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 36 case 2: a file cut in half deleted 4 services without a word."""
    path = write(tmp_path / "c.yaml", *(service(f"s{i}", ip=f"10.96.0.{i + 1}") for i in range(6)))
    source, _ = _loaded(path)
    write(path, *(service(f"s{i}", ip=f"10.96.0.{i + 1}") for i in range(2)))
    with caplog.at_level(logging.INFO, logger="nftproxy.cluster.file"):
        assert source.reload() is True
    assert "4 of 6 Services left the source files" in caplog.text


def test_the_service_count_of_a_reading(tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", service("web"), node("n1"))
    source = FileSource([path], Recorder())
    assert source.read() == "n1" and source.service_count == 1
    path.write_text("")
    assert FileSource([path], Recorder()).service_count == 0


# -- several Nodes and no node name ---------------------------------------------------


def test_sync_with_several_nodes_and_no_node_name_is_a_configuration_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 36 case 3: `sync` exited 0 and every endpoint counted as remote."""
    monkeypatch.delenv("NODE_NAME", raising=False)
    path = write(tmp_path / "c.yaml", service("web"), node("n1"), node("n2"))
    assert cli.main(["sync", "--dry-run", "--source", str(path)]) == 2
    err = capsys.readouterr().err
    assert "nftproxy: config:" in err and "2 Nodes (n1, n2)" in err and "--node-name" in err
    assert cli.main(["sync", "--dry-run", "--source", str(path), "--node-name", "n2"]) == 0


def test_run_with_several_nodes_and_no_node_name_is_a_configuration_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    monkeypatch.setattr("os.geteuid", lambda: 0)  # refused before any table is touched:

    def no_kernel(*args: object, **kwargs: object) -> None:
        pytest.fail("`run` went on to the kernel of the host")

    for edge in ("NftBackend", "Agent", "tune_malloc", "HostFS"):
        monkeypatch.setattr(cli, edge, no_kernel)  # were it not, these would touch the host
    path = write(tmp_path / "c.yaml", service("web"), node("n1"), node("n2"))
    assert cli.main(["run", "--source", str(path)]) == 2
    assert "2 Nodes (n1, n2)" in capsys.readouterr().err
