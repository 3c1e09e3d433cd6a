"""constraints.txt: the exact versions scripts/setup.sh (and so the image)
installs.

Aspects: every package nftproxy[test] needs, transitively, is pinned with
`==` exactly once; the pins are what the venv holds; scripts/setup.sh
installs with `--constraint constraints.txt` and reinstalls when the file
changes; pyproject.toml keeps ranges (the pins live in one place).
"""

from __future__ import annotations

import importlib.metadata as md
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict[str, str]:
    found: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and version and " " not in line, f"not an exact pin: {line!r}"
        assert canonical(name) not in found, f"pinned twice: {name}"
        found[canonical(name)] = version
    return found


def needed() -> dict[str, str]:
    """Installed version of every distribution nftproxy[test] requires, transitively."""
    out: dict[str, str] = {}
    todo: list[tuple[str, set[str]]] = [("nftproxy", {"test"})]
    while todo:
        name, extras = todo.pop()
        if canonical(name) in out:
            continue
        dist = md.distribution(name)
        out[canonical(name)] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            if any(req.marker is None or req.marker.evaluate({"extra": e})
                   for e in (extras or {""})):
                todo.append((req.name, set(req.extras)))
    out.pop("nftproxy")
    return out


def test_every_dependency_is_pinned_at_the_installed_version() -> None:
    wanted, pinned = needed(), pins()
    assert len(wanted) > 10
    unpinned = sorted(set(wanted) - set(pinned))
    assert unpinned == [], f"installed but not pinned in constraints.txt: {unpinned}"
    differs = {n: (pinned[n], v) for n, v in wanted.items() if pinned[n] != v}
    assert differs == {}, f"constraints.txt (pinned, installed) differ: {differs}"


def test_setup_installs_with_the_constraints() -> None:
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert re.search(r'pip" install .*\\\n\s+--constraint "\$here/constraints\.txt"', setup)
    assert '"$here/constraints.txt" | sha256sum' in setup  # a new pin reinstalls


def test_pyproject_keeps_ranges() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    assert not [r for r in requirements if "==" in r]
