"""Multi-node scenarios without VMs: two nodes, each a network namespace with
its own nftproxy Agent (NftBackend and tables in that namespace, KubeSource
against one API server), pods behind each node, an external client, all on
one LAN bridge (nftproxy.tools.sandbox.cluster, vmtests/netns_driver.py).

The scenarios are vmtests/scenarios.py, the same code the VM cluster runs
(vmtests/run.py --mode vm); their docstring lists every aspect:
cross-node ClusterIP traffic, NodePort on one node reaching pods on the
other (masqueraded), eTP=Local (only local endpoints, source preserved, drop
without them), healthCheckNodePort 200/503 per node, a node losing all its
endpoints, and both agents converging after one is restarted mid-churn while
a client's traffic keeps flowing.

One cluster per module (about 0.5 s to build); each scenario first resets
the API to the base state and waits until both nodes programmed it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import kernel
import pytest

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:  # vmtests/ lives next to tests/
    sys.path.insert(0, _ROOT)

from vmtests import netns_driver, scenarios  # noqa: E402

pytestmark = pytest.mark.kernel


@pytest.fixture(scope="module")
def driver() -> Iterator[netns_driver.NetnsDriver]:
    kernel.require_root()
    with netns_driver.running() as d:
        yield d


@pytest.mark.parametrize("scenario", scenarios.SCENARIOS, ids=lambda s: s.name)
def test_scenario(driver: netns_driver.NetnsDriver, scenario: scenarios.Scenario) -> None:
    result = scenarios.run_scenario(scenario, driver)
    assert result.ok, result.error
    assert set(driver.agents) == {"node-a", "node-b"}, "every agent runs after a scenario"
