"""bindAddressHardFail: a health or metrics server that cannot bind.

Aspects: with the setting on (config field or --bind-address-hard-fail) the
agent does not start and says which server and why; off (kube-proxy's
default) it logs and runs without that server (test_agent.py checks the
log line).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s import node

from nftproxy.agent.agent import Agent, Source
from nftproxy.cluster.events import ClusterEvents
from nftproxy.cluster.file import FileSource, WatchedFiles
from nftproxy.core.config import ProxyConfig
from nftproxy.kernel.fake import FakeBackend

NODE = "node-a"


@pytest.fixture
def taken() -> Iterator[str]:
    """An address something else listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield f"127.0.0.1:{s.getsockname()[1]}"


def agent(tmp_path: Path, **settings: Any) -> Agent:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(node(NODE, ["192.168.50.1"])))
    config = ProxyConfig(node_name=NODE, min_sync_period=0.0, **settings)

    def source_factory(handler: ClusterEvents) -> Source:
        return WatchedFiles(FileSource([path], handler, node_name=NODE, poll_interval=0.01))

    return Agent(config, backend=FakeBackend(), source_factory=source_factory)


@pytest.mark.parametrize("server", ["healthz_bind_address", "metrics_bind_address"])
def test_a_server_that_cannot_bind_stops_the_agent_with_hard_fail(
    tmp_path: Path, taken: str, server: str
) -> None:
    other = "metrics_bind_address" if server == "healthz_bind_address" else "healthz_bind_address"
    a = agent(tmp_path, bind_address_hard_fail=True, **{server: taken, other: ""})
    try:
        with pytest.raises(OSError, match=r"cannot serve (health|metrics): "):
            a.start()
    finally:
        a.stop()


def test_without_hard_fail_the_agent_runs_without_the_server(tmp_path: Path, taken: str) -> None:
    a = agent(tmp_path, metrics_bind_address=taken, healthz_bind_address="")
    try:
        a.start()
        assert a.synced.wait(10)
    finally:
        a.stop()
