#!/usr/bin/env bash
# Vagrant provisioning of one VM of the cluster (as root, inside the VM):
#
#   provision.sh ROLE IP     ROLE: node-a | node-b | client
#                            (or "image": steps 1-2 only, as qemu/build-image.sh
#                            runs it in the image's chroot)
#
# 1. copy the synced checkout (/vagrant, or $NFTPROXY_SRC) to /opt/nftproxy,
#    without the host's .venv and caches;
# 2. install nftproxy exactly as README says: scripts/setup.sh (apt packages,
#    venv from the system python3 with system site packages, pip install -e);
# 3. nodes: enable nftvm-node.service, the node daemon (vmtests/vmnode.py),
#    which wires the pods and starts/stops `nftproxy run` for the runner.
# Idempotent: `vagrant provision` after editing the checkout refreshes the copy.
set -euo pipefail
role=${1:?usage: provision.sh ROLE IP}
ip=${2:-}
src=${NFTPROXY_SRC:-/vagrant}
dst=/opt/nftproxy

mkdir -p "$dst"
find "$dst" -mindepth 1 -maxdepth 1 ! -name .venv -exec rm -rf {} +
tar -C "$src" --exclude=./.venv --exclude=./.git --exclude=./vmtests/.cache \
  --exclude=./.vagrant --exclude=./vmtests/.vagrant --exclude='__pycache__' \
  --exclude=./.mypy_cache --exclude=./.ruff_cache --exclude=./.pytest_cache \
  --exclude=./.hypothesis --exclude=./.import_linter_cache --exclude='*.egg-info' \
  -cf - . | tar -C "$dst" -xf -
bash "$dst/scripts/setup.sh"

case $role in
  image)
    ;;
  node-*)
    [ -n "$ip" ] || { echo "provision: $role needs its IP" >&2; exit 2; }
    cat > /etc/systemd/system/nftvm-node.service <<UNIT
[Unit]
Description=nftproxy multi-node test: node daemon of $role (vmtests/vmnode.py)
After=network-online.target
Wants=network-online.target

[Service]
ExecStart=$dst/.venv/bin/python $dst/vmtests/vmnode.py --node $role --listen $ip
Environment=PYTHONUNBUFFERED=1
KillMode=mixed
Restart=on-failure
RestartSec=2

[Install]
WantedBy=multi-user.target
UNIT
    systemctl daemon-reload
    systemctl enable nftvm-node.service
    systemctl restart nftvm-node.service
    ;;
  client)
    echo "provision: client ready; run: sudo $dst/.venv/bin/python $dst/vmtests/run.py --mode vm"
    ;;
  *)
    echo "provision: unknown role $role" >&2
    exit 2
    ;;
esac
