#!/usr/bin/env bash
# A second nftables userspace next to the host's (bookworm, libnftables 1.0.6):
# Debian trixie (libnftables 1.1.3) in a debootstrap chroot, with nftproxy
# installed from this checkout, so the kernel-facing tests and the version-skew
# test run against both (docs/userspaces.md). As root.
#
#   scripts/userspace.sh trixie [DIR]            build DIR (idempotent; prints DIR on stdout)
#   scripts/userspace.sh run DIR [-n NS] CMD...  run CMD in DIR (in netns NS)
#
# DIR defaults to .userspaces/trixie in the repo (gitignored). Inside, the
# checkout is /src and nftproxy's venv is /opt/nftproxy (python3 with
# --system-site-packages, so Debian's python3-nftables 1.1.3 is importable):
#
#   scripts/userspace.sh run .userspaces/trixie /opt/nftproxy/bin/nftproxy dump
#
# `run` starts CMD in /src (so relative paths name the same files as on the
# host) and mounts /proc, /sys, /dev, a fresh /run and the checkout at /src inside
# a private mount namespace of its own (unshare -m, or the one `ip netns exec`
# makes), so they vanish with the command, whatever happens; DIR is bind-mounted
# onto itself first so `ip netns` works inside. MIRROR is the Debian mirror the
# host's apt uses (NFTPROXY_MIRROR overrides).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
packages=python3,python3-venv,python3-pip,python3-nftables,nftables,libnftables1,iproute2,procps,iptables,kmod
venv=/opt/nftproxy

die() { echo "userspace: $*" >&2; exit 1; }

# The URI that serves the host's own suite, from apt's one-line or deb822 sources.
host_mirror() {
  local codename files
  codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")
  files=$(ls /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
    /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
  [ -n "$files" ] || return 0
  # shellcheck disable=SC2086
  awk -v suite="$codename" '
    /^deb[ \t]/ { for (j = 2; j < NF; j++) if ($j ~ /^[a-z+]+:\/\//) { if ($(j+1) == suite) { print $j; exit } break } }
    /^URIs:/    { uris = $2 }
    /^Suites:/  { for (j = 2; j <= NF; j++) if ($j == suite && uris != "") { print uris; exit } }
    /^$/        { uris = "" }
  ' $files | head -n1
}

ensure_debootstrap() {
  command -v debootstrap >/dev/null && return
  echo "userspace: installing debootstrap" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
}

# Mount what a command inside DIR needs; runs inside a private mount namespace.
# shellcheck disable=SC2016
mounts='set -e; dir=$1; src=$2; shift 2
mount --bind "$dir" "$dir"
mount -t proc proc "$dir/proc"
mount --rbind /sys "$dir/sys"
mount --rbind /dev "$dir/dev"
mount -t tmpfs tmpfs "$dir/run"
mkdir -p "$dir/src"
mount --bind "$src" "$dir/src"
exec chroot "$dir" /usr/bin/env -u VIRTUAL_ENV -u PIP_FIND_LINKS -u NFTPROXY_TRIXIE -C /src \
  NFTPROXY_USERSPACE="$(cat "$dir/etc/debian_version")" PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$@"'

run_in() {
  local dir=$1; shift
  local ns=
  if [ "${1:-}" = -n ]; then ns=$2; shift 2; fi
  [ $# -gt 0 ] || die "run: no command"
  [ -f "$dir/etc/debian_version" ] || die "$dir is not a built userspace"
  dir=$(cd "$dir" && pwd)
  if [ -n "$ns" ]; then
    exec ip netns exec "$ns" sh -c "$mounts" sh "$dir" "$here" "$@"
  fi
  exec unshare --mount --propagation private sh -c "$mounts" sh "$dir" "$here" "$@"
}

build() {
  local suite=$1 dir=$2 mirror
  [ "$(id -u)" -eq 0 ] || die "need root"
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  if [ ! -f "$dir/.debootstrap-done" ]; then
    ensure_debootstrap
    mirror=${NFTPROXY_MIRROR:-$(host_mirror)}
    mirror=${mirror:-http://deb.debian.org/debian}
    echo "userspace: debootstrap $suite into $dir from $mirror (a few minutes)" >&2
    # A half-built tree from an interrupted run is started over; anything else is left alone.
    if [ "$dir" = / ] || { [ -n "$(ls -A "$dir")" ] && [ ! -f "$dir/.nftproxy-userspace" ]; }; then
      die "$dir is not empty and is not a userspace this script started; not overwriting it"
    fi
    find "$dir" -mindepth 1 -maxdepth 1 -exec rm -rf {} +
    touch "$dir/.nftproxy-userspace"
    debootstrap --variant=minbase --include="$packages" "$suite" "$dir" "$mirror" \
      > "$dir.debootstrap.log" 2>&1 || { tail -n 30 "$dir.debootstrap.log" >&2; die "debootstrap failed"; }
    touch "$dir/.debootstrap-done"
  fi
  cp /etc/ssl/certs/ca-certificates.crt "$dir/etc/ssl/certs/ca-certificates.crt" 2>/dev/null \
    || { mkdir -p "$dir/etc/ssl/certs"; cp /etc/ssl/certs/ca-certificates.crt "$dir/etc/ssl/certs/"; }
  [ -f /etc/pip.conf ] && cp /etc/pip.conf "$dir/etc/pip.conf"
  cp /etc/resolv.conf "$dir/etc/resolv.conf" 2>/dev/null || true
  local want stamp="$dir$venv/.nftproxy-installed"
  want=$(sha256sum < "$here/pyproject.toml" | cut -d' ' -f1)
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "userspace: installing nftproxy[test] into $dir$venv" >&2
    (run_in "$dir" sh -c "[ -x $venv/bin/python ] || python3 -m venv --system-site-packages $venv
      $venv/bin/pip install -q --disable-pip-version-check -e '/src[test]'") >&2
    echo "$want" > "$stamp"
  fi
  (run_in "$dir" $venv/bin/python -c "import nftables, nftproxy") \
    || die "the userspace's venv cannot import nftables or nftproxy"
  echo "$dir"
}

case "${1:-}" in
  trixie) build trixie "${2:-$here/.userspaces/trixie}" ;;
  run) shift; [ $# -ge 1 ] || die "run DIR [-n NS] CMD..."; run_in "$@" ;;
  *) sed -n '2,20p' "${BASH_SOURCE[0]}" >&2; exit 2 ;;
esac
