#!/usr/bin/env bash
# Remove what kube-proxy (iptables or nftables mode) left in this network
# namespace, and nothing else -- what `kube-proxy --cleanup` does for those two
# modes, for when the kube-proxy binary is not at hand. Run it as root in the
# node's network namespace once kube-proxy has stopped on that node, e.g. in
# the nftproxy pod (hostNetwork, privileged; its image has nft, awk and both
# iptables variants):
#
#   kubectl -n kube-system exec -i "$POD" -- bash -s < deploy/cleanup-kube-proxy.sh
#   kubectl -n kube-system exec -i "$POD" -- bash -s -- --dry-run < deploy/cleanup-kube-proxy.sh
#
# What goes (deploy/README.md, "Clean up kube-proxy's rules"):
# - nftables mode: the tables `ip kube-proxy` and `ip6 kube-proxy`;
# - iptables mode, in iptables and ip6tables, nft and legacy backends: the
#   chains kube-proxy's CleanupLeftovers removes (KUBE-SERVICES,
#   KUBE-EXTERNAL-SERVICES, KUBE-NODEPORTS, KUBE-POSTROUTING, KUBE-MARK-MASQ,
#   KUBE-FORWARD, KUBE-PROXY-FIREWALL, KUBE-PROXY-CANARY and every
#   KUBE-SVC/SVL/EXT/FW/SEP/XLB-* chain) and the rules of other chains that
#   jump to them, one `iptables-restore --noflush` per table.
# What stays: kubelet's chains (KUBE-FIREWALL, KUBE-MARK-DROP,
# KUBE-KUBELET-CANARY, KUBE-IPTABLES-HINT), every other rule and table, and
# nftproxy's tables, its kube-proxy marker among them (a `kube-proxy` table
# marked as nftproxy's that holds only the chain `nftproxy-marker`). IPVS
# mode leftovers (kube-ipvs0, IPVS services, ipsets) are not handled: use
# `kube-proxy --cleanup` for those.
#
# --dry-run prints what would be deleted (the nft commands and the
# iptables-restore input) and changes nothing.
set -euo pipefail

dry_run=0
case "${1:-}" in
  "") ;;
  --dry-run) dry_run=1 ;;
  *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac

# kube-proxy's own iptables chains (pkg/proxy/iptables CleanupLeftovers and
# isServiceChainName); anchored, matched against whole chain names.
owned='^KUBE-(SERVICES|EXTERNAL-SERVICES|NODEPORTS|POSTROUTING|MARK-MASQ|FORWARD|PROXY-FIREWALL|PROXY-CANARY)$|^KUBE-(SVC|SVL|EXT|FW|SEP|XLB)-'

removed=0

# -- nftables mode --------------------------------------------------------------

# nftproxy's kube-proxy marker (nftproxy/core/nft/marker.py): its mark and its
# one chain, nothing of kube-proxy's in it; read from `nft list table` on stdin.
is_marker() {
  awk '
    /^\tcomment "managed by nftproxy"$/ { marked = 1 }
    /^\t(chain|set|map|flowtable|counter|quota|limit|ct|secmark|synproxy) / { objects++ }
    /^\tchain nftproxy-marker \{$/ { chain = 1 }
    END { exit !(marked && chain && objects == 1) }
  '
}

if command -v nft >/dev/null; then
  for family in ip ip6; do
    if listing=$(nft list table "$family" kube-proxy 2>/dev/null); then
      if is_marker <<<"$listing"; then
        echo "# table $family kube-proxy is nftproxy's marker: kept"
        continue
      fi
      echo "nft delete table $family kube-proxy"
      [ "$dry_run" = 1 ] || nft delete table "$family" kube-proxy
      removed=$((removed + 1))
    fi
  done
fi

# -- iptables mode ----------------------------------------------------------------

# The iptables-restore input that removes kube-proxy's chains, from
# iptables-save output on stdin (all tables); empty if there are none. Per
# table: owned chains flushed (a ":CHAIN" line under --noflush), the rules of
# other chains that jump to them deleted (-D), then the chains deleted (-X).
restore_input() {
  awk -v re="$owned" '
    function touch(t) { if (!(t in seen)) { seen[t] = 1; tables[++nt] = t } }
    /^\*/ { table = substr($0, 2); next }
    /^:/ {
      chain = substr($1, 2)
      if (chain ~ re) { chains[table, ++nc[table]] = chain; touch(table) }
      next
    }
    /^-A / && $2 !~ re {
      for (i = 3; i < NF; i++) {
        if (($i == "-j" || $i == "-g") && $(i + 1) ~ re) {
          sub(/^-A /, "-D ")
          jumps[table, ++nj[table]] = $0
          touch(table)
          break
        }
      }
    }
    END {
      for (k = 1; k <= nt; k++) {
        t = tables[k]
        print "*" t
        for (i = 1; i <= nc[t]; i++) print ":" chains[t, i] " - [0:0]"
        for (i = 1; i <= nj[t]; i++) print jumps[t, i]
        for (i = 1; i <= nc[t]; i++) print "-X " chains[t, i]
        print "COMMIT"
      }
    }'
}

for backend in nft legacy; do
  for cmd in iptables ip6tables; do
    save="$cmd-$backend-save"
    restore="$cmd-$backend-restore"
    command -v "$save" >/dev/null && command -v "$restore" >/dev/null || continue
    # Without -t, save lists only the tables that exist: it creates none (and
    # loads no legacy module) on a node that does not use this backend.
    rules=$("$save" 2>/dev/null) || continue
    input=$(printf '%s\n' "$rules" | restore_input)
    [ -n "$input" ] || continue
    echo "# $restore --noflush <<EOF"
    printf '%s\n' "$input"
    echo "# EOF"
    [ "$dry_run" = 1 ] || printf '%s\n' "$input" | "$restore" --noflush
    removed=$((removed + 1))
  done
done

if [ "$removed" = 0 ]; then
  echo "no kube-proxy rules found"
elif [ "$dry_run" = 1 ]; then
  echo "dry run: nothing was changed"
fi

# kube-proxy's iptables mode (localhostNodePorts) sets route_localnet=1; nftproxy
# needs it only with localhost node ports on, and then sets it itself. Left as
# is: something else on the node may rely on it.
if [ "$(cat /proc/sys/net/ipv4/conf/all/route_localnet 2>/dev/null || echo 0)" = 1 ]; then
  echo "note: net.ipv4.conf.all.route_localnet is 1 (kube-proxy sets it for localhost" \
    "node ports, which nftproxy serves only with KubeProxyNFTablesLocalhostNodePorts);" \
    "see deploy/README.md"
fi
