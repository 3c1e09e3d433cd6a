#!/usr/bin/env bash
# Set up (idempotent), then run every check CI runs: ruff, mypy --strict,
# the import-layer contracts, and the whole pytest suite (unit tests plus the
# real-kernel tests in throwaway network namespaces, which need root).
# Extra arguments go to pytest, e.g. `scripts/test.sh -k affinity`.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$here/scripts/setup.sh"
cd "$here"
py=.venv/bin
$py/ruff check .
$py/mypy
$py/lint-imports
# The version-skew tests (tests/test_userspaces.py) need the trixie userspace:
# run them when it is built (scripts/test-userspaces.sh builds it; CI runs that next).
if [ -z "${NFTPROXY_TRIXIE:-}" ] && [ -f .userspaces/trixie/opt/nftproxy/.nftproxy-installed ]; then
  export NFTPROXY_TRIXIE=$here/.userspaces/trixie
fi
set +e
$py/python -m pytest "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then
  echo "test: pytest collected no tests; that is a failure here" >&2
  exit 1
fi
exit $rc
