#!/usr/bin/env bash
# Set up (idempotent), then run nftproxy's main job on the embedded sample
# cluster (nftproxy/examples/cluster.yaml), with no cluster needed: print the
# model and the one atomic nft transaction nftproxy would commit.
# Extra arguments go to `nftproxy sync`.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$here/scripts/setup.sh"
exec "$here/.venv/bin/nftproxy" sync --once --dry-run \
  --source "$here/nftproxy/examples/cluster.yaml" "$@"
