#!/usr/bin/env python3
"""Version-skew probe: which set and map declarations written by one nftables
userspace can the other one list?

Run as root on the host (bookworm, nft 1.0.6) with a built trixie userspace
(nft 1.1.3, `scripts/userspace.sh trixie`):

    .venv/bin/python scripts/skew_probe.py [--userspace DIR] [--markdown]

Each case is written into `table ip nftproxy` of a fresh network namespace
by one userspace (`nft -f -`, or `nft -j -f -` for the JSON rows, which is
what nftproxy sends), then listed by the other with `nft list ruleset`,
`nft -j list ruleset` and `nftproxy dump`. The last rows are the product:
nftproxy's whole ruleset from `nftproxy sync --source
nftproxy/examples/cluster.yaml`; the same followed by the lister's own sync
(an agent rolled back or upgraded to the other userspace); and a table as
nftproxy wrote it before it declared by typeof, synced over by the writer.
Prints one table (the one in docs/userspaces.md); exits 1 if a product row
fails. Every namespace it makes is deleted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SAMPLE = "nftproxy/examples/cluster.yaml"
HOST_NFTPROXY = [str(REPO / ".venv/bin/nftproxy")]
CHROOT_NFTPROXY = ["/opt/nftproxy/bin/nftproxy"]


@dataclass(frozen=True)
class Case:
    """One declaration, as nft text or as a JSON `add set`/`add map` body."""

    label: str
    text: str = ""
    json: dict[str, object] | None = None
    sync: str = ""  # "once", "then-lister" (the lister's sync over it) or "healed"


def _text(label: str, body: str) -> Case:
    return Case(label, f"table ip nftproxy {{\n{body}\n}}\n")


def _json(label: str, kind: str, **fields: object) -> Case:
    return Case(label, json={kind: {"family": "ip", "table": "nftproxy", "name": "x", **fields}})


DADDR = {"payload": {"protocol": "ip", "field": "daddr"}}
L4PROTO = {"meta": {"key": "l4proto"}}
DPORT = {"payload": {"protocol": "th", "field": "dport"}}
THREE = {"concat": [DADDR, L4PROTO, DPORT]}
VERDICT = {"typeof": {"accept": None}}

# The full rule, in nft syntax: each `type` row beside its `typeof` twin.
TEXT_CASES = [
    _text("set, one type key", "set x { type ipv4_addr; }"),
    _text("set, one typeof key", "set x { typeof ip daddr; }"),
    _text("set, one type key (inet_service)", "set x { type inet_service; }"),
    _text("set, one typeof key (th dport)", "set x { typeof th dport; }"),
    _text("interval set, type, elements",
          "set x { type ipv4_addr; flags interval; elements = { 10.96.0.0/16 }; }"),
    _text("interval set, typeof, elements",
          "set x { typeof ip saddr; flags interval; elements = { 10.96.0.0/16 }; }"),
    _text("dynamic timeout set, type + update rule",
          "set x { type ipv4_addr; flags dynamic,timeout; timeout 3h; }\n"
          "chain c { update @x { ip saddr }; }"),
    _text("dynamic timeout set, typeof + update rule",
          "set x { typeof ip saddr; flags dynamic,timeout; timeout 3h; }\n"
          "chain c { update @x { ip saddr }; }"),
    _text("set, concatenated type key", "set x { type ipv4_addr . inet_proto . inet_service; }"),
    _text("set, concatenated typeof key", "set x { typeof ip daddr . meta l4proto . th dport; }"),
    _text("map, one type key : verdict", "map x { type ipv4_addr : verdict; }"),
    _text("map, one typeof key : verdict", "map x { typeof ip daddr : verdict; }"),
    _text("map, type concat : verdict",
          "map x { type ipv4_addr . inet_proto . inet_service : verdict; }"),
    _text("map, typeof concat : verdict",
          "map x { typeof ip daddr . meta l4proto . th dport : verdict; }"),
    _text("map, type concat : one type", "map x { type ipv4_addr . inet_service : ipv4_addr; }"),
    _text("map, typeof concat : one typeof", "map x { typeof ip daddr . th dport : ip daddr; }"),
    _text("map, type concat : type concat",
          "map x { type ipv4_addr . inet_proto . inet_service : ipv4_addr . inet_service; }"),
    _text("map, typeof concat : typeof concat",
          "map x { typeof ip daddr . meta l4proto . th dport : ip daddr . th dport; }"),
    _text("map, one type key : type concat",
          "map x { type inet_service : ipv4_addr . inet_service; }"),
    _text("map, typeof numgen key : typeof concat",
          "map x { typeof numgen random mod 2 : ip daddr . th dport; }"),
    _text("chains, rules, comments",
          "chain c { comment \"a chain\"; ip daddr 10.0.0.1 counter accept comment \"r\"; }"),
]

# What nftproxy's JSON can say: `type` in both versions, `typeof` in 1.1.3 only.
JSON_CASES = [
    _json("JSON set, \"type\": \"ipv4_addr\"", "set", type="ipv4_addr"),
    _json("JSON set, \"type\": {\"typeof\": ip daddr}", "set", type={"typeof": DADDR}),
    _json("JSON interval set, type", "set", type="ipv4_addr", flags=["interval"]),
    _json("JSON interval set, typeof", "set", type={"typeof": DADDR}, flags=["interval"]),
    _json("JSON timeout set, type", "set", type="ipv4_addr", flags=["timeout"], timeout=10800),
    _json("JSON timeout set, typeof", "set", type={"typeof": DADDR}, flags=["timeout"],
          timeout=10800),
    _json("JSON map, type concat : verdict", "map",
          type=["ipv4_addr", "inet_proto", "inet_service"], map="verdict"),
    _json("JSON map, typeof concat : \"verdict\"", "map", type={"typeof": THREE}, map="verdict"),
    _json("JSON map, typeof concat : {\"typeof\": {\"accept\": null}}", "map",
          type={"typeof": THREE}, map=VERDICT),
    _json("JSON map, type proto . port : verdict", "map",
          type=["inet_proto", "inet_service"], map="verdict"),
    _json("JSON map, typeof l4proto . dport : \"verdict\"", "map",
          type={"typeof": {"concat": [L4PROTO, DPORT]}}, map="verdict"),
    _json("JSON map, typeof l4proto . dport : {\"typeof\": {\"accept\": null}}", "map",
          type={"typeof": {"concat": [L4PROTO, DPORT]}}, map=VERDICT),
]
PRODUCT = [
    Case("nftproxy sync --source cluster.yaml", sync="once"),
    Case("nftproxy sync, then the lister's own nftproxy sync over it", sync="then-lister"),
    Case("nftproxy's old declarations (its --dry-run JSON, by `type`), then nftproxy sync",
         sync="healed"),
]


@dataclass(frozen=True)
class Userspace:
    name: str
    prefix: tuple[str, ...]  # argv prefix that runs a command in netns NS ("{ns}")
    nftproxy: tuple[str, ...]

    def argv(self, ns: str, *cmd: str) -> list[str]:
        return [a.format(ns=ns) for a in self.prefix] + list(cmd)


def _userspaces(chroot: Path) -> tuple[Userspace, Userspace]:
    host = Userspace("1.0.6 (host)", ("ip", "netns", "exec", "{ns}"), tuple(HOST_NFTPROXY))
    helper = str(REPO / "scripts/userspace.sh")
    trixie = Userspace(
        "1.1.3 (trixie)", ("bash", helper, "run", str(chroot), "-n", "{ns}"), tuple(CHROOT_NFTPROXY)
    )
    return host, trixie


def _run(argv: Sequence[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False,
                          cwd=REPO, timeout=120)


def _verdict(proc: subprocess.CompletedProcess[str]) -> str:
    if proc.returncode == 0:
        return "ok"
    if proc.returncode in (139, -11):
        return "segfault"
    return f"rc {proc.returncode}"


@contextlib.contextmanager
def _netns(n: int) -> Iterator[str]:
    name = f"nftpx-probe-{os.getpid()}-{n}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def _sync(us: Userspace, ns: str) -> subprocess.CompletedProcess[str]:
    return _run(us.argv(ns, *us.nftproxy, "sync", "--source", SAMPLE))


def _old_declarations(us: Userspace, ns: str) -> subprocess.CompletedProcess[str]:
    """The transaction nftproxy sent before it declared by typeof: the
    --dry-run plan (a never-started 1.0.6-dialect fake), applied by `nft -j`."""
    plan = _run([*HOST_NFTPROXY, "sync", "--dry-run", "--json", "--source", SAMPLE])
    commands = [json.loads(line) for line in plan.stdout.splitlines() if line.strip()]
    return _run(us.argv(ns, "nft", "-j", "-f", "-"), json.dumps({"nftables": commands}))


def _write(
    us: Userspace, lister: Userspace, ns: str, case: Case
) -> subprocess.CompletedProcess[str]:
    if case.json is not None:
        doc = {"nftables": [{"add": {"table": {"family": "ip", "name": "nftproxy"}}},
                            {"add": case.json}]}
        return _run(us.argv(ns, "nft", "-j", "-f", "-"), json.dumps(doc))
    if case.text:
        return _run(us.argv(ns, "nft", "-f", "-"), case.text)
    first = _old_declarations(us, ns) if case.sync == "healed" else _sync(us, ns)
    if first.returncode != 0 or case.sync == "once":
        return first
    return _sync(lister if case.sync == "then-lister" else us, ns)


def _listings(us: Userspace, ns: str) -> list[str]:
    return [
        _verdict(_run(us.argv(ns, "nft", "list", "ruleset"))),
        _verdict(_run(us.argv(ns, "nft", "-j", "list", "ruleset"))),
        _verdict(_run(us.argv(ns, *us.nftproxy, "dump"))),
    ]


def probe(chroot: Path) -> list[tuple[str, str, str, list[str]]]:
    """Rows of (case, writer, reader, [list, -j list, dump] verdicts)."""
    host, trixie = _userspaces(chroot)
    cases = [*TEXT_CASES, *JSON_CASES, *PRODUCT]
    rows = []
    n = 0
    for case in cases:
        for writer, reader in ((trixie, host), (host, trixie)):
            n += 1
            with _netns(n) as ns:
                wrote = _write(writer, reader, ns, case)
                if wrote.returncode != 0:
                    err = wrote.stderr.strip().splitlines()
                    why = err[0][:60] if err else _verdict(wrote)
                    rows.append((case.label, writer.name, reader.name, [f"not written: {why}"]))
                    continue
                rows.append((case.label, writer.name, reader.name, _listings(reader, ns)))
    return rows


def _table(rows: list[tuple[str, str, str, list[str]]]) -> str:
    out = [
        "| object | written by | listed by | `nft list ruleset` | `nft -j list ruleset` "
        "| `nftproxy dump` |",
        "|---|---|---|---|---|---|",
    ]
    for label, writer, reader, verdicts in rows:
        cells = verdicts if len(verdicts) == 3 else [verdicts[0], "", ""]
        out.append(f"| {label} | {writer} | {reader} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--userspace", type=Path, default=REPO / ".userspaces/trixie",
                        help="the trixie userspace (scripts/userspace.sh trixie DIR)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("skew_probe: needs root (network namespaces)", file=sys.stderr)
        return 2
    if not (args.userspace / "etc/debian_version").exists():
        print(f"skew_probe: no userspace at {args.userspace}; "
              "build it with scripts/userspace.sh trixie", file=sys.stderr)
        return 2
    rows = probe(args.userspace)
    print(_table(rows))
    product = [r for r in rows if r[0].startswith("nftproxy")]
    return 0 if all(v == "ok" for r in product for v in r[3]) else 1


if __name__ == "__main__":
    sys.exit(main())
