"""The image, built without a Docker engine: deploy/Dockerfile replayed in
the trixie userspace (docs/userspaces.md).

Aspects:
- the replay: deploy/Dockerfile's instructions, parsed from the file
  (tests/test_deploy.py's parser, so the replay cannot drift from it), run
  in a throw-away copy-on-write view of the trixie userspace (an overlay
  over $NFTPROXY_TRIXIE, WORKDIR emptied as on `debian:trixie-slim`): FROM
  must be trixie, WORKDIR, COPY (from the checkout: the build context, less
  what the .dockerignore drops) and ENV as docker applies them, each RUN as
  `/bin/sh -c` in WORKDIR with only the image's environment; an instruction
  the replay does not know fails the test;
- what it installs: Python 3.13 with Debian's python3-nftables on
  libnftables 1.1.3, every Python package at constraints.txt's pin,
  nftproxy's own bytecode (every pod start would compile it otherwise); the
  ENTRYPOINT's nftproxy answers `--version` and `sync --dry-run`;
- version skew: a real `sync` by the image in a namespace writes its sets by
  typeof, the host's (bookworm, 1.0.6) `nft list ruleset`, `nft -j list
  ruleset` and `nftproxy dump` list it cleanly, and the host's nftproxy (an
  older image rolled back) syncs over it without crashing.
Needs root and the trixie userspace, like the skew tests (skips without
$NFTPROXY_TRIXIE; scripts/test-userspaces.sh runs it from the host).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_constraints import canonical, pins
from test_deploy import dockerfile
from test_userspaces import SAMPLE, Userspace, _listings, _ok, _trixie_dir

REPO = Path(__file__).resolve().parent.parent
HELPER = str(REPO / "scripts/userspace.sh")
BASE = "debian:trixie-slim"
DOCKER_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
              "HOME": "/root"}
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc")  # deploy/Dockerfile.dockerignore


@dataclass(frozen=True)
class Image:
    """The replayed image: its filesystem and how to run in it."""

    root: Path
    env: tuple[str, ...]  # VAR=value, the image's environment
    entrypoint: tuple[str, ...]
    uncompiled: tuple[str, ...]  # nftproxy's modules without Python 3.13 bytecode, as built

    def userspace(self) -> Userspace:
        prefix = ("bash", HELPER, "run", str(self.root), "-n", "{ns}", "env", "-i", *self.env)
        return Userspace("image", prefix, str(Path(self.entrypoint[0]).parent / "python"))

    def run(self, *argv: str) -> str:
        cmd = ["bash", HELPER, "run", str(self.root), "env", "-i", *self.env, *argv]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=600)
        return _ok(proc, f"image: {' '.join(argv)[:200]}")


def _expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), ""), value)


def _copy(args: str, root: Path, workdir: str) -> None:
    words = args.split()
    assert not [w for w in words if w.startswith("--")], f"COPY {args}: flags not replayed"
    *sources, dest = words
    target = root / os.path.join(workdir, dest).lstrip("/")
    for source in sources:
        path = REPO / source
        if path.is_dir():
            shutil.copytree(path, target, ignore=IGNORED, dirs_exist_ok=True)
            continue
        into = target / path.name if dest.endswith("/") or len(sources) > 1 else target
        into.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, into)


def _replay(root: Path, instructions: list[tuple[str, str]]) -> dict[str, str]:
    """Run the instructions into root as docker build would; the image's env."""
    env, workdir = dict(DOCKER_ENV), "/"
    for keyword, args in instructions:
        if keyword == "RUN":
            kv = [f"{k}={v}" for k, v in env.items()]
            cmd = ["bash", HELPER, "run", str(root), "env", "-i", "-C", workdir, *kv,
                   "/bin/sh", "-c", args]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=900)
            _ok(proc, f"RUN {args}")
        elif keyword == "WORKDIR":
            workdir = os.path.join(workdir, args)
            (root / workdir.lstrip("/")).mkdir(parents=True, exist_ok=True)
        elif keyword == "COPY":
            _copy(args, root, workdir)
        elif keyword == "ENV":
            env |= {k: _expand(v, env) for k, _, v in
                    (w.partition("=") for w in shlex.split(args))}
        elif keyword == "FROM":
            assert args == BASE, f"the replay stands for {BASE}, the Dockerfile says {args}"
        elif keyword == "USER":
            assert args == "0", "the replay runs as root"
        elif keyword not in ("LABEL", "ENTRYPOINT"):  # metadata (tests/test_deploy.py)
            pytest.fail(f"the replay does not know the Dockerfile's {keyword}")
    return env


def _mount_overlay(lower: Path, scratch: Path, emptied: list[str]) -> Path:
    upper, work, merged = scratch / "upper", scratch / "work", scratch / "merged"
    for d in (upper, work, merged):
        d.mkdir()
    for path in emptied:  # not in the base image: the userspace's own venv is /opt/nftproxy
        opaque = upper / path.lstrip("/")
        opaque.mkdir(parents=True)
        os.setxattr(opaque, "trusted.overlay.opaque", b"y")
    options = f"lowerdir={lower},upperdir={upper},workdir={work}"
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, str(merged)], check=True)
    return merged


def _uncompiled(package: Path) -> tuple[str, ...]:
    """The modules of `package` with no bytecode for the image's Python 3.13."""
    modules = sorted(package.rglob("*.py"))
    assert modules, f"no nftproxy package at {package}"
    return tuple(str(m.relative_to(package)) for m in modules
                 if not (m.parent / "__pycache__" / f"{m.stem}.cpython-313.pyc").is_file())


@pytest.fixture(scope="module")
def image() -> Iterator[Image]:
    lower = _trixie_dir()
    assert (lower / "etc/debian_version").read_text().startswith("13"), "not trixie"
    instructions = dockerfile()
    workdirs = [args for keyword, args in instructions if keyword == "WORKDIR"]
    (entrypoint,) = [json.loads(a) for k, a in instructions if k == "ENTRYPOINT"]
    scratch = Path(tempfile.mkdtemp(prefix="nftproxy-image-"))
    try:
        root = _mount_overlay(lower, scratch, workdirs)
        try:
            env = _replay(root, instructions)
            yield Image(root, tuple(f"{k}={v}" for k, v in env.items()), tuple(entrypoint),
                        _uncompiled(root / workdirs[-1].lstrip("/") / "nftproxy"))
        finally:
            if subprocess.run(["umount", str(root)], check=False).returncode:
                subprocess.run(["umount", "-l", str(root)], check=True)
    finally:
        shutil.rmtree(scratch)


def test_the_image_has_python_3_13_libnftables_1_1_3_and_the_pinned_packages(
    image: Image,
) -> None:
    assert image.run("dpkg-query", "-W", "-f", "${Version}", "libnftables1").startswith("1.1.3")
    python = image.userspace().python
    probe = "import sys, nftables; print(sys.version_info[:2], nftables.__file__)"
    assert image.run(python, "-c", probe).split() == [
        "(3,", "13)", "/usr/lib/python3/dist-packages/nftables/__init__.py"]
    frozen = image.run(python, "-m", "pip", "freeze", "--local", "--exclude-editable")
    installed = dict(line.split("==") for line in frozen.split())
    assert "kubernetes" in installed and "PyYAML" in installed
    pinned = pins()
    assert {n: v for n, v in installed.items() if pinned.get(canonical(n)) != v} == {}


def test_the_image_holds_nftproxys_bytecode(image: Image) -> None:
    """Built into the image (scripts/setup.sh), not compiled by every pod
    start: read when the replay ended, before anything ran the package."""
    assert image.uncompiled == ()


def test_the_entrypoint_answers_version_and_a_dry_run(image: Image) -> None:
    nftproxy = image.entrypoint[0]
    assert "nftproxy" in image.run("which", "nftproxy") and image.entrypoint[1:] == ("run",)
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert version in image.run(nftproxy, "--version")
    plan = image.run(nftproxy, "sync", "--dry-run", "--json", "--source", SAMPLE)
    assert "KUBE-SERVICES" in plan and [json.loads(line) for line in plan.splitlines()]


def test_a_table_the_image_writes_lists_with_the_host_and_survives_a_rollback(
    image: Image, netns: str
) -> None:
    img = image.userspace()
    host = Userspace("host", ("ip", "netns", "exec", "{ns}"), sys.executable)
    _ok(img.run(netns, image.entrypoint[0], "sync", "--source", SAMPLE), "image: nftproxy sync")
    assert "typeof" in _ok(img.run(netns, "nft", "list", "ruleset"), "image: nft list")
    text, listed, dump = _listings(host, netns)  # 1.0.6 reads 1.1.3's table
    assert "table ip nftproxy" in text and json.loads(listed)["nftables"]
    assert "demo/web:http" in dump
    _ok(host.nftproxy(netns, "sync", "--source", SAMPLE), "host (rolled back): nftproxy sync")
    assert _listings(host, netns)[2] == dump
