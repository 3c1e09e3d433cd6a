"""nftproxy.kernel.netns against the real kernel.

Aspects: a temporary namespace exists during the body and is gone after it,
also after an exception or KeyboardInterrupt; run_in really runs inside the
namespace (and returns results / raises errors); exec_in and sysctl act in
the namespace only; a missing namespace is an error, never created.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from nftproxy.kernel import netns as netns_lib


def _thread_netns_inode() -> int:
    return os.stat("/proc/thread-self/ns/net").st_ino


@pytest.mark.kernel
def test_temporary_namespace_exists_only_inside_the_block() -> None:
    with netns_lib.temporary("nftpx-t") as name:
        assert name.startswith(f"nftpx-t-{os.getpid()}-")
        assert netns_lib.exists(name)
    assert not netns_lib.exists(name)


@pytest.mark.kernel
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt], ids=["exception", "ctrl-c"])
def test_temporary_namespace_is_deleted_when_the_block_raises(error: type[BaseException]) -> None:
    seen: list[str] = []
    with pytest.raises(error), netns_lib.temporary("nftpx-t") as name:
        seen.append(name)
        raise error("boom")
    assert seen
    assert not netns_lib.exists(seen[0])


def test_run_in_runs_on_a_thread_inside_the_namespace(netns: str) -> None:
    inside = netns_lib.run_in(netns, _thread_netns_inode)
    assert inside == os.stat(f"/run/netns/{netns}").st_ino
    assert inside != _thread_netns_inode(), "the caller's thread must stay where it was"


def test_run_in_passes_arguments_and_returns_the_result(netns: str) -> None:
    assert netns_lib.run_in(netns, lambda a, b: a + b, 2, 3) == 5
    # a fresh namespace has only lo, and create() brought it up
    assert netns_lib.run_in(netns, socket.if_nameindex) == [(1, "lo")]


def test_run_in_propagates_the_exception(netns: str) -> None:
    def fail() -> None:
        raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        netns_lib.run_in(netns, fail)


@pytest.mark.kernel
def test_run_in_a_missing_namespace_fails_without_creating_it() -> None:
    name = f"nftpx-t-missing-{os.getpid()}"
    with pytest.raises(netns_lib.NetnsError):
        netns_lib.run_in(name, lambda: None)
    assert not netns_lib.exists(name)


def test_exec_in_runs_the_command_in_the_namespace(netns: str) -> None:
    links = netns_lib.exec_in(netns, ["ip", "-o", "link", "show"]).stdout
    assert [line.split(":")[1].strip() for line in links.splitlines()] == ["lo"]
    proc = netns_lib.exec_in(netns, ["false"], check=False)
    assert proc.returncode == 1


def test_sysctl_changes_the_namespace_only(netns: str) -> None:
    host_before = Path("/proc/sys/net/ipv4/ip_forward").read_text()
    netns_lib.sysctl(netns, "net.ipv4.ip_forward", 1)
    inside = netns_lib.exec_in(netns, ["cat", "/proc/sys/net/ipv4/ip_forward"]).stdout
    assert inside.strip() == "1"
    assert Path("/proc/sys/net/ipv4/ip_forward").read_text() == host_before


def test_sysctl_refuses_keys_that_are_not_per_namespace(netns: str) -> None:
    with pytest.raises(ValueError):
        netns_lib.sysctl(netns, "kernel.hostname", "x")


def test_names_with_a_slash_are_refused() -> None:
    with pytest.raises(ValueError):
        netns_lib.exists("../etc")
