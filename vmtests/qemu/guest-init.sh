#!/bin/bash
# PID 1 of every VM of the qemu cluster (kernel command line:
# init=/opt/nftproxy/vmtests/qemu/guest-init.sh nftvm.role=ROLE nftvm.ip=IP).
# No systemd, no udev: mount the kernel filesystems, load the NIC driver,
# put the VM's LAN address on its one NIC (on the cluster's private L2),
# then by role:
#   node-a, node-b  the node daemon (vmtests/vmnode.py): wires its pods
#                   (network namespaces) and runs `nftproxy run` on request;
#   client          the runner (vmtests/run.py --mode vm): API server,
#                   scenarios; prints the summary between NFTVM-RESULT markers
#                   on the console, then powers the VM off;
#   check           print versions and power off (a boot test).
# Everything goes to the serial console, which the host logs.
set -u
export PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 PYTHONUNBUFFERED=1
repo=/opt/nftproxy
py=$repo/.venv/bin/python

mountpoint -q /proc || mount -t proc proc /proc
mountpoint -q /sys || mount -t sysfs sys /sys
mountpoint -q /dev || mount -t devtmpfs dev /dev
mkdir -p /dev/pts /dev/shm && mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /run && mkdir -p /run/netns /run/lock
mount -t tmpfs tmpfs /tmp
mount -o remount,rw / 2>/dev/null

arg() { sed -n "s/.*\bnftvm\.$1=\([^ ]*\).*/\1/p" /proc/cmdline; }
role=$(arg role)
ip=$(arg ip)
runner_args=$(arg args | tr ',' ' ')
say() { echo "nftvm[$role] $(cut -d' ' -f1 /proc/uptime)s: $*"; }
off() {
  say "powering off"
  sync
  echo o > /proc/sysrq-trigger
  sleep 30
}
trap off EXIT

hostname "$role"
echo "$role" > /etc/hostname
ip link set lo up
modprobe virtio_net || say "modprobe virtio_net failed"
# the one NIC: eth0 with net.ifnames=0 (the initramfs' udev renames it otherwise)
dev=
for _ in $(seq 100); do
  for path in /sys/class/net/*; do
    [ "${path##*/}" != lo ] && dev=${path##*/} && break
  done
  [ -n "$dev" ] && break
  sleep 0.1
done
if [ -n "$ip" ] && [ -n "$dev" ]; then
  ip addr add "$ip/24" dev "$dev"
  ip link set "$dev" up
fi
# nf_tables and friends load on demand (kmod's modprobe, no udev needed)
say "up: kernel $(uname -r), ${dev:-no NIC} $ip"

case $role in
  node-*)
    # node-originated traffic to ClusterIPs needs a route before it is DNATed
    ip route add default via 192.168.56.20 dev "$dev"
    "$py" "$repo/vmtests/vmnode.py" --node "$role" --listen "$ip" &
    wait
    ;;
  client)
    # the runner prints the summary between the markers itself
    # shellcheck disable=SC2086  # word splitting wanted
    "$py" "$repo/vmtests/run.py" --mode vm --json /tmp/summary.json $runner_args
    say "runner exited with $?"
    ;;
  check)
    say "interfaces: $(ls /sys/class/net | tr '\n' ' ')"
    say "modules: $(lsmod | awk 'NR>1 {print $1}' | grep -E 'virtio|net' | tr '\n' ' ')"
    say "$("$py" -c 'import sys, nftables, nftproxy; print(sys.version.split()[0])') ok"
    say "$(nft --version)"
    ;;
  *)
    say "unknown role '$role'"
    ;;
esac
