"""README.md and the operator docs: commands and links that work from a checkout.

Aspects: README's shell commands run as root as written (no `sudo`); every
Markdown link in README.md, deploy/README.md, docs/config.md and
docs/metrics.md points inside the repository, at a file that exists.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "deploy/README.md", "docs/config.md", "docs/metrics.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def shell_lines(text: str) -> list[str]:
    blocks = re.findall(r"```(?:sh|bash)\n(.*?)```", text, flags=re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_readme_commands_need_no_sudo() -> None:
    lines = shell_lines((ROOT / "README.md").read_text())
    assert any(line.startswith("bash scripts/demo.sh") for line in lines)
    assert any(line.startswith("bash scripts/test.sh") for line in lines)
    assert [line for line in lines if re.search(r"(^|[;&|]\s*)sudo\b", line)] == []


@pytest.mark.parametrize("doc", DOCS)
def test_links_stay_in_the_repository_and_resolve(doc: str) -> None:
    path = ROOT / doc
    for target in LINK.findall(path.read_text()):
        assert "://" not in target, f"{doc}: link outside the repository: {target}"
        file = target.split("#", 1)[0]
        if file:
            resolved = (path.parent / file).resolve()
            assert resolved.exists(), f"{doc}: broken link {target}"
            assert ROOT in resolved.parents, f"{doc}: {target} leaves the repository"
