#!/usr/bin/env bash
# Boot the three-VM cluster under qemu and run the scenarios in it (as root).
#
#   vmtests/qemu/build-image.sh      # once, and after code changes (about a minute)
#   vmtests/qemu/run-cluster.sh      # boots node-a, node-b, client; prints the summary
#
# The VMs boot the Debian kernel and initrd of the image (-kernel/-initrd,
# init=vmtests/qemu/guest-init.sh), under software emulation (TCG) unless
# NFTPROXY_VM_ACCEL says otherwise. Their one NIC each is a tap device on a
# bridge inside a network namespace made for this run (nftpx-vmlan-<pid>-<hex>):
# a private L2 with nothing else on it -- no uplink, no user-mode network,
# nothing bridged onto the host's network. The root disk is the shared image
# with snapshot=on (writes go to a temporary overlay).
#
# The client VM runs vmtests/run.py --mode vm; its summary is read from the
# client's serial console. Logs: $CACHE/last-run/{node-a,node-b,client}.log,
# the summary: $CACHE/last-run/summary.json. Exit 0 only if every scenario passed.
#
#   NFTPROXY_VM_ACCEL=tcg     qemu accelerator (kvm where nested KVM works)
#   NFTPROXY_VM_MEMORY=1024   MiB per VM
#   NFTPROXY_VM_TIMEOUT=3600  seconds before the run is abandoned
#   NFTPROXY_VM_RUNNER_ARGS   extra arguments for run.py (e.g. "--only local_policy --slow 6")
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cache=${NFTPROXY_VM_CACHE:-$repo/vmtests/.cache}
accel=${NFTPROXY_VM_ACCEL:-tcg}
memory=${NFTPROXY_VM_MEMORY:-1024}
limit=${NFTPROXY_VM_TIMEOUT:-3600}
runner_args=${NFTPROXY_VM_RUNNER_ARGS:-}
out=$cache/last-run

[ "$(id -u)" -eq 0 ] || { echo "run-cluster: run as root" >&2; exit 1; }
for f in rootfs.img vmlinuz initrd.img; do
  [ -f "$cache/$f" ] || { echo "run-cluster: $cache/$f missing: run vmtests/qemu/build-image.sh" >&2; exit 1; }
done
command -v qemu-system-x86_64 >/dev/null || { echo "run-cluster: apt-get install qemu-system-x86" >&2; exit 1; }

rm -rf "$out"
mkdir -p "$out"
lan=nftpx-vmlan-$$-$(od -An -N3 -tx1 /dev/urandom | tr -d ' \n')
declare -A pids=()

cleanup() {
  local vm
  for vm in "${!pids[@]}"; do
    kill "${pids[$vm]}" 2>/dev/null || true
  done
  for vm in "${!pids[@]}"; do
    wait "${pids[$vm]}" 2>/dev/null || true
  done
  ip netns del "$lan" 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ip netns add "$lan"
ip -n "$lan" link set lo up
ip -n "$lan" link add br0 type bridge
ip -n "$lan" link set br0 up

declare -A addr=([node-a]=192.168.56.11 [node-b]=192.168.56.12 [client]=192.168.56.20)
declare -A mac=([node-a]=52:54:00:56:00:11 [node-b]=52:54:00:56:00:12 [client]=52:54:00:56:00:20)

boot() {
  local vm=$1 extra=$2
  ip -n "$lan" tuntap add dev "t-$vm" mode tap
  ip -n "$lan" link set "t-$vm" master br0
  ip -n "$lan" link set "t-$vm" up
  ip netns exec "$lan" qemu-system-x86_64 \
    -name "nftvm-$vm" -machine q35 -accel "$accel" -cpu max -smp 1 -m "$memory" \
    -nodefaults -display none -monitor none -serial "file:$out/$vm.log" -no-reboot \
    -kernel "$cache/vmlinuz" -initrd "$cache/initrd.img" \
    -append "root=/dev/vda rw console=ttyS0 panic=1 quiet net.ifnames=0 init=/opt/nftproxy/vmtests/qemu/guest-init.sh nftvm.role=$vm nftvm.ip=${addr[$vm]} $extra" \
    -drive "file=$cache/rootfs.img,format=raw,if=virtio,snapshot=on" \
    -netdev "tap,id=lan,ifname=t-$vm,script=no,downscript=no" \
    -device "virtio-net-pci,netdev=lan,mac=${mac[$vm]}" \
    > "$out/$vm.qemu.log" 2>&1 &
  pids[$vm]=$!
  echo "run-cluster: booted $vm (${addr[$vm]}, pid ${pids[$vm]})"
}

t0=$(date +%s)
boot node-a ""
boot node-b ""
# the runner's arguments travel on the kernel command line (nftvm.args=a,b,c)
boot client "nftvm.args=$(echo "$runner_args" | tr ' ' ',')"

echo "run-cluster: waiting for the client's runner (limit ${limit}s; logs in $out)"
status=timeout
while [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do
  if ! kill -0 "${pids[client]}" 2>/dev/null; then
    status=finished
    break
  fi
  for vm in node-a node-b; do
    if ! kill -0 "${pids[$vm]}" 2>/dev/null; then
      echo "run-cluster: $vm stopped early; see $out/$vm.log" >&2
    fi
  done
  sleep 5
done
elapsed=$(( $(date +%s) - t0 ))
echo "run-cluster: client $status after ${elapsed}s"

sed -n '/^NFTVM-RESULT-BEGIN/,/^NFTVM-RESULT-END/p' "$out/client.log" | sed '1d;$d' | tr -d '\r' > "$out/summary.json"
if [ ! -s "$out/summary.json" ]; then
  echo "run-cluster: no summary in $out/client.log; its end:" >&2
  tail -40 "$out/client.log" >&2
  exit 1
fi
grep -E "^(PASS|FAIL|ERROR|node daemons|agents started)" "$out/client.log" | tr -d '\r' || true
python3 - "$out/summary.json" "$elapsed" "$accel" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
doc["host"] = {"wall_s": int(sys.argv[2]), "accel": sys.argv[3]}
json.dump(doc, open(sys.argv[1], "w"), indent=1)
print(f"run-cluster: {doc['result']} (runner {doc['total_s']}s, whole run {sys.argv[2]}s, {sys.argv[3]})")
sys.exit(0 if "FAILED" not in doc["result"] else 1)
PY
