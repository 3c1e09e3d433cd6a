"""Helpers for tests that need the real kernel (marked `kernel`).

Layer: tests. One job: throwaway network namespaces that are always deleted,
the leak check behind them, and small readers (nft text, normalised
listings) shared by the kernel tests. The host is only ever *read*
(`nft list tables`); every write happens inside a namespace made here.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest

from nftproxy.kernel import netns

__all__ = [
    "NETNS_PREFIX",
    "canonical",
    "fresh_netns",
    "host_nft",
    "leaked_namespaces",
    "namespaces",
    "nft",
    "normalize",
    "require_root",
    "unique_name",
]

NETNS_PREFIX = "nftpx-t"
"""Test namespaces are `nftpx-t-<pid>-<hex>` (netns.temporary)."""


def require_root() -> None:
    """Kernel tests fail (never skip) when they cannot run."""
    if os.geteuid() != 0:
        pytest.fail("kernel test needs root (network namespaces, nftables)", pytrace=False)


@contextlib.contextmanager
def fresh_netns(prefix: str = NETNS_PREFIX) -> Iterator[str]:
    """A new namespace for the body; deleted afterwards, whatever happens."""
    require_root()
    with contextlib.ExitStack() as stack:
        try:
            name = stack.enter_context(netns.temporary(prefix))
        except (OSError, subprocess.SubprocessError) as exc:
            pytest.fail(f"cannot create a network namespace: {exc}", pytrace=False)
        yield name


def namespaces() -> set[str]:
    """Names under /run/netns right now."""
    try:
        return {p.name for p in netns.NETNS_DIR.iterdir()}
    except FileNotFoundError:
        return set()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def leaked_namespaces(before: set[str]) -> list[str]:
    """`nftpx-` namespaces that appeared since `before` and belong to this
    process or to a process that has ended (`<prefix>-<pid>-<hex>`).
    Those of other live processes (a concurrent test run) are not ours."""
    leaked = []
    for name in sorted(namespaces() - before):
        if not name.startswith("nftpx-"):
            continue
        parts = name.rsplit("-", 2)
        pid = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None
        if pid is not None and pid != os.getpid() and _pid_alive(pid):
            continue
        leaked.append(name)
    return leaked


def unique_name(prefix: str = "nftpxt") -> str:
    """A table name nothing else uses (visible in host checks if leaked)."""
    return f"{prefix}{secrets.token_hex(4)}"


def nft(ns: str, *args: str, stdin: str | None = None) -> str:
    """`nft args...` inside namespace `ns`; its stdout."""
    out: str = netns.exec_in(ns, ["nft", *args], input=stdin).stdout
    return out


def host_nft(*args: str) -> str:
    """Read-only `nft` in the host namespace (only list commands!)."""
    if not args or args[0] != "list":
        raise ValueError("the host ruleset is read-only for tests")
    proc = subprocess.run(["nft", *args], capture_output=True, text=True, check=True)
    return proc.stdout


def normalize(doc: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """A listing without handles and with set elements sorted, so the kernel
    (hash order, its own handle numbering) and FakeBackend compare equal."""
    if doc is None:
        return None
    out = []
    for item in doc["nftables"]:
        ((kind, obj),) = item.items()
        obj = {k: v for k, v in obj.items() if k != "handle"}
        if "elem" in obj:
            obj["elem"] = sorted(obj["elem"], key=lambda e: json.dumps(e, sort_keys=True))
        out.append({kind: obj})
    return out


def canonical(doc: dict[str, Any] | None) -> dict[str, Any] | None:
    """A listing compared by content: chains, rules in order, sets with sorted
    elements; handles and listing order ignored."""
    if doc is None:
        return None
    chains: dict[str, Any] = {}
    rules: dict[str, list[Any]] = defaultdict(list)
    sets: dict[str, Any] = {}
    for item in doc["nftables"]:
        ((kind, obj),) = item.items()
        if kind == "chain":
            chains[obj["name"]] = [obj.get(k) for k in ("type", "hook", "prio", "policy")]
        elif kind == "rule":
            rules[obj["chain"]].append(
                [json.dumps(obj["expr"], sort_keys=True), obj.get("comment")]
            )
        elif kind in ("set", "map"):
            elems = sorted(json.dumps(e, sort_keys=True) for e in obj.get("elem", []))
            sets[obj["name"]] = [
                kind,
                obj.get("type"),
                obj.get("map"),
                obj.get("flags"),
                obj.get("timeout"),
                elems,
            ]
    return {"chains": chains, "rules": dict(rules), "sets": sets}


@contextlib.contextmanager
def json_backend(ns: str) -> Iterator[Any]:
    """A started NftBackend in `ns` that prints JSON, or None where this
    libnftables cannot take it (1.0.6: its JSON declares no set by typeof),
    once its refusal to start is checked."""
    from nftproxy.core.nft.errors import NftUnavailable
    from nftproxy.kernel.libnftables import NftBackend

    with NftBackend(netns=ns) as probe:
        takes_json = probe.accepts_typeof()
    backend = NftBackend(netns=ns, syntax="json")
    if not takes_json:
        with pytest.raises(NftUnavailable):
            backend.start()
        yield None
        return
    with backend:
        yield backend
