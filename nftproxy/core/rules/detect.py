"""The local-traffic detector: "did this packet come from a pod on this node?"

Layer: rules (pure). One job: turn detectLocalMode (ClusterCIDR, NodeCIDR,
BridgeInterface, InterfaceNamePrefix) into the two match lists kube-proxy's
pkg/proxy/util LocalTrafficDetector writes: if-local and if-not-local. With
no usable input (e.g. ClusterCIDR mode without a cluster CIDR of this
family) there is no detector, and -- as in kube-proxy -- ClusterIP traffic is
then never masqueraded and eTP=Local loses its pod short-circuit.
"""

from __future__ import annotations

from dataclasses import dataclass

from nftproxy.core.config import DetectLocalMode, ProxyConfig
from nftproxy.core.model import IPFamily, NodeInfo, family_of
from nftproxy.core.rules import expr
from nftproxy.core.rules.fragment import Json

__all__ = ["LocalDetector", "local_detector", "masquerade_source"]


@dataclass(frozen=True, slots=True)
class LocalDetector:
    if_local: tuple[Json, ...]
    if_not_local: tuple[Json, ...]


def _cidr_detector(family: IPFamily, cidrs: tuple[str, ...]) -> LocalDetector | None:
    if not cidrs:
        return None
    return LocalDetector(
        if_local=(expr.addr_match(family, "saddr", cidrs),),
        if_not_local=(expr.addr_match(family, "saddr", cidrs, negate=True),),
    )


def _iface_detector(name: str) -> LocalDetector | None:
    if not name:
        return None
    return LocalDetector(
        if_local=(expr.iifname(name),), if_not_local=(expr.iifname(name, negate=True),)
    )


def local_detector(family: IPFamily, config: ProxyConfig, node: NodeInfo) -> LocalDetector | None:
    mode = config.detect_local_mode
    if mode is DetectLocalMode.CLUSTER_CIDR:
        return _cidr_detector(family, config.cluster_cidrs_of(family))
    if mode is DetectLocalMode.NODE_CIDR:
        cidrs = tuple(c for c in node.pod_cidrs if family_of(c) is family)
        return _cidr_detector(family, cidrs)
    if mode is DetectLocalMode.BRIDGE_INTERFACE:
        return _iface_detector(config.bridge_interface)
    prefix = config.interface_name_prefix
    return _iface_detector(prefix + "*" if prefix else "")


def masquerade_source(
    config: ProxyConfig, detector: LocalDetector | None
) -> tuple[Json, ...] | None:
    """What marks traffic to a cluster IP for masquerade: every source with
    masqueradeAll (()), else sources the detector does not take for pods;
    None: no detector, no rule (kube-proxy)."""
    if config.masquerade_all:
        return ()
    return None if detector is None else detector.if_not_local
