"""kernel/pyroute2_modules.py: pyroute2's modules without the package's __init__.

Aspects: the agent's modules load, and the library's others do not (its
__init__ would import IPDB, NDB, nl80211 ...); names are then taken from
their modules; a pyroute2 imported before is left as it is; only pyroute2
modules are asked for. Each case runs in a fresh interpreter (the import
state is the process's).
"""

from __future__ import annotations

import pytest
from test_bare_packages import in_fresh_interpreter

from nftproxy.kernel import pyroute2_modules

_AGENTS = ("pyroute2.conntrack", "pyroute2.iproute",
           "pyroute2.netlink.nfnetlink.nfctsocket", "pyroute2.netlink.exceptions")


def test_the_agents_modules_load_without_the_rest_of_the_library() -> None:
    result = in_fresh_interpreter(f"""
import json, sys
from nftproxy.kernel.pyroute2_modules import module
classes = [module("pyroute2.conntrack").Conntrack.__name__,
           module("pyroute2.iproute").IPRoute.__name__]
for name in {list(_AGENTS)!r}:
    module(name)
from pyroute2.iproute import IPRoute  # a name, from its module
loaded = sorted(m for m in sys.modules if m.startswith("pyroute2"))
print(json.dumps({{"classes": classes, "loaded": loaded,
                   "package_names": hasattr(sys.modules["pyroute2"], "IPRoute")}}))
""")
    assert result["classes"] == ["Conntrack", "IPRoute"]
    loaded = result["loaded"]
    assert isinstance(loaded, list)
    assert set(_AGENTS) <= set(loaded)
    for other in ("pyroute2.ipdb", "pyroute2.ndb.main", "pyroute2.netlink.nl80211",
                  "pyroute2.netlink.generic.wireguard", "pyroute2.plan9.client"):
        assert other not in loaded
    assert result["package_names"] is False  # the package's __init__ never ran


def test_a_pyroute2_imported_before_is_left_as_it_is() -> None:
    result = in_fresh_interpreter("""
import json, sys
import pyroute2
before = sys.modules["pyroute2"]
from nftproxy.kernel.pyroute2_modules import module
conntrack = module("pyroute2.conntrack")
print(json.dumps({"same": sys.modules["pyroute2"] is before,
                  "names": hasattr(sys.modules["pyroute2"], "IPRoute"),
                  "class": conntrack.Conntrack is pyroute2.Conntrack}))
""")
    assert result == {"same": True, "names": True, "class": True}


def test_only_pyroute2_modules_are_asked_for() -> None:
    with pytest.raises(ValueError, match="not a pyroute2 module"):
        pyroute2_modules.module("json")
