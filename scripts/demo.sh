#!/usr/bin/env bash
# Set up (idempotent), then run nftproxy's main job on the embedded sample
# cluster (nftproxy/examples/cluster.yaml), with no cluster needed: the real
# agent programs a sandbox node (network namespaces: a node, three pods, a
# client), sends traffic to every service and prints who answered and how,
# then the live table. It keeps running, re-programming and re-reporting when
# you edit the copy of the sample it names, until Ctrl-C (which removes the
# namespaces). Needs root. Extra arguments go to `nftproxy demo` (e.g. --once).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$here/scripts/setup.sh"
exec "$here/.venv/bin/nftproxy" demo "$@"
