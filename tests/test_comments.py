"""Comments and docstrings under nftproxy/ carry no measurements or pass histories.

A figure in a comment is stale the day the code changes; bench/RESULTS.md
holds the current ones, and git holds how they got there. One test per
module under nftproxy/ (a failure names file:line and the offending text):
- a comment (every `#` comment, consecutive comment lines read as one text)
  or a docstring (every string that stands alone as a statement: module,
  class and function docstrings, and a constant's own docstring) has no
  measured figure, a number with a unit of time, memory or share (`25 ms`,
  `0.25 us`, `743 MB`, `1.2 s`, `12%`, `2.1-3 s`);
- nor a pass history (`ruleset v9`, `the twentieth pass`, `pass 14`,
  `(bench/RESULTS.md, ... pass)`).
Allowed: version numbers (`libnftables 1.0.6`, `kernels < 6.2`), sizes
without such a unit ("names under 256 bytes"), declaration tables of
limits (a constant whose own comment or docstring states a limit: "the
kernel's dump batches are at most 32 KiB"), and the durations in SEMANTIC,
which are configuration, not measurement.
The checker itself is shown to flag what it must and to pass what it must
not (a sample module).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nftproxy"

_NUMBER = r"[~≈]?\d[\d,]*(?:\.\d+)?"
_RANGE = rf"{_NUMBER}(?:\s*(?:-|\u2013|→|->|/|to)\s*{_NUMBER})*"
# A bare "s", "h" or "min" needs a space before it, so that "410s" (HTTP 410
# answers) is no duration; "1.5s" with a decimal point is one.
_TIME = r"(?:\s*(?:ms|us|µs|ns|(?:milli|micro)?seconds?|minutes?|hours?)\b|\s+(?:s|h|min)\b)"
_UNIT = rf"(?:{_TIME}|\s*(?:[KkMG]B|[KMG]iB)\b|\s*%)"
MEASURED = re.compile(rf"(?<![\w.]){_RANGE}{_UNIT}|(?<![\w.])\d+\.\d+s\b")

_ORDINAL = (
    r"(?:twenty-|thirty-)?(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth"
    r"|tenth|eleventh|twelfth|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth"
    r"|eighteenth|nineteenth|twentieth|thirtieth)"
)
HISTORY = re.compile(
    r"\bruleset v\d+"
    rf"|\b{_ORDINAL}(?:\s+and\s+{_ORDINAL})?\s+pass(?:es)?\b"
    r"|\bpass(?:es)? \d+"
    r"|\(bench/RESULTS\.md[^)]*\bpass(?:es)?\b[^)]*\)",
    re.IGNORECASE,
)

# Durations that state what a setting means, not what something measured.
# Kept short on purpose: a new entry should name a configuration default or
# a protocol's value, never a result.
SEMANTIC = [
    # A default, a timeout or a backoff step beside its value: "the default
    # clientIP.timeoutSeconds (3 h)", "minSyncPeriod defaults to 1 s", "read
    # timeout 30 s", "2 s connect, 5 s read", "0.8 s initial, ... cap 30 s".
    re.compile(
        rf"(?i)\b(?:defaults?|timeouts?|cap)\b(?:[^.;()]|\.(?=\w)){{0,60}}?\(?{_RANGE}{_TIME}"
        rf"|{_RANGE}{_TIME}\s+(?:initial|connect|read|by default)\b"
    ),
    # A setting, by its camelCase or `code` name, right before its value:
    # "syncPeriod (30 s)", "max(minSyncPeriod, 1 s)", "`unreachable_max` (1 s)".
    re.compile(rf"(?:\b[a-z]+[A-Z]\w*|`\w+`)[\s,(]{{1,3}}{_RANGE}{_TIME}"),
    # A duration literal in Go's syntax, as configuration spells it: "250ms".
    re.compile(r"\"(?:\d+(?:\.\d+)?(?:h|m|s|ms|us|µs|ns))+\""),
]

# A declaration table of limits: a constant whose same-line comment or own
# docstring states a limit may give it in its unit ("at most 32 KiB").
LIMIT = re.compile(r"(?i)\b(?:at most|under|up to|limit|maximum|max)\b")
CONSTANT = re.compile(r"_?[A-Z][A-Z0-9_]*")


def constants(tree: ast.Module) -> tuple[set[int], set[int]]:
    """The lines of every constant's declaration (an UPPER_CASE name assigned
    in a module or class body), and the lines of their own docstrings."""
    lines: set[int] = set()
    docs: set[int] = set()
    for scope in ast.walk(tree):
        if not isinstance(scope, ast.Module | ast.ClassDef):
            continue
        for i, node in enumerate(scope.body):
            after = scope.body[i + 1] if i + 1 < len(scope.body) else None
            targets = (
                node.targets if isinstance(node, ast.Assign)
                else [node.target] if isinstance(node, ast.AnnAssign)
                else []
            )
            if not targets or not all(
                isinstance(t, ast.Name) and CONSTANT.fullmatch(t.id) for t in targets
            ):
                continue
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                docs.add(after.lineno)
    return lines, docs


def texts(source: str) -> list[tuple[int, str, bool]]:
    """Every comment block and docstring of a module, as (first line, text,
    whether it is a constant's own comment or docstring)."""
    tree = ast.parse(source)
    declared, declared_docs = constants(tree)
    found: list[tuple[int, str, bool]] = []
    block: list[str] = []
    start = last = 0
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        line = tok.start[0]
        trailing = bool(tok.line[: tok.start[1]].strip())  # a comment after code starts a block
        if block and line == last + 1 and not trailing:
            block.append(tok.string.lstrip("#"))
        else:
            if block:
                found.append((start, "\n".join(block), start in declared))
            block, start = [tok.string.lstrip("#")], line
        last = line
    if block:
        found.append((start, "\n".join(block), start in declared))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            found.append((node.lineno, node.value.value, node.lineno in declared_docs))
    return found


def offences(source: str) -> list[tuple[int, str]]:
    """(line, offending text) for every measured figure and pass history."""
    found = []
    for start, text, of_constant in texts(source):
        spared = [m.span() for pattern in SEMANTIC for m in pattern.finditer(text)]
        limit = of_constant and LIMIT.search(text) is not None
        for pattern in (HISTORY,) if limit else (MEASURED, HISTORY):
            for m in pattern.finditer(text):
                if any(a <= m.start() and m.end() <= b for a, b in spared):
                    continue
                line = start + text.count("\n", 0, m.start())
                context = text[max(0, m.start() - 30) : m.end() + 10].replace("\n", " ")
                found.append((line, f"{m.group(0)!r} in ...{' '.join(context.split())}..."))
    return sorted(found)


MODULES = sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("module", MODULES)
def test_no_figures_or_histories(module: str) -> None:
    found = offences((ROOT / module).read_text())
    assert not found, "\n".join(f"{module}:{line}: {what}" for line, what in found)


SAMPLE = '''"""A module. Its first start took 5.4 s in the twentieth pass."""

LIMIT = 256
"""Names stay under 256 bytes, the kernel's limit (libnftables 1.0.6, kernels < 6.2)."""
RECV = 1 << 16  # the kernel's dump batches are at most 32 KiB
SLOTS = 8  # eight slots cost 4 MB
TIMEOUT = 10800
"""kube-proxy's default clientIP.timeoutSeconds (3 h), "3h0m0s" or "250ms" in Go."""


def f() -> None:
    """Commits in one step; ruleset v10 made it ~743 MB smaller."""
    # 12% of the CPU, p99 25
    # ms, and 0.25 us (pass 14), 1.5s (fifteenth pass).
    x = "not a comment: 25 ms"  # the timeout 10800 s is kube-proxy's default
    # minSyncPeriod defaults to 1 s, retries after syncPeriod (30 s); 410s back off.
    # (bench/RESULTS.md, the nineteenth pass) 2.1-3 s
    # (twentieth and twenty-first passes)
'''


def test_checker_on_a_sample() -> None:
    found = offences(SAMPLE)
    assert [(line, what.split(" in ")[0]) for line, what in found] == [
        (1, "'5.4 s'"),
        (1, "'twentieth pass'"),
        (6, "'4 MB'"),
        (12, "'ruleset v10'"),
        (12, "'~743 MB'"),
        (13, "'12%'"),
        (13, "'25\\n ms'"),
        (14, "'0.25 us'"),
        (14, "'1.5s'"),
        (14, "'fifteenth pass'"),
        (14, "'pass 14'"),
        (17, "'(bench/RESULTS.md, the nineteenth pass)'"),
        (17, "'2.1-3 s'"),
        (18, "'twentieth and twenty-first passes'"),
    ]
