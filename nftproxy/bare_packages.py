"""Third-party packages put in place without running their __init__.

Layer: edge helper (imports nothing of nftproxy). One job: `register`
puts each named package in `sys.modules` from its spec without executing
its `__init__.py`, unless it is imported already. Importing one of its
submodules then loads only what that submodule needs.

Why: two libraries the agent uses import far more from their package
`__init__` than the agent needs, which costs start time and memory
(bench/RESULTS.md, "What moved the numbers"):
- pyroute2 exports every one of its 163 modules (kernel/pyroute2_modules.py);
- kubernetes imports its dynamic client, watch, stream, leader election
  and kubeconfig loader, and through that loader requests, requests-oauthlib
  and oauthlib (cluster/__init__.py).

A registered package is bare from then on, in the whole process: take a
name from the module that defines it (`from kubernetes.client.exceptions
import ApiException`), never from the package.
"""

from __future__ import annotations

import importlib.util
import sys

__all__ = ["register"]


def register(*packages: str) -> None:
    """Register each of `packages`, outermost first ("kubernetes",
    "kubernetes.config"), without executing it; one already imported is
    left as it is. Raises ImportError for a name that is not an installed
    package."""
    for name in packages:
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None or spec.submodule_search_locations is None:
            raise ImportError(f"{name} is not an installed package", name=name)
        package = importlib.util.module_from_spec(spec)
        sys.modules[name] = package
        parent, _, child = name.rpartition(".")
        if parent:  # as an import binds a submodule to its parent
            setattr(sys.modules[parent], child, package)
