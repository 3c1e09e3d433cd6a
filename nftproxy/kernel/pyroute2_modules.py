"""pyroute2's modules, imported without the package's __init__.

Layer: kernel (edge; imports nothing of nftproxy). One job: import the
pyroute2 modules the agent uses -- `module("pyroute2.conntrack")` -- without
running `pyroute2/__init__.py`, which imports every module of the library
(IPDB, NDB, IPVS, nl80211, WireGuard, Plan 9, ...) to export their names:
10.7 MB of RSS and ~90 ms for an agent that opens conntrack and rtnetlink
sockets, whose modules alone take 5.3 MB and ~50 ms (pyroute2 0.9.7,
Python 3.11; bench/RESULTS.md, twentieth pass).

How: while pyroute2 is not imported, its package is registered from its
spec without being executed, so importing a submodule finds the package's
path and loads only what that submodule needs (pyroute2's modules import
its subpackages, `config`, `netns`, `protocols`, never a name its __init__
defines). From then on `pyroute2` in this process is that bare package:
take a name from its module (`from pyroute2.iproute import IPRoute`), as
this project does everywhere, not from the package. If pyroute2 was
imported before, nothing changes.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType

__all__ = ["module"]

_PACKAGE = "pyroute2"


def module(name: str) -> ModuleType:
    """The pyroute2 module `name` (e.g. "pyroute2.conntrack"), imported
    without the package's __init__ unless that already ran."""
    if not name.startswith(_PACKAGE + "."):
        raise ValueError(f"not a pyroute2 module: {name!r}")
    if _PACKAGE not in sys.modules:
        spec = importlib.util.find_spec(_PACKAGE)
        if spec is None or spec.submodule_search_locations is None:
            raise ImportError(f"{_PACKAGE} is not installed", name=_PACKAGE)
        sys.modules[_PACKAGE] = importlib.util.module_from_spec(spec)
    return importlib.import_module(name)
