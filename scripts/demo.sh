#!/usr/bin/env bash
# Set up (idempotent), then run nftproxy's main job on the embedded sample
# cluster: `nftproxy demo` (needs root: it builds network namespaces).
# Extra arguments go to `nftproxy demo`, e.g. `scripts/demo.sh --once`.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$here/scripts/setup.sh"
exec "$here/.venv/bin/nftproxy" demo "$@"
