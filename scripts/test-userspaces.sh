#!/usr/bin/env bash
# The second userspace stage of CI (after scripts/test.sh, which tests the
# host's: bookworm, libnftables 1.0.6): build the Debian trixie userspace
# (libnftables 1.1.3; scripts/userspace.sh, idempotent), then
#  1. from the host, the version-skew test: a table written by either
#     userspace lists cleanly with the other (tests/test_userspaces.py);
#  2. inside trixie, the kernel-facing tests (nft, proxier, dataplane,
#     conntrack) against libnftables 1.1.3;
#  3. from the host, the image: deploy/Dockerfile's steps replayed in a
#     throw-away overlay of trixie, then its nftproxy syncs a netns whose
#     table the host's nft lists and the host's nftproxy syncs over
#     (tests/test_image_install.py; no Docker engine needed).
# As root. NFTPROXY_TRIXIE=DIR uses (or builds) DIR instead of
# .userspaces/trixie. Extra arguments go to both pytest runs.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$here"
bash scripts/setup.sh
t0=$(date +%s)
NFTPROXY_TRIXIE=$(bash scripts/userspace.sh trixie "${NFTPROXY_TRIXIE:-$here/.userspaces/trixie}")
export NFTPROXY_TRIXIE
t1=$(date +%s)

kernel_tests=(tests/test_backend.py tests/test_proxier_kernel.py tests/test_dataplane*.py
  tests/test_conntrack_kernel.py tests/test_userspaces.py tests/test_nfttext_kernel.py
  tests/test_switch_kernel.py tests/test_ruleset_size.py tests/test_hostile_names_kernel.py
  tests/test_marker_kernel.py)
rc=0
echo "test-userspaces: version skew, host (1.0.6) <-> trixie (1.1.3)"
.venv/bin/python -m pytest -p no:cacheprovider tests/test_userspaces.py "$@" || rc=$?
t2=$(date +%s)
echo "test-userspaces: kernel-facing tests inside trixie (libnftables 1.1.3)"
bash scripts/userspace.sh run "$NFTPROXY_TRIXIE" \
  /opt/nftproxy/bin/python -m pytest -p no:cacheprovider "${kernel_tests[@]}" "$@" || rc=$?
t3=$(date +%s)
echo "test-userspaces: the image (deploy/Dockerfile) replayed in trixie"
.venv/bin/python -m pytest -p no:cacheprovider tests/test_image_install.py "$@" || rc=$?
t4=$(date +%s)
echo "test-userspaces: build/check $((t1 - t0)) s, skew $((t2 - t1)) s," \
  "trixie tests $((t3 - t2)) s, image $((t4 - t3)) s, total $((t4 - t0)) s"
exit $rc
