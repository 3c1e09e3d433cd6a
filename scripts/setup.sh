#!/usr/bin/env bash
# One idempotent set-up for a fresh Debian (bookworm or trixie) machine, as root:
# the apt packages nftproxy needs, then a virtual environment made from the
# system python3 with system site packages (so Debian's python3-nftables,
# which matches the installed libnftables1, is importable), then nftproxy
# itself with its test tools. deploy/Dockerfile runs this same script.
#
# Python packages come at the exact versions of constraints.txt (pyproject.toml
# keeps ranges), so two runs, and two image builds, install the same ones.
#
#   NFTPROXY_NO_TEST_DEPS=1  skip the test/lint tools (container image)
#   NFTPROXY_VENV=DIR        make the venv at DIR, not .venv in the checkout
#                            (the image: /opt/nftproxy/venv)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${NFTPROXY_VENV:-$here/.venv}
apt_packages=(nftables libnftables1 python3-nftables python3-venv python3-pip iproute2 iptables kmod procps)
# The deploy tests render the kustomize overlays with `kubectl kustomize`;
# Debian's kubernetes-client provides kubectl where apt has it (bookworm; no
# Debian package provides kustomize alone). Not in the image (no test deps),
# and never over a kubectl that is already there.
kubectl_wanted() { [ "${NFTPROXY_NO_TEST_DEPS:-0}" != 1 ] && ! command -v kubectl >/dev/null; }
in_apt() { apt-cache show "$1" >/dev/null 2>&1; }

missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
kubectl_wanted && in_apt kubernetes-client && missing+=(kubernetes-client)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: need root to install: ${missing[*]}" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  if kubectl_wanted && [[ " ${missing[*]} " != *" kubernetes-client "* ]] \
     && in_apt kubernetes-client; then
    missing+=(kubernetes-client)  # apt's lists were empty before the update
  fi
  echo "setup: installing ${missing[*]}"
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating $venv from /usr/bin/python3"
  /usr/bin/python3 -m venv --system-site-packages "$venv"
fi

extras="[test]"
[ "${NFTPROXY_NO_TEST_DEPS:-0}" = 1 ] && extras=""
stamp="$venv/.nftproxy-installed"
want=$(cat "$here/pyproject.toml" "$here/constraints.txt" | sha256sum | cut -d' ' -f1)$extras
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing nftproxy$extras into $venv"
  "$venv/bin/pip" install -q --disable-pip-version-check \
    --constraint "$here/constraints.txt" -e "$here$extras"
  echo "$want" > "$stamp"
fi
# nftproxy's bytecode, written now (a no-op when up to date): the install is
# editable, so nothing else compiles it, and an agent starting in a fresh
# container -- every pod start -- would compile the whole package (~0.1 s
# of every start; bench/RESULTS.md, twenty-first pass).
"$venv/bin/python" -m compileall -q "$here/nftproxy" >/dev/null
"$venv/bin/python" -c "import nftables, nftproxy" || {
  echo "setup: the venv cannot import nftables (python3-nftables) or nftproxy" >&2
  exit 1
}
