"""Kubernetes API objects (plain JSON dicts) -> model values, with validation.

Layer: convert (imports model only). One job: turn v1 Service,
discovery.k8s.io/v1 EndpointSlice, v1 Node and networking.k8s.io ServiceCIDR
dicts into validated model values. All input validation of nftproxy lives
here: an invalid field skips only that port / endpoint / range, and is
reported as a `Problem` value naming the object and the field. Nothing raises
out of this package, whatever the input.

Caller: the agent's Intake (agent/intake.py), once per object when its
event arrives; it reports the Problems once and hands the values on. (The
demo's report converts the sample on its own, as an oracle of what the agent
should do.)

Modules, one job each:
- problems: the Problem value, the per-object report, object names;
- names: object and port names checked as the API server checks them;
- fields: typed access to JSON fields, sloppy IP and CIDR parsing;
- service: v1 Service -> ServicePorts of one family;
- endpointslice: EndpointSlice -> EndpointSliceInfo;
- node: v1 Node -> NodeInfo, ServiceCIDR -> CIDRs.

Parsing follows kube-proxy's: IPs and CIDRs are read "sloppily" as Go's
netutils.ParseIPSloppy does (IPv4 octets with leading zeros are decimal,
"010.001.002.003" is 10.1.2.3; an IPv4-mapped IPv6 address is IPv4), then
normalised to their canonical text. Blank externalIPs and source ranges are
skipped silently, as kube-proxy does.

Known limits:
- Every family view of a dual-stack Service validates the whole object, so
  both views find the same invalid field; the Intake reports it once.
- healthCheckNodePort is kept only where kube-proxy serves it (type
  LoadBalancer with externalTrafficPolicy Local).
"""

from __future__ import annotations

from nftproxy.core.convert.endpointslice import SERVICE_NAME_LABEL, EndpointSliceInfo, slice_info
from nftproxy.core.convert.node import node_info, service_cidrs
from nftproxy.core.convert.problems import Problem, service_name
from nftproxy.core.convert.service import HEADLESS_LABEL, SERVICE_PROXY_NAME_LABEL, service_ports

__all__ = [
    "HEADLESS_LABEL",
    "SERVICE_NAME_LABEL",
    "SERVICE_PROXY_NAME_LABEL",
    "EndpointSliceInfo",
    "Problem",
    "node_info",
    "service_cidrs",
    "service_name",
    "service_ports",
    "slice_info",
]
