"""The deployment assets in deploy/: image, kustomize base, cleanup script.

Aspects: every manifest parses and uses only fields of its kind's API schema
(the installed kubernetes client's models); the kustomization lists exactly
the manifests there are; every reference resolves (service account, role
binding, ConfigMap keys, env vars in args); the API server address is a
required ConfigMap setting with a placeholder that cannot work; the only
hostPath is typed; the ClusterRole grants exactly
nftproxy.cluster.kube.API_CALLS; the mounted KubeProxyConfiguration loads
with nftproxy's own loader without a warning; the probes use its healthz
port; the container args are `nftproxy run` flags; the DaemonSet has what a
node's service proxy needs; the Dockerfile installs through scripts/setup.sh
(the install steps exist once) and its entrypoint is `nftproxy run`; the
kube-proxy cleanup script removes kube-proxy's iptables chains and nftables
tables and nothing else (kernel test, in a throwaway namespace).
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client import models as k8s_models

from nftproxy.cluster.kube import api_calls
from nftproxy.core.address import parse_address
from nftproxy.kernel import netns as _netns
from nftproxy.tools import cli
from nftproxy.tools.config_load import build_config, load_config_file

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
BASE = DEPLOY / "base"
DOCKERFILE = DEPLOY / "Dockerfile"
CLEANUP = DEPLOY / "cleanup-kube-proxy.sh"
LABEL_GATE = ("nftproxy.io/enabled", "true")
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
"""A $(VAR) reference in container args, which the kubelet expands."""

Doc = dict[str, Any]


# ---- reading the manifests ------------------------------------------------------------


def manifest_files() -> list[Path]:
    return sorted(p for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml")


def kustomization() -> Doc:
    doc: Doc = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    return doc


def manifests() -> list[Doc]:
    return [doc for path in manifest_files() for doc in yaml.safe_load_all(path.read_text())]


def one(kind: str) -> Doc:
    found = [doc for doc in manifests() if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def pod_spec() -> Doc:
    spec: Doc = one("DaemonSet")["spec"]["template"]["spec"]
    return spec


def container() -> Doc:
    containers = pod_spec()["containers"]
    assert len(containers) == 1
    main: Doc = containers[0]
    return main


def config_text() -> str:
    """The KubeProxyConfiguration the DaemonSet mounts and passes with --config."""
    volume_name, path = _config_volume_and_path()
    volume = next(v for v in pod_spec()["volumes"] if v["name"] == volume_name)
    source = volume["configMap"]
    key = next(i["key"] for i in source["items"] if i["path"] == path)
    configmap = one("ConfigMap")
    assert configmap["metadata"]["name"] == source["name"]
    assert key in configmap["data"], f"ConfigMap {source['name']} has no key {key!r}"
    text: str = configmap["data"][key]
    return text


def _config_volume_and_path() -> tuple[str, str]:
    """(volume name, path inside the volume) of the file --config names."""
    config_flag = run_args(container()).config
    assert config_flag, "the container must pass --config"
    for mount in container()["volumeMounts"]:
        prefix = mount["mountPath"].rstrip("/") + "/"
        if config_flag.startswith(prefix):
            return mount["name"], config_flag[len(prefix) :]
    raise AssertionError(f"--config {config_flag} is not inside any volume mount")


def expanded_args(main: Doc, *, node_name: str = "node-1") -> list[str]:
    """The container's args with $(VAR) expanded as the kubelet does, using
    `node_name` for the downward-API values; every VAR must be defined."""
    env = {}
    for var in main.get("env", []):
        source = var.get("valueFrom", {})
        if "value" in var:
            env[var["name"]] = var["value"]
        elif source.get("fieldRef", {}).get("fieldPath") == "spec.nodeName":
            env[var["name"]] = node_name
    args: list[str] = []
    for arg in main.get("args", []):
        for name in VAR_REF.findall(arg):
            assert name in env, f"arg {arg!r} uses $({name}), which the container does not define"
        args.append(VAR_REF.sub(lambda m: env[m.group(1)], arg))
    return args


def run_args(main: Doc) -> Any:
    """The container's args parsed as `nftproxy run` would parse them."""
    args, unknown = cli.build_parser().parse_known_args(["run", *expanded_args(main)])
    assert unknown == [], f"not flags of `nftproxy run`: {unknown}"
    return args


def run_option_strings() -> set[str]:
    parser = cli.build_parser()
    for action in parser._actions:  # argparse has no public accessor for subparsers
        choices = getattr(action, "choices", None)
        if isinstance(choices, Mapping) and "run" in choices:
            return {o for a in choices["run"]._actions for o in a.option_strings}
    raise AssertionError("`nftproxy run` not found in the parser")


# ---- the manifests ----------------------------------------------------------------------


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_every_manifest_parses(path: Path) -> None:
    docs = list(yaml.safe_load_all(path.read_text()))
    assert docs
    for doc in docs:
        assert isinstance(doc, dict)
        assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"]


def test_kustomization_lists_every_manifest_and_only_existing_files() -> None:
    resources = kustomization()["resources"]
    assert len(resources) == len(set(resources)), "a resource is listed twice"
    missing = [r for r in resources if not (BASE / r).is_file()]
    assert missing == [], f"listed but missing: {missing}"
    unlisted = sorted({p.name for p in manifest_files()} - set(resources))
    assert unlisted == [], f"in deploy/base but not listed in kustomization.yaml: {unlisted}"
    expected = {
        "serviceaccount.yaml",
        "clusterrole.yaml",
        "clusterrolebinding.yaml",
        "configmap.yaml",
        "daemonset.yaml",
    }
    assert expected <= set(resources)


def _schema_problems(value: Any, type_name: str, path: str) -> Iterator[str]:
    """Fields that `type_name` (a kubernetes client model or type string, as in
    the models' `openapi_types`) does not have, and mistyped scalars."""
    if type_name.startswith("list["):
        if not isinstance(value, list):
            yield f"{path}: expected a list, got {value!r}"
            return
        for i, item in enumerate(value):
            yield from _schema_problems(item, type_name[5:-1], f"{path}[{i}]")
        return
    if type_name.startswith("dict("):
        if not isinstance(value, dict):
            yield f"{path}: expected a mapping, got {value!r}"
            return
        inner = type_name[5:-1].split(",", 1)[1].strip()
        for key, item in value.items():
            yield from _schema_problems(item, inner, f"{path}.{key}")
        return
    scalar = {"str": str, "int": int, "bool": bool}.get(type_name)
    if scalar is not None:
        if not isinstance(value, scalar) or (scalar is int and isinstance(value, bool)):
            yield f"{path}: expected {type_name}, got {value!r}"
        return
    model = getattr(k8s_models, type_name, None)
    if model is None:  # object (int-or-string, quantities), datetime, ...
        return
    if not isinstance(value, dict):
        yield f"{path}: expected a {type_name} object, got {value!r}"
        return
    by_json_name = {json_name: attr for attr, json_name in model.attribute_map.items()}
    for key, item in value.items():
        attr = by_json_name.get(key)
        if attr is None:
            yield f"{path}.{key}: not a field of {type_name}"
        else:
            yield from _schema_problems(item, model.openapi_types[attr], f"{path}.{key}")


@pytest.mark.parametrize("doc", manifests(), ids=lambda d: d["kind"])
def test_manifests_use_only_fields_of_their_api_schema(doc: Doc) -> None:
    model = f"V1{doc['kind']}"
    assert getattr(k8s_models, model, None) is not None, f"no v1 model for {doc['kind']}"
    assert doc["apiVersion"].rsplit("/", 1)[-1] == "v1"
    assert list(_schema_problems(doc, model, doc["kind"])) == []


def test_schema_check_catches_a_misspelt_field() -> None:
    ds = one("DaemonSet")
    ds["spec"]["template"]["spec"]["tolerationz"] = []
    ds["spec"]["template"]["spec"]["hostNetwork"] = "true"
    assert list(_schema_problems(ds, "V1DaemonSet", "DaemonSet")) == [
        "DaemonSet.spec.template.spec.hostNetwork: expected bool, got 'true'",
        "DaemonSet.spec.template.spec.tolerationz: not a field of V1PodSpec",
    ]


def test_namespaced_objects_are_in_kube_system() -> None:
    assert kustomization()["namespace"] == "kube-system"
    for kind in ("ServiceAccount", "ConfigMap", "DaemonSet"):
        assert one(kind)["metadata"]["namespace"] == "kube-system", kind


def test_daemonset_runs_as_the_service_account() -> None:
    assert pod_spec()["serviceAccountName"] == one("ServiceAccount")["metadata"]["name"]
    assert pod_spec().get("automountServiceAccountToken", True) is True


def test_cluster_role_binding_binds_the_service_account_to_the_cluster_role() -> None:
    binding = one("ClusterRoleBinding")
    sa = one("ServiceAccount")["metadata"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": one("ClusterRole")["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["name"], "namespace": sa["namespace"]}
    ]


def test_cluster_role_grants_exactly_the_api_calls_the_agent_makes() -> None:
    granted: set[tuple[str, str, str]] = set()
    for rule in one("ClusterRole")["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, (
            f"rule with more than groups/resources/verbs (resourceNames, URLs?): {rule}"
        )
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], f"wildcard in {field}: {rule}"
        granted |= {
            (group, resource, verb)
            for group in rule["apiGroups"]
            for resource in rule["resources"]
            for verb in rule["verbs"]
        }
    needed = {(c.group, c.resource, verb) for c in api_calls() for verb in c.verbs}
    assert sorted(needed - granted) == [], "the agent makes calls the ClusterRole does not allow"
    assert sorted(granted - needed) == [], "the ClusterRole grants more than the agent uses"


# ---- the configuration ----------------------------------------------------------------


def test_mounted_config_is_a_kube_proxy_configuration_nftproxy_accepts(tmp_path: Path) -> None:
    path = tmp_path / "config.conf"
    path.write_text(config_text())
    overrides, warnings = load_config_file(path)
    assert warnings == []
    config = build_config(overrides, {})
    assert config.healthz_bind_address
    assert yaml.safe_load(config_text())["kind"] == "KubeProxyConfiguration"


def test_config_mount_is_read_only_and_holds_the_file_given_to_config() -> None:
    volume_name, path = _config_volume_and_path()
    mount = next(m for m in container()["volumeMounts"] if m["name"] == volume_name)
    assert mount["readOnly"] is True
    assert path == "config.conf"


def test_probes_use_the_healthz_port_of_the_config(tmp_path: Path) -> None:
    path = tmp_path / "config.conf"
    path.write_text(config_text())
    config = build_config(load_config_file(path)[0], {})
    _host, port = parse_address(config.healthz_bind_address)
    main = container()
    assert main["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": port}
    assert main["livenessProbe"]["httpGet"] == {"path": "/livez", "port": port}
    declared = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert declared == {"healthz": port}


def test_configmap_key_refs_exist_or_are_optional() -> None:
    data = one("ConfigMap")["data"]
    name = one("ConfigMap")["metadata"]["name"]
    refs = [
        v["valueFrom"]["configMapKeyRef"]
        for v in container()["env"]
        if "configMapKeyRef" in v.get("valueFrom", {})
    ]
    assert refs, "the API server address keys are read from the ConfigMap"
    for ref in refs:
        assert ref["name"] == name
        assert ref["key"] in data or ref.get("optional") is True, ref


API_SERVER_KEYS = {
    "KUBERNETES_SERVICE_HOST": "kubernetes-service-host",
    "KUBERNETES_SERVICE_PORT": "kubernetes-service-port",
}


def test_the_api_server_address_is_a_required_setting_of_the_base() -> None:
    env = {v["name"]: v.get("valueFrom", {}).get("configMapKeyRef") for v in container()["env"]}
    for var, key in API_SERVER_KEYS.items():
        ref = env[var]
        assert ref is not None and ref["key"] == key, var
        assert ref.get("optional", False) is False, f"{var} must not fall back to the ClusterIP"
    data = one("ConfigMap")["data"]
    host, port = data["kubernetes-service-host"], data["kubernetes-service-port"]
    # the placeholder is no address: an unedited base fails at once, not after a reboot
    assert host.endswith(".invalid") and not re.fullmatch(r"[0-9a-fA-F.:]+", host), host
    assert 0 < int(port) < 65536
    comments = (BASE / "configmap.yaml").read_text()
    assert "REQUIRED" in comments and "CHANGE THIS" in comments
    guide = (DEPLOY / "README.md").read_text()
    assert "**Required on any new cluster, and for every node to come back after a\n" \
        "whole-cluster reboot.**" in guide


# ---- the container ----------------------------------------------------------------------


def test_container_args_are_flags_of_nftproxy_run() -> None:
    main = container()
    assert "command" not in main, "the image's entrypoint (`nftproxy run`) must run"
    known = run_option_strings()
    for arg in expanded_args(main):
        if arg.startswith("-"):
            assert arg.split("=", 1)[0] in known, f"{arg!r} is not a flag of `nftproxy run`"
    args = run_args(main)
    assert args.handler is cli._cmd_run


def test_node_name_comes_from_the_downward_api() -> None:
    env = {v["name"]: v for v in container()["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert run_args(container()).node_name == "node-1"


def test_daemonset_has_what_a_nodes_service_proxy_needs() -> None:
    ds = one("DaemonSet")
    spec = pod_spec()
    assert ds["spec"]["selector"]["matchLabels"].items() <= (
        ds["spec"]["template"]["metadata"]["labels"].items()
    )
    assert spec["hostNetwork"] is True
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["tolerations"] == [{"operator": "Exists"}]
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 1},
    }
    main = container()
    assert main["securityContext"] == {"privileged": True}
    assert main["resources"]["requests"].keys() == {"cpu", "memory"}


def test_host_mounts_are_lib_modules_read_only_and_nothing_else() -> None:
    host_paths = {
        v["name"]: v["hostPath"]["path"] for v in pod_spec()["volumes"] if "hostPath" in v
    }
    assert host_paths == {"lib-modules": "/lib/modules"}, "no /run/xtables.lock: no iptables"
    types = {v["name"]: v["hostPath"].get("type") for v in pod_spec()["volumes"] if "hostPath" in v}
    assert types == {"lib-modules": "Directory"}  # never created empty on the host
    mount = next(m for m in container()["volumeMounts"] if m["name"] == "lib-modules")
    assert mount == {"name": "lib-modules", "mountPath": "/lib/modules", "readOnly": True}


def test_pods_run_only_on_labelled_nodes_as_the_migration_guide_says() -> None:
    key, value = LABEL_GATE
    assert pod_spec()["nodeSelector"][key] == value
    guide = (DEPLOY / "README.md").read_text()
    assert f"{key}={value}" in guide  # the label command
    assert "operator: NotIn" in guide and key in guide  # kube-proxy kept off those nodes


def test_image_tag_is_the_package_version() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert container()["image"].rsplit(":", 1)[1] == version


# ---- the image --------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        keyword, _, rest = (pending + line).strip().partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return instructions


def copy_sources(instructions: list[tuple[str, str]]) -> list[str]:
    """The build-context paths COPY reads (every word but the destination)."""
    sources: list[str] = []
    for keyword, args in instructions:
        if keyword == "COPY":
            words = [w for w in args.split() if not w.startswith("--")]
            sources += words[:-1]
    return sources


def _run_env(command: str) -> dict[str, str]:
    """VAR=value assignments in front of `bash scripts/setup.sh`."""
    words = shlex.split(command.split("&&")[0])
    return dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=.*", w))


def test_dockerfile_installs_with_scripts_setup_sh_and_nothing_else() -> None:
    instructions = dockerfile()
    assert instructions[0] == ("FROM", "debian:trixie-slim")  # libnftables 1.1.3
    runs = [args for keyword, args in instructions if keyword == "RUN"]
    setup_runs = [r for r in runs if re.search(r"\bbash scripts/setup\.sh\b", r)]
    assert len(setup_runs) == 1, "the image runs scripts/setup.sh once"
    for run in runs:  # the install steps live in scripts/setup.sh only
        assert not re.search(r"apt-get install|\bpip3? install|python3? -m venv", run), run
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    env = _run_env(setup_runs[0])
    assert env.get("NFTPROXY_NO_TEST_DEPS") == "1"
    for name in env:
        assert name in setup, f"scripts/setup.sh does not read {name}"
    copied = {source.rstrip("/") for source in copy_sources(instructions)}
    readme = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["readme"]
    assert {"pyproject.toml", readme, "constraints.txt", "scripts/setup.sh", "nftproxy"} <= copied


def test_dockerfile_entrypoint_is_nftproxy_run_from_the_venv() -> None:
    instructions = dockerfile()
    entrypoints = [args for keyword, args in instructions if keyword == "ENTRYPOINT"]
    assert len(entrypoints) == 1
    argv = json.loads(entrypoints[0])  # exec form: signals reach nftproxy (PID 1)
    setup_run = next(a for k, a in instructions if k == "RUN" and "scripts/setup.sh" in a)
    venv = _run_env(setup_run)["NFTPROXY_VENV"]
    assert argv == [f"{venv}/bin/nftproxy", "run"]
    assert not [k for k, _ in instructions if k == "CMD"], "args come from the DaemonSet"


def test_dockerignore_keeps_what_the_dockerfile_copies() -> None:
    patterns = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    kept = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    for source in copy_sources(dockerfile()):
        assert source.rstrip("/") in kept, f"COPY {source} is excluded from the context"


# ---- the kube-proxy cleanup script (kernel) ---------------------------------------------

KUBE_PROXY_IPTABLES = """\
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:CNI-POD-NAT - [0:0]
:KUBE-MARK-DROP - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-NPX46M4PTMTKRN6Y - [0:0]
:KUBE-SEP-IT2ZTR26TO4XFPTO - [0:0]
:KUBE-EXT-GNZBNJ2PO5MGZ6GT - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A POSTROUTING -s 10.244.0.0/16 -j CNI-POD-NAT
-A CNI-POD-NAT ! -d 10.244.0.0/16 -j MASQUERADE
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A KUBE-NODEPORTS -p tcp -m tcp --dport 30080 -j KUBE-EXT-GNZBNJ2PO5MGZ6GT
-A KUBE-EXT-GNZBNJ2PO5MGZ6GT -j KUBE-MARK-MASQ
-A KUBE-EXT-GNZBNJ2PO5MGZ6GT -j KUBE-SVC-NPX46M4PTMTKRN6Y
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0
-A KUBE-POSTROUTING -m comment --comment "kubernetes service SNAT" -j MASQUERADE --random-fully
-A KUBE-SERVICES -d 10.96.0.1/32 -p tcp -m tcp --dport 443 -j KUBE-SVC-NPX46M4PTMTKRN6Y
-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
-A KUBE-SVC-NPX46M4PTMTKRN6Y -m comment --comment "default/kubernetes" -j KUBE-SEP-IT2ZTR26TO4XFPTO
-A KUBE-SEP-IT2ZTR26TO4XFPTO -s 172.18.0.2/32 -j KUBE-MARK-MASQ
-A KUBE-SEP-IT2ZTR26TO4XFPTO -p tcp -m tcp -j DNAT --to-destination 172.18.0.2:6443
COMMIT
*filter
:INPUT ACCEPT [0:0]
:FORWARD DROP [0:0]
:OUTPUT ACCEPT [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-FIREWALL - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-SERVICES - [0:0]
-A INPUT -m conntrack --ctstate NEW -m comment --comment "lb firewall" -j KUBE-PROXY-FIREWALL
-A INPUT -m comment --comment "kubernetes health check service ports" -j KUBE-NODEPORTS
-A INPUT -m conntrack --ctstate NEW -j KUBE-EXTERNAL-SERVICES
-A INPUT -j KUBE-FIREWALL
-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "portals" -j KUBE-SERVICES
-A FORWARD -s 10.244.0.0/16 -j ACCEPT
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "portals" -j KUBE-SERVICES
-A OUTPUT -j KUBE-FIREWALL
-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment "block localnet" -j DROP
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FORWARD -m mark --mark 0x4000/0x4000 -j ACCEPT
-A KUBE-SERVICES -d 10.96.0.10/32 -p udp -m udp --dport 53 -j REJECT
COMMIT
*mangle
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-IPTABLES-HINT - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-PROXY-CANARY - [0:0]
COMMIT
"""
"""A kube-proxy iptables-mode node (trimmed), with kubelet's chains and a CNI's rules."""

KUBE_PROXY_IP6TABLES = """\
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-ABCDEFGHIJKLMNOP - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A KUBE-SERVICES -d fd00:96::1/128 -p tcp -m tcp --dport 443 -j KUBE-SVC-ABCDEFGHIJKLMNOP
-A POSTROUTING -s fd00:244::/64 -j MASQUERADE
COMMIT
"""

# What must survive, as iptables-save prints it.
KEPT_IPTABLES = [
    ":KUBE-FIREWALL - [0:0]",
    ":KUBE-KUBELET-CANARY - [0:0]",
    ":KUBE-IPTABLES-HINT - [0:0]",
    ":KUBE-MARK-DROP - [0:0]",
    ":CNI-POD-NAT - [0:0]",
    "-A INPUT -j KUBE-FIREWALL",
    "-A FORWARD -s 10.244.0.0/16 -j ACCEPT",
    "-A POSTROUTING -s 10.244.0.0/16 -j CNI-POD-NAT",
    "-A CNI-POD-NAT ! -d 10.244.0.0/16 -j MASQUERADE",
    ":FORWARD DROP [0:0]",
]
OWNED = re.compile(
    r"KUBE-(SERVICES|EXTERNAL-SERVICES|NODEPORTS|POSTROUTING|MARK-MASQ|FORWARD|PROXY-FIREWALL"
    r"|PROXY-CANARY)\b|KUBE-(SVC|SVL|EXT|FW|SEP|XLB)-"
)


def _in(ns: str, *argv: str, stdin: str | None = None) -> str:
    out: str = _netns.exec_in(ns, argv, input=stdin).stdout
    return out


def _save(ns: str, command: str) -> list[str]:
    out = _in(ns, command)
    return [line for line in out.splitlines() if line and not line.startswith("#")]


def _tables(ns: str) -> set[str]:
    out = _in(ns, "nft", "-j", "list", "tables")
    return {
        f"{t['table']['family']} {t['table']['name']}"
        for t in json.loads(out)["nftables"]
        if "table" in t
    }


def test_cleanup_script_removes_kube_proxy_rules_and_nothing_else(netns: str) -> None:
    _in(netns, "iptables-nft-restore", stdin=KUBE_PROXY_IPTABLES)
    _in(netns, "ip6tables-nft-restore", stdin=KUBE_PROXY_IP6TABLES)
    for table in ("ip kube-proxy", "ip6 kube-proxy", "ip nftproxy", "ip6 nftproxy"):
        _in(netns, "nft", "add", "table", *table.split())
    before = _save(netns, "iptables-nft-save")

    dry = _in(netns, "bash", str(CLEANUP), "--dry-run")
    assert "nft delete table ip kube-proxy" in dry and "-X KUBE-SERVICES" in dry
    assert _save(netns, "iptables-nft-save") == before, "--dry-run changed something"
    assert {"ip kube-proxy", "ip6 kube-proxy"} <= _tables(netns)

    _in(netns, "bash", str(CLEANUP))

    v4 = _save(netns, "iptables-nft-save")
    assert [line for line in v4 if OWNED.search(line)] == []
    assert [line for line in KEPT_IPTABLES if line not in v4] == []
    v6 = _save(netns, "ip6tables-nft-save")
    assert [line for line in v6 if OWNED.search(line)] == []
    assert "-A POSTROUTING -s fd00:244::/64 -j MASQUERADE" in v6
    tables = _tables(netns)
    assert {"ip nftproxy", "ip6 nftproxy"} <= tables
    assert not {"ip kube-proxy", "ip6 kube-proxy"} & tables

    assert "no kube-proxy rules found" in _in(netns, "bash", str(CLEANUP))
