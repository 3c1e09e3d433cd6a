#!/usr/bin/env bash
# Bring the Vagrant cluster up (provisioning it the first time) and run the
# scenarios in the client VM; the summary lands in vmtests/.cache/vagrant-summary.json.
#
#   vmtests/vagrant-run.sh [libvirt|virtualbox] [run.py arguments...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
provider=${1:-libvirt}
shift || true
vagrant up --provider="$provider"
mkdir -p .cache
set +e
vagrant ssh client -c "sudo /opt/nftproxy/.venv/bin/python /opt/nftproxy/vmtests/run.py \
  --mode vm --slow 1.5 --json /tmp/summary.json $*"
rc=$?
set -e
vagrant ssh client -c "cat /tmp/summary.json" > .cache/vagrant-summary.json || true
exit $rc
