"""Links and file references in the repository's documents resolve inside it.

Aspects, for README.md, docs/*.md, deploy/**/*.md, bench/**/*.md and
pyproject.toml, one test per document (a failure names the document, and
the line and text of every reference that does not resolve):
- a Markdown link (inline `[text](target)`, image, reference definition
  `[label]: target`, or an HTML href/src) with a relative target names a
  file or directory that exists, relative to the document (`/x` from the
  repository's root); its #anchor is stripped; http(s)/mailto URLs and
  anchor-only links are skipped;
- a path in backticks or in a fenced code block (`bench/cold_sync.py`,
  `nftproxy/agent/proxier.py`, `docs/config.md`, or package-relative as
  the docs write them, `core/nft/plan.py`) exists, from the repository's
  root, the document's directory or nftproxy/. A path counts only if its
  first part is something there (so `kubernetes/__init__.py` or upstream's
  `pkg/proxy/...` are not ours to check); one under a gitignored
  directory (`bench/out/`) is skipped, and so are placeholders (`<name>`,
  `*`);
- a bare file name in backticks with a source or document suffix
  (`setup.sh`, `RESULTS.md`) names a file somewhere in the repository;
- pyproject.toml, which has no Markdown: every path or file name of those
  suffixes in it (comments included) resolves the same way.
The checker itself is shown to flag what it must and to pass what it must
not (a sample document).
"""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nftproxy"
SUFFIXES = ("md", "py", "toml", "sh", "yaml", "yml", "json", "jsonl", "txt")


def documents() -> list[str]:
    found = [ROOT / "README.md", ROOT / "pyproject.toml"]
    found += sorted((ROOT / "docs").glob("*.md"))
    found += sorted((ROOT / "deploy").rglob("*.md"))
    found += sorted(p for p in (ROOT / "bench").rglob("*.md") if not ignored(p.relative_to(ROOT)))
    return [str(p.relative_to(ROOT)) for p in found if p.is_file()]


@cache
def ignored_prefixes() -> tuple[str, ...]:
    """.gitignore's directory entries (`bench/out/`, `.venv/`): what a checkout
    may not have."""
    lines = (ROOT / ".gitignore").read_text().splitlines()
    return tuple(
        line.strip().lstrip("/")
        for line in lines
        if line.strip().endswith("/") and not line.startswith(("#", "!")) and "*" not in line
    )


def ignored(relative: Path | str) -> bool:
    text = str(relative).lstrip("./")
    return any(text == p.rstrip("/") or text.startswith(p) or f"/{p}" in f"/{text}"
               for p in ignored_prefixes())  # fmt: skip


@cache
def file_names() -> frozenset[str]:
    """The name of every file in the repository (tracked or not yet added)."""
    done = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode == 0 and done.stdout:
        return frozenset(Path(line).name for line in done.stdout.splitlines()
                         if (ROOT / line).exists())  # fmt: skip
    return frozenset(p.name for p in ROOT.rglob("*")
                     if p.is_file() and not ignored(p.relative_to(ROOT)))  # fmt: skip


# ---- what a document refers to --------------------------------------------------------

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_LINK = re.compile(
    r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+[\"'(][^)]*)?\)"
)
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_TARGET = re.compile(r"""\b(?:href|src)\s*=\s*["']([^"']+)["']""")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.\-]*://\S+")
PATH_TOKEN = re.compile(r"[A-Za-z0-9_.][\w.\-/]*")
# in running text: a path with a known suffix, or a document's bare name (DESIGN.md)
TEXT_PATH = re.compile(
    r"(?<![\w/.\-])(?:(?:[\w.\-]+/)+[\w.\-]*\w\.(?:" + "|".join(SUFFIXES) + r")"
    r"|[\w.\-]*\w\.md)(?![\w/\-])"
)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*:")


def references(text: str, markdown: bool = True) -> list[tuple[int, str, str]]:
    """(line, kind, reference) for every link target and path outside code
    blocks: "link" targets resolve from the document, "path"s as the docs
    write them."""
    found: list[tuple[int, str, str]] = []
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if not markdown:
            found += [(number, "path", m[0]) for m in TEXT_PATH.finditer(URL.sub(" ", line))]
            continue
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:  # examples and commands: not references
            continue
        spans = [m[2].strip() for m in CODE_SPAN.finditer(line)]
        found += [(number, "path", span) for span in spans if span and not span.split()[1:]]
        prose = CODE_SPAN.sub(" ", line)  # a link in backticks is text
        for pattern in (INLINE_LINK, REFERENCE_DEFINITION, HTML_TARGET):
            found += [(number, "link", m[1].strip("<>")) for m in pattern.finditer(prose)]
            prose = pattern.sub(" ", prose)
        found += [(number, "path", m[0]) for m in TEXT_PATH.finditer(URL.sub(" ", prose))]
    return found


def link_problem(target: str, doc: Path) -> bool:
    """Does this link target fail to resolve? (False for what is not ours to check.)"""
    if not target or target.startswith("#") or SCHEME.match(target):
        return False
    path = re.split(r"[#?]", target, maxsplit=1)[0]
    if not path:
        return False
    path = path.replace("%20", " ")
    resolved = (ROOT / path.lstrip("/")) if path.startswith("/") else (doc.parent / path)
    resolved = resolved.resolve()
    if not resolved.is_relative_to(ROOT):
        return True
    return not resolved.exists() and not ignored(resolved.relative_to(ROOT))


def path_problem(token: str, doc: Path) -> bool:
    """Does this path name something of ours that is not there? A module may
    be named without its .py (`agent/intake`), a test with its node id."""
    token = re.split(r"[#:]", token.strip("\"'()[],;"), maxsplit=1)[0].rstrip(".")
    if token.startswith("./"):
        token = token[2:]
    if not PATH_TOKEN.fullmatch(token) or ".." in token.split("/"):
        return False
    bases = (ROOT, doc.parent, PACKAGE)
    if "/" not in token:
        if not token.endswith(".md"):
            return False
        return not any((base / token).exists() for base in bases) and token not in file_names()
    first = token.split("/")[0]
    ours = [base for base in bases if first and (base / first).exists()]
    if not ours or ignored(token):
        return False
    return not any((base / token).exists() or (base / f"{token}.py").exists() for base in ours)


def problems(text: str, doc: Path) -> list[str]:
    markdown = doc.suffix == ".md"
    out = []
    for number, kind, ref in references(text, markdown):
        broken = link_problem(ref, doc) if kind == "link" else path_problem(ref, doc)
        if broken:
            out.append(f"line {number}: {ref}")
    return list(dict.fromkeys(out))


# ---- the tests ----------------------------------------------------------------------


@pytest.mark.parametrize("doc", documents())
def test_every_reference_resolves_inside_the_repository(doc: str) -> None:
    path = ROOT / doc
    found = problems(path.read_text(), path)
    assert not found, f"{doc}: references that do not resolve inside the repository:\n" + "\n".join(
        found
    )


def test_the_documents_checked_include_each_kind() -> None:
    docs = documents()
    assert {"README.md", "pyproject.toml", "docs/architecture.md", "deploy/README.md",
            "bench/RESULTS.md"} <= set(docs)  # fmt: skip


def test_the_checker_flags_what_does_not_resolve_and_only_that() -> None:
    sample = "\n".join([
        "[ok](../README.md#top) [anchor](#here) [web](https://example.org/x.md)",  # 1: none
        "[gone](missing.md) ![img](../nope/pic.png)",  # 2: two
        "[def]: ../bench/nothing_here.py",  # 3: one
        "`bench/run_all.sh`, `core/render.py`, `docs/userspaces.md#x`, `agent/intake`",  # 4
        "`bench/no_such.py` and `core/nft/no_such.py`",  # 5: two
        "`kubernetes/__init__.py` `pkg/proxy/iptables/proxier.go` `bench/out/x.jsonl`",  # 6
        "`bench/results/<name>.jsonl` `nftproxy/examples/*.yaml` `/proc/1/statm` "
        "`tests/test_doc_links.py::test_x`",  # 7: none
        "`setup.sh`, `DESIGN.md`; in text DESIGN.md §5, docs/gone.md, core/nft/no_such.py",  # 8
        "`sudo bash bench/gone.py --x` is a command, not a path",  # 9: none
        "```sh",
        "python bench/gone.py overlays/prod",  # 11: an example, not checked
        "```",
        "[missing](missing.md) in `[missing](missing.md)` twice",  # 13: one, once
        "see https://github.com/x/y/blob/main/DESIGN.md and bench/README.md",  # 14: none
    ])  # fmt: skip
    found = problems(sample, ROOT / "docs" / "sample.md")
    assert found == [
        "line 2: missing.md",
        "line 2: ../nope/pic.png",
        "line 3: ../bench/nothing_here.py",
        "line 5: bench/no_such.py",
        "line 5: core/nft/no_such.py",
        "line 8: DESIGN.md",
        "line 8: docs/gone.md",
        "line 8: core/nft/no_such.py",
        "line 13: missing.md",
    ], found
    toml = '# (DESIGN.md §5), (cluster/rest.py)\nreadme = "README.md"\nx = "docs/gone.md"\n'
    assert problems(toml, ROOT / "pyproject.toml") == ["line 1: DESIGN.md", "line 3: docs/gone.md"]
