#!/usr/bin/env bash
# The benchmarks behind bench/RESULTS.md, one after the other (never two at
# once: they would skew each other on a 2-core machine), in one or both
# nftables userspaces. Results (JSON lines, every line naming its
# userspace) go to <out>/<name>.jsonl (host) and <name>.trixie.jsonl
# (trixie), the human tables and progress to <name>[.trixie].log;
# `python bench/report.py [<out>]` prints the tables. <out> is bench/out/
# by default, which git ignores: copy into bench/results/ only the files a
# RESULTS.md table quotes. Needs root. Each script waits for the machine to
# be quiet before measuring and records the CPU share other processes took
# (`foreign_cpu`) next to every number. A failing script is reported and
# the rest still run; the exit status is then 1.
#
#   sudo bash bench/run_all.sh [--userspaces host,trixie] [--quick] [--out DIR] [NAME...]
#
# --userspaces  comma list: host (this machine's, bookworm: libnftables
#               1.0.6; the default) and/or trixie (scripts/userspace.sh
#               builds .userspaces/trixie first if needed). With both, each
#               benchmark runs in each, back to back.
# --quick       every script in --quick mode (small sizes: a smoke test of
#               the set, a few minutes per userspace).
# --out DIR     where results go (default bench/out).
# NAME          run only these, of: cold_sync partial_sync partial_sync_45k
#               churn dataplane sync_phases (the default: all of them).
#               The one-off probes of bench/probes/ are not run here.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out="$here/bench/out"
userspaces=host
quick=()
selected=()
failed=()

die() { echo "run_all: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
  case $1 in
    --userspaces) [ $# -ge 2 ] || die "--userspaces needs a value"; userspaces=$2; shift 2 ;;
    --userspaces=*) userspaces=${1#*=}; shift ;;
    --quick) quick=(--quick); shift ;;
    --out) [ $# -ge 2 ] || die "--out needs a value"; out=$(realpath -m "$2"); shift 2 ;;
    -h|--help) sed -n '2,/^[^#]/{/^#/p}' "${BASH_SOURCE[0]}"; exit 0 ;;
    -*) die "unknown option $1" ;;
    *) selected+=("$1"); shift ;;
  esac
done
for us in ${userspaces//,/ }; do
  [[ $us == host || $us == trixie ]] || die "unknown userspace $us (host, trixie)"
done
for name in "${selected[@]}"; do
  case " cold_sync partial_sync partial_sync_45k churn dataplane sync_phases " in
    *" $name "*) ;;
    *) die "unknown benchmark $name" ;;
  esac
done
[ "$(id -u)" -eq 0 ] || die "needs root"
mkdir -p "$out"
cd "$here"

# The tree measured, for every machine line (the trixie userspace has no git).
rev=$(git rev-parse --short HEAD 2>/dev/null || echo '?')
[ -z "$(git status --porcelain -- nftproxy 2>/dev/null)" ] || rev="$rev+dirty(nftproxy/)"
export NFTPROXY_BENCH_GIT=$rev
trixie=
if [[ ",$userspaces," == *,trixie,* ]]; then
  trixie=$(bash scripts/userspace.sh trixie) || die "cannot build the trixie userspace"
fi

# In --quick mode the scripts choose their own small sizes: drop the full-size ones.
args_for_mode() {
  local skip=
  for a in "$@"; do
    if [ -n "$skip" ]; then skip=; continue; fi
    if [ ${#quick[@]} -gt 0 ] && [[ $a == --sizes || $a == --reps || $a == --services ]]; then
      skip=1; continue
    fi
    printf '%s\0' "$a"
  done
  [ ${#quick[@]} -eq 0 ] || printf '%s\0' --quick
}

# run NAME SCRIPT [ARGS...]: every NAME by default, only the named ones if any are.
run() {
  local name=$1 us suffix
  shift
  if [ ${#selected[@]} -gt 0 ]; then
    [[ " ${selected[*]} " == *" $name "* ]] || return 0
  fi
  local argv=()
  mapfile -d '' argv < <(args_for_mode "$@")
  for us in ${userspaces//,/ }; do
    local cmd=()
    if [ "$us" = host ]; then
      suffix=
      cmd=("$here/.venv/bin/python")
    else
      suffix=.$us
      cmd=(bash scripts/userspace.sh run "$trixie" /opt/nftproxy/bin/python)
    fi
    echo "== $name ($us, $(date +%H:%M:%S)): ${argv[*]}" >&2
    if ! "${cmd[@]}" "${argv[@]}" >"$out/$name$suffix.jsonl" 2>"$out/$name$suffix.log"; then
      failed+=("$name ($us)")
      echo "!! $name ($us) failed; see $out/$name$suffix.log" >&2
    fi
    tail -n 40 "$out/$name$suffix.log" >&2
  done
}

# RESULTS.md's targets and ceilings table, the upstream comparison and the
# known misses' causes.
run cold_sync bench/cold_sync.py --sources api,api-restart,pod,agent-file,file --variants baseline \
  --sizes 1000x10,10000x10,5000x50,45000x1
run partial_sync bench/partial_sync.py --variants baseline --sizes 1000x10,10000x10
run partial_sync_45k bench/partial_sync.py --variants baseline --sizes 45000x1
run churn bench/churn.py --variants baseline
run dataplane bench/dataplane.py
run sync_phases bench/sync_phases.py --sizes 10000x10,45000x1

if [ ${#failed[@]} -gt 0 ]; then
  echo "run_all: failed: ${failed[*]}" >&2
  exit 1
fi
