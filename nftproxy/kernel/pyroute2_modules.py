"""pyroute2's modules, imported without the package's __init__.

Layer: kernel (edge; imports only nftproxy/bare_packages.py). One job: import the
pyroute2 modules the agent uses -- `module("pyroute2.iproute")` -- without
running `pyroute2/__init__.py`, which imports every module of the library
(IPDB, NDB, IPVS, nl80211, WireGuard, Plan 9, ...) to export their names:
far more memory and import time than the modules an agent that opens
conntrack and rtnetlink sockets needs (bench/RESULTS.md, "What moved the
numbers").

How: the package is registered without being executed
(nftproxy/bare_packages.py), so importing a submodule loads only what that
submodule needs (pyroute2's modules import its subpackages, `config`,
`netns`, `protocols`, never a name its __init__ defines). From then on
`pyroute2` in this process is that bare package: take a name from its
module (`from pyroute2.iproute import IPRoute`), as this project does
everywhere, not from the package. If pyroute2 was imported before,
nothing changes.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from nftproxy.bare_packages import register

__all__ = ["module"]

_PACKAGE = "pyroute2"


def module(name: str) -> ModuleType:
    """The pyroute2 module `name` (e.g. "pyroute2.conntrack"), imported
    without the package's __init__ unless that already ran."""
    if not name.startswith(_PACKAGE + "."):
        raise ValueError(f"not a pyroute2 module: {name!r}")
    register(_PACKAGE)
    return importlib.import_module(name)
