#!/usr/bin/env bash
# Build the Debian image the qemu cluster boots (as root, needs the Debian
# package registry and PyPI while it runs; nothing at test time):
#
#   1. debootstrap bookworm (minbase) into $CACHE/rootfs, then install the
#      distribution kernel (linux-image-amd64, with its initramfs) -- cached,
#      several minutes the first time;
#   2. in a chroot, vmtests/provision.sh (what Vagrant provisioning runs):
#      copy this checkout to /opt/nftproxy (no .venv, no caches) and run
#      scripts/setup.sh there -- nftproxy installed exactly as README says
#      (apt packages, venv from the system python3, pip install -e .[test]);
#   3. write $CACHE/rootfs.img (ext4, `mkfs.ext4 -d`, no loop mount) and copy
#      the kernel and initrd next to it.
#
# Steps 2-3 rerun every time (about a minute), so the image always carries the
# current code. The cache is $NFTPROXY_VM_CACHE or vmtests/.cache (git-ignored).
#
#   vmtests/qemu/build-image.sh            # build or refresh
#   NFTPROXY_VM_MIRROR=http://... build-image.sh
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cache=${NFTPROXY_VM_CACHE:-$repo/vmtests/.cache}
mirror=${NFTPROXY_VM_MIRROR:-http://deb.debian.org/debian}
suite=${NFTPROXY_VM_SUITE:-bookworm}
size=${NFTPROXY_VM_IMAGE_SIZE:-4G}
rootfs=$cache/rootfs

[ "$(id -u)" -eq 0 ] || { echo "build-image: run as root" >&2; exit 1; }
for tool in debootstrap mkfs.ext4 chroot tar; do
  command -v "$tool" >/dev/null || { echo "build-image: $tool missing (apt-get install debootstrap e2fsprogs)" >&2; exit 1; }
done
mkdir -p "$cache"

mounted=()
cleanup() {
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do
    umount -l "${mounted[$i]}" 2>/dev/null || true
  done
}
trap cleanup EXIT

mount_chroot() {
  for fs in proc sys dev dev/pts; do
    mkdir -p "$rootfs/$fs"
    mountpoint -q "$rootfs/$fs" && continue
    case $fs in
      proc) mount -t proc proc "$rootfs/proc" ;;
      sys) mount -t sysfs sys "$rootfs/sys" ;;
      dev) mount --bind /dev "$rootfs/dev" ;;
      dev/pts) mount -t devpts devpts "$rootfs/dev/pts" ;;
    esac
    mounted+=("$rootfs/$fs")
  done
  cp -L /etc/resolv.conf "$rootfs/etc/resolv.conf"
}

in_chroot() {
  chroot "$rootfs" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
    LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive "$@"
}

t0=$(date +%s)
# -- 1. the base system and the kernel (cached) ------------------------------------
if [ ! -f "$rootfs/.nftvm-base" ]; then
  echo "build-image: debootstrap $suite from $mirror into $rootfs"
  if grep -q " $rootfs/" /proc/mounts; then
    echo "build-image: something is still mounted under $rootfs; not removing it" >&2
    exit 1
  fi
  rm -rf "$rootfs"
  debootstrap --variant=minbase --include=ca-certificates,kmod,iproute2,procps \
    "$suite" "$rootfs" "$mirror"
  cat > "$rootfs/etc/apt/sources.list" <<SOURCES
deb $mirror $suite main
deb $mirror $suite-updates main
deb http://deb.debian.org/debian-security $suite-security main
SOURCES
  mount_chroot
  echo "build-image: installing the distribution kernel"
  in_chroot apt-get update -qq
  # initramfs-tools' default MODULES=most includes virtio_pci/virtio_blk/ext4
  in_chroot apt-get install -y -qq --no-install-recommends \
    linux-image-amd64 initramfs-tools zstd >/dev/null
  date -u +%FT%TZ > "$rootfs/.nftvm-base"
  echo "build-image: base done in $(( $(date +%s) - t0 ))s"
fi

# -- 2. this checkout, installed as README says -------------------------------------
# vmtests/provision.sh, as Vagrant runs it, from a read-only bind mount of this
# checkout: copy to /opt/nftproxy (keeping the image's .venv), scripts/setup.sh
echo "build-image: provisioning /opt/nftproxy from $repo"
mount_chroot
mkdir -p "$rootfs/mnt/nftproxy-src"
mount --bind "$repo" "$rootfs/mnt/nftproxy-src"
mounted+=("$rootfs/mnt/nftproxy-src")
mount -o remount,bind,ro "$rootfs/mnt/nftproxy-src"
# This machine may reach PyPI through a TLS proxy whose CA only the host
# trusts: lend the host's CA bundle to pip for the build (removed below).
pip_env=()
if [ -n "${NFTPROXY_VM_PIP_CERT:-}" ] || [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  cp "${NFTPROXY_VM_PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}" "$rootfs/tmp/build-ca.crt"
  pip_env=(PIP_CERT=/tmp/build-ca.crt)
fi
in_chroot "${pip_env[@]}" NFTPROXY_SRC=/mnt/nftproxy-src \
  bash /mnt/nftproxy-src/vmtests/provision.sh image
rm -f "$rootfs/tmp/build-ca.crt"
in_chroot /opt/nftproxy/.venv/bin/python -c 'import nftables, kubernetes, nftproxy'
chmod +x "$rootfs/opt/nftproxy/vmtests/qemu/guest-init.sh"
{
  in_chroot dpkg-query -W -f='${Package} ${Version}\n' \
    linux-image-amd64 nftables libnftables1 python3 python3-nftables
  echo "kernel $(ls "$rootfs/lib/modules" | sort -V | tail -1)"
  in_chroot /opt/nftproxy/.venv/bin/pip list --format=freeze 2>/dev/null \
    | grep -iE '^(kubernetes|pyroute2|prometheus.client|pyyaml|nftproxy)=' || true
} > "$cache/versions.txt"
cleanup
mounted=()
rm -f "$rootfs/etc/resolv.conf"

# -- 3. the disk image, kernel and initrd ------------------------------------------
kernel=$(ls -1 "$rootfs"/boot/vmlinuz-* | sort -V | tail -1)
initrd=$(ls -1 "$rootfs"/boot/initrd.img-* | sort -V | tail -1)
cp "$kernel" "$cache/vmlinuz"
cp "$initrd" "$cache/initrd.img"
echo "build-image: writing $cache/rootfs.img ($size, ext4)"
rm -f "$cache/rootfs.img.new"
mkfs.ext4 -q -F -L nftvm -d "$rootfs" "$cache/rootfs.img.new" "$size"
mv "$cache/rootfs.img.new" "$cache/rootfs.img"
echo "build-image: done in $(( $(date +%s) - t0 ))s: $(basename "$kernel"), $(du -h --apparent-size "$cache/rootfs.img" | cut -f1) image"
cat "$cache/versions.txt"
