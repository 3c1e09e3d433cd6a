"""nftproxy/bare_packages.py: packages put in place without their __init__.

Aspects: a registered package's submodules import and its __init__ never
runs (a subpackage is bound to its parent, as an import binds it); a
package imported before is left as it is; a name that is not an installed
package is an ImportError. The import state is the process's, so each case
runs in a fresh interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import pytest


def in_fresh_interpreter(code: str, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What `code`, run by a new Python (with `env`, else this one's), prints
    as JSON: the import state is the process's (tests/test_pyroute2_modules.py
    and tests/test_kube_tls.py use it too)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=env)
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def test_a_registered_package_imports_its_submodules_without_its_init() -> None:
    result = in_fresh_interpreter("""
import json, sys
before = "kubernetes" in sys.modules
from nftproxy.bare_packages import register
register("kubernetes", "kubernetes.config")
from kubernetes.config.config_exception import ConfigException
kubernetes, config = sys.modules["kubernetes"], sys.modules["kubernetes.config"]
print(json.dumps({"before": before, "exception": ConfigException.__name__,
                  "bound": kubernetes.config is config,
                  "init_names": [hasattr(kubernetes, "watch"),
                                 hasattr(config, "load_kube_config")]}))
""")
    assert result == {"before": False, "exception": "ConfigException", "bound": True,
                      "init_names": [False, False]}


def test_a_package_imported_before_is_left_as_it_is() -> None:
    result = in_fresh_interpreter("""
import json, sys
import kubernetes
before = sys.modules["kubernetes"], sys.modules["kubernetes.config"]
from nftproxy.bare_packages import register
register("kubernetes", "kubernetes.config")
print(json.dumps({"same": (sys.modules["kubernetes"], sys.modules["kubernetes.config"]) == before,
                  "names": hasattr(kubernetes.config, "load_kube_config")}))
""")
    assert result == {"same": True, "names": True}


@pytest.mark.parametrize("name", ["colorsys", "no_such_package_for_nftproxy"])
def test_only_an_installed_package_is_registered(name: str) -> None:
    """A module (not a package), or nothing installed: an ImportError, and
    nothing registered."""
    result = in_fresh_interpreter(f"""
import json, sys
from nftproxy.bare_packages import register
before = {name!r} in sys.modules
try:
    register({name!r})
    error = None
except ImportError as exc:
    error = str(exc)
print(json.dumps({{"before": before, "error": error, "after": {name!r} in sys.modules}}))
""")
    assert result == {"before": False, "error": f"{name} is not an installed package",
                      "after": False}
