"""The docs that describe nftproxy name only what its code has.

Aspects: in README.md and the docs about nftproxy's own code and tables
(docs/ruleset.md, docs/architecture.md, docs/trace.md, deploy/README.md), every backticked
chain, set or map name of nftproxy's vocabulary (a name with one of its
prefixes: `service-`, `dispatch-`, `KUBE-` ...) is one the code makes --
a skeleton object of either family, a shared object by its name (a
chooser of any protocol and count, an endpoints or choosers map), a
kube-proxy identity with its hash -- and every backticked module
(`nftproxy.x.y`) imports. Templates (`dispatch-<proto>-<N>`) are read with
sample values. The notes on upstream kube-proxy and nftables are left out:
they name upstream's objects.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from nftproxy.core.config import ProxyConfig
from nftproxy.core.model import IPFamily, NodeInfo
from nftproxy.core.rules import dispatch, skeleton
from nftproxy.core.rules.fragment import kernel_name

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "docs/ruleset.md", "docs/architecture.md", "docs/trace.md",
        "deploy/README.md"]
PREFIXES = ("KUBE-", "service-", "no-endpoint-", "masquerade-", "firewall-", "hairpin-",
            "cluster-ips", "nodeport-", "dispatch-", "vip-", "external-", "filter-", "nat-",
            "pick-", "shared-", "endpoints-")
SAMPLES = {"<proto>": "tcp", "<p>": "tcp", "<N>": "3", "<n>": "3", "<h>": "XRY76EGRC3BSCIIJ",
           "<h'>": "QRUEL26JRDPVFLID"}
IDENTITY = re.compile(r"KUBE-(SVC|SVL|EXT|SEP|FW)-[A-Z2-7]{16}")
KUBE_PROXY_ONLY = {"KUBE-MARK-DROP", "KUBE-PROXY-FIREWALL", "KUBE-FIREWALL", "KUBE-IPTABLES-HINT",
                   "KUBE-KUBELET-CANARY", "KUBE-PROXY-CANARY", "firewall-check"}
"""kube-proxy's and kubelet's objects that a doc names (the migration guide
says which stay and which go), none of them nftproxy's."""
KINDS = {"KUBE-SVC", "KUBE-SVL", "KUBE-EXT", "KUBE-SEP", "KUBE-FW"}
"""kube-proxy's identities by kind, which element comments carry with a hash."""
THREADS = {"service-health"}
"""Thread names that share the vocabulary's prefixes."""


def _known() -> set[str]:
    config = ProxyConfig(node_name="n", cluster_cidrs=("10.0.0.0/8", "fd00::/48"))
    node = NodeInfo("n", ipv4=("192.168.0.2",), ipv6=("fd00::2",))
    names: set[str] = set()
    for family in IPFamily:
        fragment = skeleton.render_skeleton(family, config, node)
        names |= {kernel_name(c.name) for c in fragment.chains}
        names |= {kernel_name(s.name) for s in fragment.sets}
        names.add(kernel_name(skeleton.choosers(family, config, node).affinity_set.name))
    return names


KNOWN = _known()


def _is_ours(name: str) -> bool:
    return (name in KNOWN or IDENTITY.fullmatch(name) is not None
            or dispatch.is_shared_chain(name) or dispatch.is_choosers_map(name)
            or dispatch.is_indexed_map(name))


def _named(text: str) -> list[str]:
    """The backticked names of nftproxy's vocabulary, templates filled in."""
    out = []
    for token in re.findall(r"`([^`\s]+)`", text):
        for template, value in SAMPLES.items():
            token = token.replace(template, value)
        token = token.rstrip(".,:;").removeprefix("@")
        pattern = any(c in token for c in "<*/…") or token.endswith("-")
        if token.startswith(PREFIXES) and not pattern:
            out.append(token)
    return out


@pytest.mark.parametrize("doc", DOCS)
def test_every_object_a_doc_names_is_one_the_code_makes(doc: str) -> None:
    text = (ROOT / doc).read_text()
    allowed = KUBE_PROXY_ONLY | KINDS | THREADS
    unknown = sorted({n for n in _named(text) if not _is_ours(n)} - allowed)
    assert unknown == []


@pytest.mark.parametrize("doc", DOCS)
def test_every_module_a_doc_names_imports(doc: str) -> None:
    modules = set(re.findall(r"`(nftproxy(?:\.[a-z_0-9]+)+)`", (ROOT / doc).read_text()))
    missing = sorted(m for m in modules if importlib.util.find_spec(m) is None)
    assert missing == []


def test_the_check_tells_a_gone_name_from_a_living_one() -> None:
    assert _named("`dispatch-tcp-a-3` `service-ips` `pick-vip-a` `dispatch-<proto>-<N>`") == [
        "dispatch-tcp-a-3", "service-ips", "pick-vip-a", "dispatch-tcp-3"]
    assert [_is_ours(n) for n in ("dispatch-tcp-a-3", "service-ips", "pick-vip-a")] == [
        False, True, False]
