"""config_load: KubeProxyConfiguration v1alpha2 (KEP-784), configHardFail,
and the settings both versions gained for issue 15.

Aspects: a full v1alpha2 file sets every field nftproxy applies, at its
v1alpha2 place (syncPeriod/minSyncPeriod at the root, masqueradeAll and
conntrack under linux, detectLocal.clusterCIDRs, nodeIPOverride, bind CIDRs
and ports); an empty one keeps kube-proxy's defaults; a v1alpha1 field in a
v1alpha2 file is unknown and its warning names its v1alpha2 place;
configHardFail (v1alpha2 default true, v1alpha1 false; the file's field and
the --config-hard-fail flag override) turns every warning into one error
naming every field; feature gates AllowServiceExternalIPs and
PreferSameTrafficDistribution; bindAddressHardFail.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
from test_config_load import CONNTRACK, CONNTRACK_YAML

from nftproxy.core.config import DetectLocalMode, ProxyConfig
from nftproxy.tools.config_load import build_config, load_config_file
from nftproxy.tools.config_values import ConfigError

V2 = "apiVersion: kubeproxy.config.k8s.io/v1alpha2\nkind: KubeProxyConfiguration\n"
V1 = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"


def load(
    tmp_path: Path, body: str, *, header: str = V2, hard_fail: bool | None = None
) -> tuple[dict[str, Any], list[str]]:
    path = tmp_path / "config.yaml"
    path.write_text(header + textwrap.dedent(body))
    return load_config_file(path, hard_fail=hard_fail)


def config_of(tmp_path: Path, body: str, *, header: str = V2) -> ProxyConfig:
    overrides, warnings = load(tmp_path, body, header=header)
    assert warnings == []
    return build_config(overrides, {})


def test_a_full_v1alpha2_file_sets_every_field(tmp_path: Path) -> None:
    config = config_of(
        tmp_path,
        """
        featureGates: {AllowServiceExternalIPs: false, PreferSameTrafficDistribution: true}
        clientConnection: {kubeconfig: /var/lib/kube-proxy/kubeconfig.conf, qps: 5}
        logging: {format: text}
        hostnameOverride: Node-A
        nodeIPOverride: [192.168.50.1, "fd00:50::1"]
        healthzBindAddresses: [0.0.0.0/0, "::/0"]
        healthzBindPort: 10300
        metricsBindAddresses: [127.0.0.0/8, "::1/128"]
        metricsBindPort: 10301
        configHardFail: true
        bindAddressHardFail: true
        enableProfiling: false
        mode: nftables
        linux:
          oomScoreAdj: -999
          masqueradeAll: true
          conntrack: CONNTRACK
        windows: {runAsService: false}
        iptables: {masqueradeBit: 14, localhostNodePorts: false}
        ipvs: {scheduler: ""}
        nftables: {masqueradeBit: 15}
        winkernel: {enableDSR: false}
        detectLocalMode: InterfaceNamePrefix
        detectLocal:
          clusterCIDRs: [10.244.0.0/16, "fd00:244::/56"]
          interfaceNamePrefix: veth
        nodePortAddresses: [primary]
        syncPeriod: 1m0s
        minSyncPeriod: 500ms
        configSyncPeriod: 10m
        """.replace("CONNTRACK", CONNTRACK_YAML),
    )
    assert config == ProxyConfig(
        node_name="node-a",
        node_ips=("192.168.50.1", "fd00:50::1"),
        cluster_cidrs=("10.244.0.0/16", "fd00:244::/56"),
        detect_local_mode=DetectLocalMode.INTERFACE_NAME_PREFIX,
        interface_name_prefix="veth",
        nodeport_addresses=("primary",),
        masquerade_all=True,
        masquerade_bit=15,
        sync_period=60.0,
        min_sync_period=0.5,
        healthz_bind_address="[::]:10300",
        metrics_bind_address="127.0.0.1:10301",
        config_sync_period=600.0,
        prefer_same_node=True,
        allow_service_external_ips=False,
        bind_address_hard_fail=True,
        conntrack=CONNTRACK,
    )


def test_an_empty_v1alpha2_file_keeps_kube_proxy_defaults(tmp_path: Path) -> None:
    assert config_of(tmp_path, "") == ProxyConfig()


@pytest.mark.parametrize(
    ("body", "healthz", "metrics"),
    [
        ("healthzBindPort: 9000", "0.0.0.0:9000", "127.0.0.1:10249"),
        ("healthzBindAddresses: [0.0.0.0/0]", "0.0.0.0:10256", "127.0.0.1:10249"),
        ('healthzBindAddresses: ["::/0"]', "[::]:10256", "127.0.0.1:10249"),
        ('metricsBindAddresses: ["::1/128"]', "0.0.0.0:10256", "[::1]:10249"),
        ("metricsBindAddresses: [0.0.0.0/0, '::/0']", "0.0.0.0:10256", "[::]:10249"),
        ("metricsBindAddresses: [192.168.50.7/32]", "0.0.0.0:10256", "192.168.50.7:10249"),
        (
            "nodeIPOverride: [192.168.50.1]\nmetricsBindAddresses: [192.168.0.0/16]",
            "0.0.0.0:10256",
            "192.168.50.1:10249",
        ),
    ],
)
def test_v1alpha2_bind_ranges_and_ports(
    tmp_path: Path, body: str, healthz: str, metrics: str
) -> None:
    config = config_of(tmp_path, body + "\n")
    assert (config.healthz_bind_address, config.metrics_bind_address) == (healthz, metrics)


def test_a_bind_range_without_one_address_warns_and_keeps_the_default(tmp_path: Path) -> None:
    overrides, warnings = load(
        tmp_path, "configHardFail: false\nmetricsBindAddresses: [10.0.0.0/8]\n"
    )
    assert build_config(overrides, {}).metrics_bind_address == "127.0.0.1:10249"
    assert len(warnings) == 1 and warnings[0].startswith("metricsBindAddresses: ['10.0.0.0/8']")


def test_v1alpha1_fields_in_a_v1alpha2_file_warn_naming_their_new_place(tmp_path: Path) -> None:
    overrides, warnings = load(
        tmp_path,
        """
        configHardFail: false
        clusterCIDR: 10.244.0.0/16
        bindAddress: 192.168.50.1
        conntrack: {min: 1}
        portRange: ""
        nftables: {syncPeriod: 10s, masqueradeBit: 12}
        iptables: {masqueradeAll: true}
        linux: {bogus: 1}
        """,
    )
    assert overrides == {"masquerade_bit": 12}
    assert warnings == [
        "clusterCIDR: a v1alpha1 field; v1alpha2 has detectLocal.clusterCIDRs; ignored",
        "bindAddress: a v1alpha1 field; v1alpha2 has nodeIPOverride; ignored",
        "conntrack: a v1alpha1 field; v1alpha2 has linux.conntrack; ignored",
        "portRange: a v1alpha1 field (dropped in v1alpha2); ignored",
        "linux.bogus: unknown field, ignored",
        "nftables.syncPeriod: a v1alpha1 field; v1alpha2 has syncPeriod (top level); ignored",
        "iptables.masqueradeAll: a v1alpha1 field; v1alpha2 has linux.masqueradeAll; ignored",
    ]


# -- configHardFail -------------------------------------------------------------------


def test_v1alpha2_fails_on_an_unknown_field_by_default_naming_every_field(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError) as err:
        load(tmp_path, "syncPeriodd: 5s\nmode: ipvs\n")
    message = str(err.value)
    assert message.startswith(f"{tmp_path / 'config.yaml'}: configHardFail: ")
    assert "syncPeriodd: unknown field" in message
    assert "mode: 'ipvs' ignored" in message


@pytest.mark.parametrize(
    ("header", "field", "flag", "fails"),
    [
        (V2, "", None, True),  # v1alpha2 default: true
        (V2, "configHardFail: false\n", None, False),
        (V2, "", False, False),  # --config-hard-fail=false
        (V2, "configHardFail: false\n", True, True),  # the flag wins over the file
        (V1, "", None, False),  # v1alpha1 default: false (kube-proxy only warns)
        (V1, "configHardFail: true\n", None, True),
        (V1, "", True, True),
        (V1, "configHardFail: true\n", False, False),
    ],
    ids=lambda v: {V1: "v1alpha1", V2: "v1alpha2", "": "-"}.get(v, str(v).strip()),
)
def test_config_hard_fail_from_version_file_and_flag(
    tmp_path: Path, header: str, field: str, flag: bool | None, fails: bool
) -> None:
    body = field + "featureGates: {SomeAlphaGate: true}\n"
    if fails:
        with pytest.raises(ConfigError, match=r"configHardFail: featureGates: SomeAlphaGate"):
            load(tmp_path, body, header=header, hard_fail=flag)
    else:
        _, warnings = load(tmp_path, body, header=header, hard_fail=flag)
        assert warnings == ["featureGates: SomeAlphaGate=True ignored by nftproxy"]


def test_hard_fail_does_not_turn_a_clean_file_into_an_error(tmp_path: Path) -> None:
    assert load(tmp_path, "syncPeriod: 10s\n", hard_fail=True) == ({"sync_period": 10.0}, [])


# -- settings both versions read ------------------------------------------------------


@pytest.mark.parametrize("header", [V1, V2], ids=["v1alpha1", "v1alpha2"])
def test_feature_gates_nftproxy_implements(tmp_path: Path, header: str) -> None:
    body = "featureGates: {AllowServiceExternalIPs: false, PreferSameTrafficDistribution: false}\n"
    config = config_of(tmp_path, body, header=header)
    assert (config.allow_service_external_ips, config.prefer_same_node) == (False, False)
    assert ProxyConfig().allow_service_external_ips is True  # kube-proxy 1.36's default


@pytest.mark.parametrize("header", [V1, V2], ids=["v1alpha1", "v1alpha2"])
def test_bind_address_hard_fail(tmp_path: Path, header: str) -> None:
    assert config_of(tmp_path, "bindAddressHardFail: true\n", header=header).bind_address_hard_fail
    assert ProxyConfig().bind_address_hard_fail is False


def test_flags_for_the_new_settings_override_the_file(tmp_path: Path) -> None:
    overrides, _ = load(tmp_path, "featureGates: {AllowServiceExternalIPs: false}\n")
    config = build_config(overrides, {"allow_service_external_ips": True})
    assert config.allow_service_external_ips is True


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("featureGates: {AllowServiceExternalIPs: 'no'}", "featureGates.AllowServiceExternalIPs:"),
        ("featureGates: [a]", "featureGates: expected an object"),
        ("configHardFail: 1", "configHardFail: expected true or false"),
        ("healthzBindPort: 70000", "healthzBindPort: 70000 is not in 1..65535"),
        ("metricsBindAddresses: [nope]", "metricsBindAddresses: 'nope' is not a CIDR"),
        ("nodeIPOverride: [10.0.0.1, 10.0.0.2]", "nodeIPOverride: two IPv4 addresses"),
        ("linux: {conntrack: {min: -1}}", "linux.conntrack.min: -1 is negative"),
    ],
)
def test_invalid_v1alpha2_values_name_the_field(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load(tmp_path, body + "\n")
    assert str(err.value).startswith(f"{tmp_path / 'config.yaml'}: {message}")


def test_docs_config_md_names_every_field_and_flag_nftproxy_reads() -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    from nftproxy.tools import cli, config_read
    from nftproxy.tools.config_values import CONNTRACK_SETTINGS

    fields = {camel for _, camel in CONNTRACK_SETTINGS.values()}
    fields |= set(config_read._V1_TOP) | set(config_read._V2_TOP)
    fields -= {"apiVersion", "kind"}
    missing = sorted(f for f in fields if f"`{f}" not in doc and f".{f}`" not in doc)
    assert missing == [], f"fields not in docs/config.md: {missing}"
    run = cli.build_parser().parse_args(["run"])
    not_settings = {"--handler", "--verbose", "--source", "--kubeconfig"}
    flags = {f"--{dest.replace('_', '-')}" for dest in vars(run)} - not_settings
    assert len(flags) > 15
    assert sorted(f for f in flags if f"`{f}`" not in doc) == []
