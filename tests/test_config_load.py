"""config_load: KubeProxyConfiguration files and flags -> one ProxyConfig.

Aspects: Go durations; every field that applies, at each place kube-proxy
accepts it, in v1alpha1 and v1alpha2; flags override the file; unknown and
inapplicable fields warn, one line each naming the field, or fail the load
with configHardFail (v1alpha2's default; the file's field and the flag turn
it on or off); every invalid value raises ConfigError naming the field or
flag. The v1alpha2 cases are in test_config_v1alpha2.py.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from nftproxy.core.config import ConntrackConfig, DetectLocalMode, ProxyConfig
from nftproxy.core.nft.ownership import our_tables
from nftproxy.tools.config_load import build_config, load_config_file
from nftproxy.tools.config_values import ConfigError, parse_duration

HEADER = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
# every conntrack field, set away from its default, and what it reads as
CONNTRACK_YAML = (
    "{maxPerCore: 0, min: 1000, tcpEstablishedTimeout: 12h0m0s, tcpCloseWaitTimeout: 30m,"
    " tcpBeLiberal: true, udpTimeout: 30s, udpStreamTimeout: 2m}"
)
CONNTRACK = ConntrackConfig(
    max_per_core=0,
    min=1000,
    tcp_established_timeout=43200,
    tcp_close_wait_timeout=1800,
    tcp_be_liberal=True,
    udp_timeout=30,
    udp_stream_timeout=120,
)


def load(tmp_path: Path, body: str, *, header: str = HEADER) -> tuple[dict[str, Any], list[str]]:
    path = tmp_path / "config.yaml"
    path.write_text(header + textwrap.dedent(body))
    return load_config_file(path)


def config_of(tmp_path: Path, body: str) -> ProxyConfig:
    overrides, _ = load(tmp_path, body)
    return build_config(overrides, {})


# -- durations ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30.0),
        ("1m0s", 60.0),
        ("500ms", 0.5),
        ("1h", 3600.0),
        ("1h30m", 5400.0),
        ("1.5s", 1.5),
        (".5s", 0.5),
        ("24h0m0s", 86400.0),
        ("100us", 1e-4),
        ("100\u00b5s", 1e-4),
        ("10ns", 1e-8),
        ("0", 0.0),
        ("-1m", -60.0),
        ("+2s", 2.0),
    ],
)
def test_go_durations_parse_to_seconds(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "30", "s", "1d", "1m 2s", "+", "ms1", "1.2.3s"])
def test_invalid_go_durations_are_rejected(text: str) -> None:
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(text)


# -- fields ---------------------------------------------------------------------------


def test_a_full_v1alpha1_file_sets_every_field(tmp_path: Path) -> None:
    overrides, warnings = load(
        tmp_path,
        """
        bindAddress: 192.168.50.1
        healthzBindAddress: 0.0.0.0:10300
        metricsBindAddress: "[::1]:10301"
        clusterCIDR: 10.244.0.0/16,fd00:244::/56
        detectLocalMode: BridgeInterface
        detectLocal:
          bridgeInterface: cbr0
          interfaceNamePrefix: veth
        nodePortAddresses: [192.168.50.0/24, "fd00:50::/64"]
        hostnameOverride: Demo-Node
        mode: nftables
        nftables:
          syncPeriod: 1m0s
          minSyncPeriod: 500ms
          masqueradeAll: true
          masqueradeBit: 15
        conntrack: CONNTRACK
        configSyncPeriod: 10m
        """.replace("CONNTRACK", CONNTRACK_YAML),
    )
    assert warnings == []
    config = build_config(overrides, {})
    assert config == ProxyConfig(
        node_name="demo-node",
        node_ips=("192.168.50.1",),
        cluster_cidrs=("10.244.0.0/16", "fd00:244::/56"),
        detect_local_mode=DetectLocalMode.BRIDGE_INTERFACE,
        bridge_interface="cbr0",
        interface_name_prefix="veth",
        nodeport_addresses=("192.168.50.0/24", "fd00:50::/64"),
        masquerade_all=True,
        masquerade_bit=15,
        sync_period=60.0,
        min_sync_period=0.5,
        healthz_bind_address="0.0.0.0:10300",
        metrics_bind_address="[::1]:10301",
        config_sync_period=600.0,
        conntrack=CONNTRACK,
    )


def test_an_empty_file_keeps_kube_proxy_defaults(tmp_path: Path) -> None:
    assert config_of(tmp_path, "") == ProxyConfig()


def test_kubeadm_style_zero_and_null_values_mean_unset(tmp_path: Path) -> None:
    config = config_of(
        tmp_path,
        """
        bindAddress: 0.0.0.0
        clusterCIDR: ""
        hostnameOverride: ""
        configSyncPeriod: 0s
        detectLocalMode: ""
        iptables:
          masqueradeAll: false
          masqueradeBit: null
          minSyncPeriod: 0s
          syncPeriod: 0s
          localhostNodePorts: null
        nftables:
          masqueradeAll: false
          masqueradeBit: null
          minSyncPeriod: 0s
          syncPeriod: 0s
        conntrack:
          maxPerCore: null
          min: null
        clientConnection:
          kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
        ipvs:
          scheduler: ""
        winkernel:
          enableDSR: false
        oomScoreAdj: null
        portRange: ""
        enableProfiling: false
        showHiddenMetricsForVersion: ""
        logging:
          format: text
        """,
    )
    assert config == ProxyConfig()


def test_sync_periods_are_read_at_top_level_v1alpha2_style(tmp_path: Path) -> None:
    config = config_of(tmp_path, "syncPeriod: 45s\nminSyncPeriod: 2s\n")
    assert (config.sync_period, config.min_sync_period) == (45.0, 2.0)


def test_iptables_section_applies_when_nftables_section_is_absent(tmp_path: Path) -> None:
    config = config_of(
        tmp_path,
        """
        iptables:
          syncPeriod: 20s
          minSyncPeriod: 3s
          masqueradeBit: 12
          masqueradeAll: true
        """,
    )
    assert (config.sync_period, config.min_sync_period) == (20.0, 3.0)
    assert (config.masquerade_bit, config.masquerade_all) == (12, True)


def test_nftables_section_wins_over_top_level_and_iptables(tmp_path: Path) -> None:
    config = config_of(
        tmp_path,
        """
        syncPeriod: 40s
        iptables: {syncPeriod: 20s, masqueradeBit: 12}
        nftables: {syncPeriod: 50s, masqueradeBit: 13}
        """,
    )
    assert (config.sync_period, config.masquerade_bit) == (50.0, 13)


@pytest.mark.parametrize(
    "body",
    [
        "masqueradeAll: true",
        "iptables: {masqueradeAll: true}",
        "nftables: {masqueradeAll: true}",
        "linux: {masqueradeAll: true}",
    ],
)
def test_masquerade_all_is_read_wherever_kube_proxy_accepts_it(tmp_path: Path, body: str) -> None:
    assert config_of(tmp_path, body).masquerade_all is True


def test_linux_conntrack_is_read_like_top_level_conntrack(tmp_path: Path) -> None:
    config = config_of(
        tmp_path,
        """
        linux:
          conntrack:
            maxPerCore: 1024
            tcpEstablishedTimeout: 1h
            tcpBeLiberal: true
        """,
    )
    assert config.conntrack == ConntrackConfig(
        max_per_core=1024, tcp_established_timeout=3600, tcp_be_liberal=True
    )


def test_detect_local_cluster_cidrs_v1alpha2_style(tmp_path: Path) -> None:
    config = config_of(tmp_path, "detectLocal:\n  clusterCIDRs: [10.244.0.0/16, fd00:244::/56]\n")
    assert config.cluster_cidrs == ("10.244.0.0/16", "fd00:244::/56")


def test_cidrs_with_host_bits_are_normalised(tmp_path: Path) -> None:
    config = config_of(tmp_path, "clusterCIDR: 10.244.1.7/16\n")
    assert config.cluster_cidrs == ("10.244.0.0/16",)


def test_node_port_addresses_primary(tmp_path: Path) -> None:
    config = config_of(tmp_path, "nodePortAddresses: [primary]\n")
    assert config.nodeport_addresses == ("primary",)
    assert config.nodeport_primary


@pytest.mark.parametrize(
    ("text", "normalised"),
    [
        ("0.0.0.0:10256", "0.0.0.0:10256"),
        ("127.0.0.1", "127.0.0.1:10256"),
        ("[::]:9000", "[::]:9000"),
        ("::", "[::]:10256"),
        ("", ""),
    ],
)
def test_healthz_bind_address_forms(tmp_path: Path, text: str, normalised: str) -> None:
    config = config_of(tmp_path, f'healthzBindAddress: "{text}"\n')
    assert config.healthz_bind_address == normalised


def test_ipv6_bind_address_becomes_the_ipv6_node_ip(tmp_path: Path) -> None:
    assert config_of(tmp_path, 'bindAddress: "fd00:50::1"\n').node_ips == ("fd00:50::1",)


def test_a_json_file_is_read_as_yaml(tmp_path: Path) -> None:
    overrides, _ = load(
        tmp_path,
        '{"apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",'
        ' "nftables": {"masqueradeBit": 9}}',
        header="",
    )
    assert build_config(overrides, {}).masquerade_bit == 9


# -- warnings -------------------------------------------------------------------------


def test_unknown_fields_warn_with_their_path_and_do_not_fail(tmp_path: Path) -> None:
    overrides, warnings = load(
        tmp_path,
        """
        masqueradeBitt: 3
        nftables: {syncPeriod: 10s, bogus: 1}
        conntrack: {maxPerCor: 1}
        detectLocal: {bridge: br0}
        """,
    )
    assert overrides == {"sync_period": 10.0}
    assert warnings == [
        "masqueradeBitt: unknown field, ignored",
        "detectLocal.bridge: unknown field, ignored",
        "nftables.bogus: unknown field, ignored",
        "conntrack.maxPerCor: unknown field, ignored",
    ]


@pytest.mark.parametrize("mode", ["iptables", "ipvs"])
def test_a_mode_other_than_nftables_warns(tmp_path: Path, mode: str) -> None:
    _, warnings = load(tmp_path, f"mode: {mode}\n")
    assert warnings == [f"mode: '{mode}' ignored; nftproxy always programs nftables"]


@pytest.mark.parametrize("mode", ['""', "nftables"])
def test_mode_nftables_or_empty_is_silent(tmp_path: Path, mode: str) -> None:
    assert load(tmp_path, f"mode: {mode}\n")[1] == []


def test_feature_gates_warn(tmp_path: Path) -> None:
    _, warnings = load(tmp_path, "featureGates: {NFTablesProxyMode: true}\n")
    assert len(warnings) == 1
    assert warnings[0].startswith("featureGates:")


def test_other_api_version_warns_and_missing_kind_warns(tmp_path: Path) -> None:
    _, warnings = load(tmp_path, "apiVersion: kubeproxy.config.k8s.io/v1beta1\n", header="")
    assert any(w.startswith("apiVersion:") for w in warnings)
    assert any(w.startswith("kind: missing") for w in warnings)


# -- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("nftables: {masqueradeBit: 40}", "nftables.masqueradeBit: 40 is not in 0..31"),
        ("iptables: {masqueradeBit: -1}", "iptables.masqueradeBit: -1 is not in 0..31"),
        ("nftables: {masqueradeBit: 'x'}", "nftables.masqueradeBit: expected an integer"),
        ("clusterCIDR: 10.244.0.0/33", "clusterCIDR: '10.244.0.0/33' is not a CIDR"),
        (
            "clusterCIDR: 10.0.0.0/8,10.1.0.0/16",
            "clusterCIDR: two IPv4 CIDRs (10.0.0.0/8, 10.1.0.0/16)",
        ),
        ("detectLocal: {clusterCIDRs: [nope]}", "detectLocal.clusterCIDRs: 'nope' is not a CIDR"),
        ("nodePortAddresses: [primary, loopback]", "nodePortAddresses: 'loopback' is not a CIDR"),
        ("nodePortAddresses: [10.0.0.300/8]", "nodePortAddresses: '10.0.0.300/8' is not a CIDR"),
        ("nodePortAddresses: 7", "nodePortAddresses: expected a list"),
        ("syncPeriod: 30x", "syncPeriod: invalid duration '30x'"),
        ("nftables: {syncPeriod: 30}", None),  # a bare number is read as seconds
        ("nftables: {minSyncPeriod: 1y}", "nftables.minSyncPeriod: invalid duration"),
        ("iptables: {syncPeriod: -5s}", "iptables.syncPeriod: -5s is negative"),
        ("configSyncPeriod: often", "configSyncPeriod: invalid duration"),
        ("conntrack: {tcpEstablishedTimeout: 1 day}", "conntrack.tcpEstablishedTimeout: invalid"),
        ("linux: {conntrack: {min: -1}}", "linux.conntrack.min: -1 is negative"),
        ("conntrack: {tcpBeLiberal: 'yes please'}", "conntrack.tcpBeLiberal: expected true"),
        ("detectLocalMode: PodCIDR", "detectLocalMode: 'PodCIDR' is not one of ClusterCIDR"),
        ("healthzBindAddress: 'localhost:10256'", "healthzBindAddress: 'localhost:10256' is not"),
        ("metricsBindAddress: '127.0.0.1:99999'", "metricsBindAddress: '127.0.0.1:99999': port"),
        ("metricsBindAddress: '[::1]:x'", "metricsBindAddress: '[::1]:x' is not an address"),
        ("bindAddress: 1.2.3", "bindAddress: '1.2.3' is not an IP address"),
        ("masqueradeAll: 1", "masqueradeAll: expected true or false"),
        ("nftables: 3", "nftables: expected an object"),
        ("kind: KubeletConfiguration", "kind: expected KubeProxyConfiguration"),
    ],
)
def test_invalid_values_name_the_field(tmp_path: Path, body: str, message: str | None) -> None:
    if message is None:
        load(tmp_path, body + "\n")
        return
    with pytest.raises(ConfigError) as err:
        load(tmp_path, body + "\n")
    assert message in str(err.value)
    assert str(err.value).startswith(str(tmp_path / "config.yaml") + ": ")


def test_malformed_yaml_names_file_and_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config\.yaml:4: invalid YAML: mapping values"):
        load(tmp_path, "nftables:\n  syncPeriod: 1s: 2s\n")


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml: cannot read"):
        load_config_file(tmp_path / "nope.yaml")


def test_a_file_that_is_not_an_object_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="expected a KubeProxyConfiguration object"):
        load(tmp_path, "- a\n- b\n", header="")


def test_bridge_mode_without_a_bridge_is_rejected(tmp_path: Path) -> None:
    overrides, _ = load(tmp_path, "detectLocalMode: BridgeInterface\n")
    with pytest.raises(ConfigError, match=r"^detectLocalMode: .*needs a bridge interface"):
        build_config(overrides, {})


def test_interface_prefix_mode_without_a_prefix_is_rejected_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"^--detect-local-mode: .*needs an interface name"):
        build_config({}, {"detect_local_mode": "InterfaceNamePrefix"})


def test_min_sync_period_longer_than_sync_period_is_rejected(tmp_path: Path) -> None:
    overrides, _ = load(tmp_path, "syncPeriod: 5s\nminSyncPeriod: 10s\n")
    with pytest.raises(ConfigError, match=r"^minSyncPeriod: .*longer than syncPeriod"):
        build_config(overrides, {})


# -- flags over file ------------------------------------------------------------------


def test_flags_override_the_file(tmp_path: Path) -> None:
    overrides, _ = load(
        tmp_path,
        """
        hostnameOverride: from-file
        clusterCIDR: 10.244.0.0/16
        nftables: {masqueradeBit: 12, syncPeriod: 20s}
        masqueradeAll: true
        healthzBindAddress: 0.0.0.0:1
        """,
    )
    config = build_config(
        overrides,
        {
            "node_name": "from-flag",
            "cluster_cidrs": "10.200.0.0/16,fd00::/48",
            "masquerade_bit": 3,
            "masquerade_all": None,  # flag not given: the file's value stays
            "healthz_bind_address": "",
            "table_name": "kp",
        },
    )
    assert config.node_name == "from-flag"
    assert config.cluster_cidrs == ("10.200.0.0/16", "fd00::/48")
    assert config.masquerade_bit == 3
    assert config.masquerade_all is True
    assert config.sync_period == 20.0
    assert config.healthz_bind_address == ""
    assert config.table_name == "kp"


def test_flag_conntrack_overrides_merge_with_the_files() -> None:
    config = build_config({"conntrack": {"min": 5}}, {"conntrack": {"udp_timeout": 7}})
    assert config.conntrack == ConntrackConfig(min=5, udp_timeout=7)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"masquerade_bit": 40}, "--masquerade-bit: 40 is not in 0..31"),
        ({"node_ips": ["10.0.0.1", "10.0.0.2"]}, "--node-ip: two IPv4 addresses"),
        ({"node_ips": ["10.0.0.x"]}, "--node-ip: '10.0.0.x' is not an IP address"),
        ({"cluster_cidrs": "10.0.0.0/8,bad"}, "--cluster-cidr: 'bad' is not a CIDR"),
        ({"nodeport_addresses": "primary,Localhost"}, "--nodeport-addresses: 'Localhost' is not"),
        ({"detect_local_mode": "Magic"}, "--detect-local-mode: 'Magic' is not one of"),
        ({"table_name": "has space"}, "--table-name: 'has space' is not a valid"),
        ({"table_name": "t" * 247}, "--table-name: 'tttt"),  # + "-affinity": 256 bytes
        ({"sync_period": 0}, "--sync-period: must be greater than 0"),
        ({"min_sync_period": 60.0}, "--min-sync-period: minSyncPeriod (60s) is longer"),
        ({"healthz_bind_address": "nope"}, "--healthz-bind-address: 'nope' is not"),
    ],
)
def test_invalid_flags_name_the_flag(flags: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_config({}, flags)
    assert str(err.value).startswith(message)


def test_a_table_name_leaves_room_for_its_affinity_table() -> None:
    suffix = max(len(name) for _, name in our_tables(""))  # "-affinity", or longer
    assert suffix >= len("-affinity")
    config = build_config({}, {"table_name": "t" * (255 - suffix)})
    longest = max(len(name) for _, name in our_tables(config.table_name))
    assert longest == 255  # the kernel takes names < 256 bytes
    with pytest.raises(ConfigError, match=f"at most {255 - suffix} characters"):
        build_config({}, {"table_name": "t" * (256 - suffix)})


def test_dual_stack_node_ips_one_per_family() -> None:
    config = build_config({}, {"node_ips": ["192.168.50.1", "fd00:50::1"]})
    assert config.node_ips == ("192.168.50.1", "fd00:50::1")


def test_unknown_setting_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="unknown ProxyConfig setting"):
        build_config({}, {"masquerade_bits": 1})
