"""SIGKILL during the first full commit (issue 13, "Faults" a).

`nftproxy run --source` (2,000 Services) runs as a process in a throwaway
namespace while another process lists the ruleset again and again; it is
killed with SIGKILL at points spread around its first full commit (timed
from a first, uninterrupted run's log). Every listing shows traffic either
no table or the complete one -- what one `nftproxy sync` builds -- never
half of it (the tables are built unhooked and hooked in one transaction),
and a restart converges to the complete table, whatever the kill left.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from faults import (
    CIDRS,
    NODE,
    AgentProcess,
    ServiceWatcher,
    Watcher,
    big_cluster,
    counts,
    drop_tables,
    tables,
)

from nftproxy.tools.sandbox.probe import subprocess_env


def _sync_once(netns: str, path: Path) -> None:
    subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-m", "nftproxy", "sync",
                    "--source", str(path), "--node-name", NODE, "--cluster-cidr", CIDRS[0]],
                   check=True, capture_output=True, env=subprocess_env())


def test_a_sigkill_during_the_first_full_commit_never_shows_half_a_table(
    netns: str, tmp_path: Path
) -> None:
    """The first full sync onto absent tables commits the skeleton without
    its base chains, then the services in chunks of ~2,000 endpoints, then
    the base chains in one transaction (agent/chunked.py). So what traffic
    reaches in a listing is nothing or the complete tables, never a part;
    an agent killed in between leaves an unhooked table at most, and its
    restart converges."""
    path = tmp_path / "cluster.json"
    big_cluster(path, 2000)
    _sync_once(netns, path)
    want, complete = tables(netns), counts(netns)  # what one full sync builds
    # 2,000 x (cluster IP, dispatch element, 2 endpoints, the local one's hairpin pair)
    assert complete["ip"] is not None and complete["ip"][3] >= 10000
    drop_tables(netns)

    # When does the first full commit run, counted from "agent started"
    # (with the listings going on, which slow it down)?
    with Watcher(netns):
        calibration = AgentProcess(netns, path)
        started, _ = calibration.wait_line("agent started")
        synced, line = calibration.wait_line(" synced ")
        calibration.stop(signal.SIGTERM)
    match = re.search(r"commit_ms=([\d.]+)", line)
    assert match, line
    commit = float(match.group(1)) / 1000
    window = (synced - started - commit, synced - started)

    outcomes = []
    runs = 4
    for k in range(runs):
        drop_tables(netns)
        at = max(0.0, window[0] - 0.3 + (window[1] - window[0] + 0.6) * k / (runs - 1))
        with Watcher(netns) as watcher, ServiceWatcher(netns) as shapes:
            agent = AgentProcess(netns, path)
            try:
                agent.wait_line("agent started")
                time.sleep(at)
            finally:
                assert agent.stop(signal.SIGKILL) == -signal.SIGKILL
            time.sleep(0.3)
        outcomes.append(counts(netns) == complete)
        assert watcher.seen and shapes.seen, "the watchers saw nothing"
        nothing = {"ip": None, "ip6": None}
        partial = [seen for seen in watcher.seen if seen not in (nothing, complete)]
        assert not partial, f"a listing showed part of the tables: {partial[:3]}"
        half = [(ip, shape) for seen in shapes.seen if seen for ip, shape in seen.items()
                if shape != (2, 1)]
        assert not half, f"a listing showed half a service: {half[:3]}"

        restarted = AgentProcess(netns, path)  # converges, whatever the kill left
        try:
            restarted.wait_line(" synced ")
            assert tables(netns) == want
        finally:
            assert restarted.stop(signal.SIGTERM) == 0
    print(f"\n(a) first full commit {commit * 1000:.0f} ms, "
          f"{window[0]:.2f}-{window[1]:.2f}s after start; {runs} SIGKILLs around it: "
          f"table complete after {sum(outcomes)}, not yet after {runs - sum(outcomes)}; "
          "every listing seen showed no table or the complete one, every restart converged")
