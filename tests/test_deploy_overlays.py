"""deploy/: the kustomize base and overlays, rendered; the resource requests.

Rendering uses `kubectl kustomize` (scripts/setup.sh installs Debian's
kubernetes-client where apt has it and no kubectl is there); a missing
kubectl fails these tests, it does not skip them.

Aspects: the base and every overlay render; each overlay is the base with
its component, each component's kustomization names only files that exist
and every file in its directory, and the components combine; no
kustomization uses a field kustomize deprecates, rendering prints no
deprecation warning (a check shown to catch `bases`), and the rendered
objects have no deprecated field, beta label or untyped hostPath; the
example overlay of deploy/README.md renders as printed, with the API
server address set and the image pinned by digest; rendered
built-in objects use only fields of their API schema (test_deploy.py's
check) and the PodMonitor is well-formed; the metrics overlay keeps the
base's args, serves /metrics on 0.0.0.0:10249 (as `nftproxy run` parses
its args), names that container port `metrics`, annotates the pods with
prometheus.io/scrape|port|path on that port, and its PodMonitor selects
exactly the DaemonSet's pods on that port; the memory requests are those
bench/RESULTS.md measured: the base's for 1,000 services x 10 endpoints, the
`large` overlay's for 10,000 x 10 (at least the peak RSS of a first start
or a restart, whichever is larger, at most 1.5 times it).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_deploy import _schema_problems, expanded_args, manifests

from nftproxy.tools import cli

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
OVERLAYS = sorted(p for p in (DEPLOY / "overlays").iterdir() if p.is_dir())
COMPONENTS = sorted(p for p in (DEPLOY / "components").iterdir() if p.is_dir())
KUSTOMIZATION = "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
RESULTS = ROOT / "bench" / "RESULTS.md"
TIMES = "\u00d7"  # the multiplication sign of RESULTS.md's cases (1000 x 10)

Doc = dict[str, Any]


def render(directory: Path) -> list[Doc]:
    return render_with_warnings(directory)[0]


def render_with_warnings(directory: Path) -> tuple[list[Doc], str]:
    """The rendered objects and what kustomize printed on stderr (its
    deprecation warnings)."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl not found: scripts/setup.sh installs it (Debian kubernetes-client)"
    done = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, f"kubectl kustomize {directory}: {done.stderr}"
    return [d for d in yaml.safe_load_all(done.stdout) if d], done.stderr


def overlay(tmp_path: Path, kustomization: str) -> Path:
    """A kustomization in `tmp_path` whose "DEPLOY/" prefixes point at deploy/
    (kustomize takes only relative paths)."""
    relative = os.path.relpath(DEPLOY, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(kustomization.replace("DEPLOY/", f"{relative}/"))
    return tmp_path


def one(docs: list[Doc], kind: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def container(docs: list[Doc]) -> Doc:
    main: Doc = one(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    return main


def memory_mib(quantity: str) -> float:
    match = re.fullmatch(r"(\d+)(Mi|Gi)", quantity)
    assert match, f"memory request {quantity!r} is not in Mi or Gi"
    return int(match[1]) * (1024 if match[2] == "Gi" else 1)


def peak_rss_mb(case: str) -> float:
    """The `peak RSS MB` column of bench/RESULTS.md's "Memory to request"
    table (the larger of a first start and a restart) for `case`."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in RESULTS.read_text().splitlines() if line.startswith("|")]
    header = next(r for r in rows if "restart peak MB" in r)
    row = next(r for r in rows if r[0] == case)
    return float(row[header.index("peak RSS MB")].replace(",", "").strip("*"))


# ---- rendering ------------------------------------------------------------------------


def test_the_base_renders_to_its_manifests() -> None:
    rendered = {(d["kind"], d["metadata"]["name"]) for d in render(DEPLOY / "base")}
    assert rendered == {(d["kind"], d["metadata"]["name"]) for d in manifests()}


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_every_overlay_renders_with_valid_objects(overlay: Path) -> None:
    docs = render(overlay)
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: checked below
        assert list(_schema_problems(doc, f"V1{doc['kind']}", doc["kind"])) == []
        assert doc["metadata"].get("namespace", "kube-system") == "kube-system"


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_overlays_are_the_base_with_their_component(overlay: Path) -> None:
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    assert kustomization["resources"] == ["../../base"]
    assert kustomization["components"] == [f"../../components/{overlay.name}"]
    assert {p.name for p in overlay.iterdir()} == {"kustomization.yaml"}


@pytest.mark.parametrize("component", COMPONENTS, ids=lambda p: p.name)
def test_component_kustomizations_name_exactly_their_files(component: Path) -> None:
    kustomization = yaml.safe_load((component / "kustomization.yaml").read_text())
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1alpha1"
    assert kustomization["kind"] == "Component"
    named = [*kustomization.get("resources", []),
             *(p["path"] for p in kustomization.get("patches", []) if "path" in p)]
    assert all((component / f).is_file() for f in named), named
    files = {p.name for p in component.glob("*.yaml")} - {"kustomization.yaml"}
    assert files == set(named)


def test_the_components_combine(tmp_path: Path) -> None:
    components = "".join(f"  - DEPLOY/components/{c.name}\n" for c in COMPONENTS)
    docs = render(overlay(tmp_path, KUSTOMIZATION + "resources:\n  - DEPLOY/base\n"
                          "components:\n" + components))
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted([*(d["kind"] for d in manifests()), "PodMonitor", "PrometheusRule"])
    main = container(docs)
    assert main["resources"]["requests"]["memory"] == "288Mi"  # large
    assert main["args"].count("--metrics-bind-address=0.0.0.0:10249") == 1  # metrics
    assert main["args"][:2] == container(manifests())["args"]


def readme_files(marker: str) -> dict[str, str]:
    """deploy/README.md's yaml blocks whose first line is `# <marker>/<file>`."""
    blocks = re.findall(r"```yaml\n(# (\S+)\n.*?)```", (DEPLOY / "README.md").read_text(), re.S)
    return {name.removeprefix(f"{marker}/"): text for text, name in blocks
            if name.startswith(f"{marker}/")}


def test_the_readme_overlay_renders_with_the_api_server_and_a_pinned_image(
    tmp_path: Path,
) -> None:
    files = readme_files("overlays/prod")
    assert set(files) == {"kustomization.yaml", "configmap-patch.yaml"}
    prod = tmp_path / "overlays" / "prod"
    prod.mkdir(parents=True)
    checkout = tmp_path / "nftproxy"
    checkout.symlink_to(ROOT)  # "../../nftproxy/deploy/base": a checkout of this repository
    for name, text in files.items():
        (prod / name).write_text(text)
    docs, warnings = render_with_warnings(prod)
    assert "deprecated" not in warnings.lower(), warnings
    data = one(docs, "ConfigMap")["data"]
    assert (data["kubernetes-service-host"], data["kubernetes-service-port"]) == (
        "192.0.2.10", "6443")
    assert "clusterCIDR: 10.42.0.0/16,fd00:42::/56" in data["config.conf"]
    assert re.fullmatch(r"REGISTRY/nftproxy@sha256:[0-9a-f]{64}", container(docs)["image"])
    assert {d["kind"] for d in docs} >= {"PodMonitor", "PrometheusRule"}


# ---- deprecated fields -------------------------------------------------------------------

DEPRECATED_KUSTOMIZE = {"bases", "patchesStrategicMerge", "patchesJson6902", "commonLabels",
                        "vars", "imageTags"}
"""Kustomization fields kustomize v5 deprecates (`kustomize edit fix` rewrites them)."""

DEPRECATED_POD = {"serviceAccount"}  # the alias of serviceAccountName
DEPRECATED_ANNOTATIONS = ("scheduler.alpha.kubernetes.io/", "seccomp.security.alpha.kubernetes.io/",
                          "container.apparmor.security.beta.kubernetes.io/")
DEPRECATED_LABELS = ("beta.kubernetes.io/",)


def kustomizations() -> list[Path]:
    return sorted(DEPLOY.rglob("kustomization.yaml"))


@pytest.mark.parametrize("path", kustomizations(), ids=lambda p: str(p.parent.relative_to(DEPLOY)))
def test_kustomizations_use_no_deprecated_field(path: Path) -> None:
    assert DEPRECATED_KUSTOMIZE.isdisjoint(yaml.safe_load(path.read_text()))


def test_rendering_warns_of_nothing_and_renders_no_deprecated_field(tmp_path: Path) -> None:
    components = "".join(f"  - DEPLOY/components/{c.name}\n" for c in COMPONENTS)
    combined = overlay(tmp_path, KUSTOMIZATION + "resources:\n  - DEPLOY/base\n"
                       "components:\n" + components)
    for directory in (DEPLOY / "base", *OVERLAYS, combined):
        docs, warnings = render_with_warnings(directory)
        assert "deprecated" not in warnings.lower(), (directory, warnings)
        for doc in docs:
            assert not doc["apiVersion"].endswith(("v1beta1", "v1alpha1")), doc["kind"]
            template = doc.get("spec", {}).get("template", {})
            for meta in (doc["metadata"], template.get("metadata", {})):
                keys = [*meta.get("annotations", {}), *meta.get("labels", {})]
                assert not [k for k in keys if k.startswith(DEPRECATED_ANNOTATIONS)], keys
            spec = template.get("spec", {})
            assert DEPRECATED_POD.isdisjoint(spec), doc["kind"]
            selector = spec.get("nodeSelector", {})
            assert not [k for k in selector if k.startswith(DEPRECATED_LABELS)], selector
            for volume in spec.get("volumes", []):
                if "hostPath" in volume:  # an untyped hostPath mounts whatever is there
                    assert volume["hostPath"].get("type"), volume


def test_the_deprecated_field_check_catches_the_old_syntax(tmp_path: Path) -> None:
    old = overlay(tmp_path, KUSTOMIZATION + "bases:\n  - DEPLOY/base\n")
    warnings = render_with_warnings(old)[1]
    assert "deprecated" in warnings.lower()


# ---- the metrics overlay -----------------------------------------------------------------


def test_metrics_overlay_serves_metrics_on_every_address_and_keeps_the_base_args() -> None:
    docs = render(DEPLOY / "overlays" / "metrics")
    main = container(docs)
    base_args = container(manifests())["args"]
    assert main["args"][: len(base_args)] == base_args
    args = cli.build_parser().parse_args(["run", *expanded_args(main)])
    assert args.metrics_bind_address == "0.0.0.0:10249"
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert ports["metrics"] == 10249 and ports["healthz"] == 10256
    annotations = one(docs, "DaemonSet")["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(ports["metrics"]),
        "prometheus.io/path": "/metrics",
    }


def test_metrics_overlay_pod_monitor_selects_the_daemonsets_metrics_port() -> None:
    docs = render(DEPLOY / "overlays" / "metrics")
    monitor, ds = one(docs, "PodMonitor"), one(docs, "DaemonSet")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    spec = monitor["spec"]
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert spec["namespaceSelector"]["matchNames"] == [ds["metadata"]["namespace"]]
    (endpoint,) = spec["podMetricsEndpoints"]
    assert endpoint["port"] in {p["name"] for p in container(docs)["ports"]}
    assert endpoint["path"] == "/metrics"
    assert set(spec) <= {"selector", "namespaceSelector", "podMetricsEndpoints", "jobLabel"}


def test_the_base_keeps_kube_proxys_loopback_metrics_address() -> None:
    args = cli.build_parser().parse_args(["run", *expanded_args(container(manifests()))])
    assert args.metrics_bind_address is None  # the ConfigMap's 127.0.0.1:10249
    configmap = next(d for d in manifests() if d["kind"] == "ConfigMap")
    assert "metricsBindAddress: 127.0.0.1:10249" in configmap["data"]["config.conf"]


# ---- resources -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("directory", "case"),
    [(DEPLOY / "base", f"1000{TIMES}10 product"),
     (DEPLOY / "overlays" / "large", f"10000{TIMES}10 product")],
    ids=["base-1k", "large-10k"],
)
def test_memory_requests_match_the_measured_peak(directory: Path, case: str) -> None:
    resources = container(render(directory))["resources"]
    assert "limits" not in resources  # deploy/README.md, "Resources"
    request = memory_mib(resources["requests"]["memory"])
    peak = peak_rss_mb(case)
    assert peak <= request <= 1.5 * peak, (case, request, peak)
