"""FileSource: manifests on disk -> ClusterEvents.

Aspects: input formats (multi-document YAML, List, nested List, typed
lists, kubectl output, JSON); which Node is delivered; unknown kinds warn
once; malformed and missing files fail with one line naming file and line;
reload() delivers only differences, and keeps the previous state when a file
is broken mid-edit; watch() reloads on change.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from nftproxy.cluster.events import KIND_ENDPOINT_SLICES, KIND_SERVICES, Obj
from nftproxy.cluster.file import AmbiguousNode, FileSource, SourceError

EXAMPLE = Path(__file__).resolve().parents[1] / "nftproxy" / "examples" / "cluster.yaml"


class Recorder:
    """A ClusterEvents handler that records every call in order."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def on_service(self, previous: Obj | None, current: Obj | None) -> None:
        self.events.append(("service", _name(previous), _name(current)))

    def on_endpoint_slice(self, previous: Obj | None, current: Obj | None) -> None:
        self.events.append(("slice", _name(previous), _name(current)))

    def on_node(self, node: Obj | None) -> None:
        self.events.append(("node", _name(node)))

    def on_service_cidrs(self, cidrs: Sequence[Obj]) -> None:
        self.events.append(("cidrs", tuple(_name(c) for c in cidrs)))

    def on_synced(self, kind: str) -> None:
        self.events.append(("synced", kind))

    def take(self) -> list[tuple[Any, ...]]:
        events, self.events = self.events, []
        return events


class ObjRecorder(Recorder):
    """Also keeps the objects, for checks on their content."""

    def __init__(self) -> None:
        super().__init__()
        self.objects: list[tuple[Obj | None, Obj | None]] = []

    def on_service(self, previous: Obj | None, current: Obj | None) -> None:
        super().on_service(previous, current)
        self.objects.append((previous, current))


def _name(obj: Obj | None) -> str | None:
    if obj is None:
        return None
    meta = obj["metadata"]
    return f"{meta['namespace']}/{meta['name']}" if meta.get("namespace") else meta["name"]


def service(name: str, ip: str = "10.96.0.1", namespace: str = "ns") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"clusterIP": ip, "ports": [{"port": 80, "protocol": "TCP"}]},
    }


def eps(name: str, service_name: str, namespace: str = "ns") -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"kubernetes.io/service-name": service_name},
        },
        "addressType": "IPv4",
        "ports": [{"port": 8080, "protocol": "TCP"}],
        "endpoints": [{"addresses": ["10.244.0.5"], "conditions": {"ready": True}}],
    }


def node(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}


def service_cidr(name: str, *cidrs: str) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "ServiceCIDR",
        "metadata": {"name": name},
        "spec": {"cidrs": list(cidrs)},
    }


def write_docs(path: Path, *docs: Any) -> Path:
    path.write_text(yaml.safe_dump_all(docs))
    return path


def load(paths: Sequence[Path], **kw: Any) -> tuple[FileSource, Recorder]:
    recorder = Recorder()
    source = FileSource([str(p) for p in paths], recorder, **kw)
    source.load()
    return source, recorder


# -- formats --------------------------------------------------------------------------


def test_multi_document_yaml_delivers_in_the_documented_order(tmp_path: Path) -> None:
    path = write_docs(
        tmp_path / "c.yaml",
        eps("a-1", "a"),
        node("n1"),
        service("a"),
        service_cidr("kubernetes", "10.96.0.0/16"),
        service("b"),
    )
    source, rec = load([path], node_name="n1")
    assert rec.take() == [
        ("service", None, "ns/a"),
        ("service", None, "ns/b"),
        ("slice", None, "ns/a-1"),
        ("node", "n1"),
        ("cidrs", ("kubernetes",)),
        ("synced", KIND_SERVICES),
        ("synced", KIND_ENDPOINT_SLICES),
    ]
    assert source.chosen_node_name == "n1"


def test_list_and_nested_list(tmp_path: Path) -> None:
    inner = {"apiVersion": "v1", "kind": "List", "items": [service("b"), eps("b-1", "b")]}
    outer = {"apiVersion": "v1", "kind": "List", "items": [service("a"), inner]}
    _, rec = load([write_docs(tmp_path / "l.yaml", outer)])
    events = rec.take()
    assert ("service", None, "ns/a") in events
    assert ("service", None, "ns/b") in events
    assert ("slice", None, "ns/b-1") in events


def test_typed_list_items_inherit_their_kind(tmp_path: Path) -> None:
    items = [{k: v for k, v in service(n).items() if k != "kind"} for n in ("a", "b")]
    doc = {"apiVersion": "v1", "kind": "ServiceList", "items": items}
    _, rec = load([write_docs(tmp_path / "l.yaml", doc)])
    assert rec.take()[:2] == [("service", None, "ns/a"), ("service", None, "ns/b")]


def test_json_file(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"kind": "List", "items": [service("a"), node("n1")]}, indent=4))
    source, rec = load([path])
    assert rec.take()[:2] == [("service", None, "ns/a"), ("node", "n1")]
    assert source.chosen_node_name == "n1"


def test_kubectl_get_output(tmp_path: Path) -> None:
    """What `kubectl get svc,endpointslices -A -o yaml` prints."""
    path = tmp_path / "kubectl.yaml"
    path.write_text(
        """\
apiVersion: v1
items:
- apiVersion: v1
  kind: Service
  metadata:
    creationTimestamp: "2024-05-01T10:00:00Z"
    labels:
      component: apiserver
      provider: kubernetes
    name: kubernetes
    namespace: default
    resourceVersion: "196"
    uid: 0f7c6d1e-3f9a-4a2b-9a83-5d3c6b1e2f10
  spec:
    clusterIP: 10.96.0.1
    clusterIPs:
    - 10.96.0.1
    internalTrafficPolicy: Cluster
    ipFamilies:
    - IPv4
    ipFamilyPolicy: SingleStack
    ports:
    - name: https
      port: 443
      protocol: TCP
      targetPort: 6443
    sessionAffinity: None
    type: ClusterIP
  status:
    loadBalancer: {}
- addressType: IPv4
  apiVersion: discovery.k8s.io/v1
  endpoints:
  - addresses:
    - 172.18.0.2
    conditions:
      ready: true
      serving: true
      terminating: false
  kind: EndpointSlice
  metadata:
    creationTimestamp: "2024-05-01T10:00:00Z"
    generation: 1
    labels:
      kubernetes.io/service-name: kubernetes
    name: kubernetes
    namespace: default
    resourceVersion: "198"
    uid: 5a1e2f3b-7c8d-4e9f-a0b1-c2d3e4f5a6b7
  ports:
  - name: https
    port: 6443
    protocol: TCP
kind: List
metadata:
  resourceVersion: ""
"""
    )
    _, rec = load([path])
    assert rec.take()[:2] == [
        ("service", None, "default/kubernetes"),
        ("slice", None, "default/kubernetes"),
    ]


def test_the_embedded_example_loads(tmp_path: Path) -> None:
    source, rec = load([EXAMPLE])
    events = rec.take()
    services = [e[2] for e in events if e[0] == "service"]
    assert services == [f"demo/{n}" for n in sorted(
        ["web", "web-np", "web-local", "sticky", "dns", "empty"]
    )]
    assert ("node", "demo-node") in events
    assert ("cidrs", ("kubernetes",)) in events
    assert source.chosen_node_name == "demo-node"


def test_read_names_the_node_and_the_next_load_delivers_that_reading(tmp_path: Path) -> None:
    path = write_docs(tmp_path / "c.yaml", node("n1"), service("web"))
    recorder = Recorder()
    source = FileSource([str(path)], recorder)
    assert source.read() == "n1"
    assert recorder.take() == [], "read() delivers nothing"
    write_docs(path, node("n2"), service("api"))  # not read again by load()
    source.load()
    events = recorder.take()
    assert ("service", None, "ns/web") in events and ("node", "n1") in events
    assert source.reload(), "a later reload sees the edit"
    assert ("service", None, "ns/api") in recorder.take()


def test_several_files_and_a_missing_namespace_defaults(tmp_path: Path) -> None:
    svc = service("a")
    del svc["metadata"]["namespace"]
    a = write_docs(tmp_path / "a.yaml", svc)
    b = write_docs(tmp_path / "b.yaml", eps("a-1", "a", namespace="default"))
    recorder = ObjRecorder()
    FileSource([a, b], recorder).load()
    assert recorder.events[:2] == [("service", None, "default/a"), ("slice", None, "default/a-1")]
    delivered = recorder.objects[0][1]
    assert delivered is not None
    assert delivered["metadata"]["namespace"] == "default"


def test_empty_documents_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("---\n---\n" + yaml.safe_dump(service("a")) + "---\n")
    _, rec = load([path])
    assert rec.take()[0] == ("service", None, "ns/a")


# -- unknown kinds --------------------------------------------------------------------


def test_unknown_kinds_warn_once_each(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web-0", "namespace": "ns"}}
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg", "namespace": "ns"}}
    path = write_docs(tmp_path / "c.yaml", pod, cm, service("a"))
    with caplog.at_level(logging.WARNING, logger="nftproxy.cluster.file"):
        source, rec = load([path])
        os.utime(path, ns=(1, 1))
        source.reload()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len([w for w in warnings if "ignoring Pod web-0" in w]) == 1
    assert len([w for w in warnings if "ignoring ConfigMap cfg" in w]) == 1
    assert [e for e in rec.take() if e[0] == "service"] == [("service", None, "ns/a")]


def test_an_injected_logger_is_used(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ns"}}
    path = write_docs(tmp_path / "c.yaml", pod)
    with caplog.at_level(logging.WARNING, logger="custom"):
        FileSource([path], Recorder(), logger=logging.getLogger("custom")).load()
    assert [r.name for r in caplog.records] == ["custom"]


# -- errors ---------------------------------------------------------------------------


def test_malformed_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("kind: Service\nmetadata:\n  name: a\n  labels: {x: 1\nspec: {}\n")
    with pytest.raises(SourceError) as err:
        load([path])
    message = str(err.value)
    assert message.startswith(f"{path}:5:")
    assert "invalid YAML" in message
    assert "\n" not in message


def test_malformed_json_is_reported_through_the_yaml_parser(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{\n  "kind": "Service",\n  "metadata": {"name": "a"\n}\n')
    with pytest.raises(SourceError, match=rf"^{path}:\d+:\d+: invalid YAML"):
        load([path])


def test_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"nope\.yaml: no such file"):
        load([tmp_path / "nope.yaml"])


def test_a_scalar_document_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("just some text\n")
    with pytest.raises(SourceError, match="expected Kubernetes objects"):
        load([path])


def test_nothing_is_delivered_when_load_fails(tmp_path: Path) -> None:
    good = write_docs(tmp_path / "good.yaml", service("a"))
    rec = Recorder()
    with pytest.raises(SourceError):
        FileSource([good, tmp_path / "missing.yaml"], rec).load()
    assert rec.events == []


# -- node selection -------------------------------------------------------------------


def test_the_named_node_is_chosen(tmp_path: Path) -> None:
    path = write_docs(tmp_path / "c.yaml", node("n1"), node("n2"))
    source, rec = load([path], node_name="n2")
    assert ("node", "n2") in rec.take()
    assert source.chosen_node_name == "n2"


def test_a_named_node_that_is_absent_delivers_none(tmp_path: Path) -> None:
    path = write_docs(tmp_path / "c.yaml", node("n1"))
    source, rec = load([path], node_name="other")
    assert ("node", None) in rec.take()
    assert source.chosen_node_name == ""


def test_without_a_name_the_only_node_is_chosen(tmp_path: Path) -> None:
    source, rec = load([write_docs(tmp_path / "c.yaml", node("only"))])
    assert ("node", "only") in rec.take()
    assert source.chosen_node_name == "only"


def test_without_a_name_several_nodes_are_an_error_naming_them(tmp_path: Path) -> None:
    """Issue 36 case 3: choosing none made every endpoint remote, silently."""
    path = write_docs(tmp_path / "c.yaml", node("n1"), node("n2"))
    rec = Recorder()
    with pytest.raises(AmbiguousNode, match=r"2 Nodes \(n1, n2\).*--node-name"):
        FileSource([path], rec).load()
    assert rec.take() == []


# -- reload ---------------------------------------------------------------------------


def test_reload_delivers_adds_updates_and_deletes(tmp_path: Path) -> None:
    path = write_docs(
        tmp_path / "c.yaml", service("keep"), service("change"), service("drop"), eps("x-1", "x")
    )
    source, rec = load([path])
    rec.take()
    write_docs(
        path, service("keep"), service("change", ip="10.96.0.2"), service("new"), eps("x-1", "x")
    )
    assert source.reload() is True
    assert rec.take() == [
        ("service", "ns/change", "ns/change"),
        ("service", None, "ns/new"),
        ("service", "ns/drop", None),
    ]


def test_an_update_carries_the_old_and_the_new_object(tmp_path: Path) -> None:
    path = write_docs(tmp_path / "c.yaml", service("a"))
    recorder = ObjRecorder()
    source = FileSource([path], recorder)
    source.load()
    write_docs(path, service("a", ip="10.96.0.9"))
    source.reload()
    previous, current = recorder.objects[-1]
    assert previous is not None and current is not None
    assert (previous["spec"]["clusterIP"], current["spec"]["clusterIP"]) == (
        "10.96.0.1",
        "10.96.0.9",
    )


def test_reload_without_changes_delivers_nothing(tmp_path: Path) -> None:
    source, rec = load([write_docs(tmp_path / "c.yaml", service("a"), node("n"))])
    rec.take()
    assert source.reload() is False
    assert rec.take() == []


def test_reload_delivers_node_and_service_cidr_changes(tmp_path: Path) -> None:
    path = write_docs(tmp_path / "c.yaml", node("n1"), service_cidr("a", "10.96.0.0/16"))
    source, rec = load([path])
    rec.take()
    write_docs(path, service_cidr("a", "10.96.0.0/16"), service_cidr("b", "10.97.0.0/16"))
    assert source.reload() is True
    assert rec.take() == [("node", None), ("cidrs", ("a", "b"))]
    assert source.chosen_node_name == ""


def test_a_malformed_file_on_reload_keeps_the_previous_state(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_docs(tmp_path / "c.yaml", service("a"), service("b"))
    source, rec = load([path])
    rec.take()
    path.write_text("kind: Service\nmetadata: [\n")
    with caplog.at_level(logging.ERROR, logger="nftproxy.cluster.file"):
        assert source.reload() is False
    assert rec.take() == []
    assert any(f"{path}:" in r.getMessage() for r in caplog.records)
    # once fixed, the diff is against what was delivered before the breakage
    write_docs(path, service("a"))
    assert source.reload() is True
    assert rec.take() == [("service", "ns/b", None)]


def test_a_file_missing_on_reload_keeps_the_previous_state(tmp_path: Path) -> None:
    path = write_docs(tmp_path / "c.yaml", service("a"))
    source, rec = load([path])
    rec.take()
    path.unlink()
    assert source.reload() is False
    assert rec.take() == []


# -- watch ----------------------------------------------------------------------------


def test_watch_reloads_when_a_file_changes(tmp_path: Path) -> None:
    path = write_docs(tmp_path / "c.yaml", service("a"))
    rec = Recorder()
    source = FileSource([path], rec, poll_interval=0.01)
    source.load()
    rec.take()
    stop = threading.Event()
    thread = threading.Thread(target=source.watch, args=(stop,))
    thread.start()
    try:
        write_docs(path, service("a"), service("b"))
        deadline = time.monotonic() + 5
        while ("service", None, "ns/b") not in rec.events and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        thread.join(timeout=5)
    assert not thread.is_alive()
    assert ("service", None, "ns/b") in rec.events
