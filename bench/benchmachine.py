"""The machine and the nftables userspace next to every benchmark number.

Layer: bench tooling (not part of the nftproxy package; benchlib re-exports
it). One job: describe what a result was measured on -- kernel, CPU, cores,
memory, nft/libnftables/iptables/Python versions, load at start, the tree
measured -- and name the userspace (Debian release and libnftables version,
e.g. "trixie, libnftables 1.1.3") that benchlib.emit puts on every line.
"""

from __future__ import annotations

import functools
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["machine_info", "userspace"]

ROOT = Path(__file__).resolve().parents[1]


def _first(pattern: str, text: str) -> str:
    m = re.search(pattern, text, re.MULTILINE)
    return m.group(1).strip() if m else "?"


def _git() -> str:
    """The tree measured; NFTPROXY_BENCH_GIT when set (run_all.sh sets it for
    a userspace without git)."""
    if os.environ.get("NFTPROXY_BENCH_GIT"):
        return os.environ["NFTPROXY_BENCH_GIT"]
    try:
        rev = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", "nftproxy"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "?"
    return rev + ("+dirty(nftproxy/)" if dirty else "")


def machine_info() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    meminfo = Path("/proc/meminfo").read_text()
    try:
        nft = subprocess.run(["nft", "--version"], capture_output=True, text=True).stdout.strip()
    except OSError:
        nft = "?"
    try:
        ipt = subprocess.run(["iptables", "--version"], capture_output=True, text=True)
        iptables = ipt.stdout.strip()
    except OSError:
        iptables = "?"
    return {
        "kernel": platform.release(),
        "cpu": _first(r"^model name\s*:\s*(.*)$", cpuinfo),
        "cores": os.cpu_count(),
        "mem_gb": round(int(_first(r"^MemTotal:\s*(\d+)", meminfo)) / 1024 / 1024, 1),
        "nft": nft,
        "libnftables1": _libnftables_package(),
        "userspace": userspace(),
        "iptables": iptables,
        "python": platform.python_version(),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
        "loadavg_at_start": Path("/proc/loadavg").read_text().split()[0],
        "git": _git(),
    }


def _libnftables_package() -> str:
    """The installed libnftables1 package's version, e.g. 1.0.6-2+deb12u2."""
    try:
        return (
            subprocess.run(
                ["dpkg-query", "-W", "-f", "${Version}", "libnftables1"],
                capture_output=True,
                text=True,
            ).stdout.strip()
            or "?"
        )
    except OSError:
        return "?"


@functools.cache
def userspace() -> str:
    """The nftables userspace running this, e.g. "trixie, libnftables 1.1.3":
    the Debian release (/etc/os-release) and libnftables' upstream version."""
    release = _first(r"^VERSION_CODENAME=(.*)$", _read("/etc/os-release")).strip('"')
    version = _libnftables_package().split("-")[0].split(":")[-1]
    return f"{release}, libnftables {version}"


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""
