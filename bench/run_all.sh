#!/usr/bin/env bash
# The benchmarks, one after the other (never two at once: they would skew
# each other on a 2-core machine), in one or both nftables userspaces.
# Results (JSON lines, every line naming its userspace) go to
# bench/results/<name>.jsonl (host) and <name>.trixie.jsonl (trixie), the
# human tables and progress to <name>[.trixie].log; `python bench/report.py`
# prints the tables. Needs root. Each script waits for the machine to be
# quiet before measuring and records the CPU share other processes took
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
# --out DIR     where results go (default bench/results; e.g. a scratch
#               directory for --quick, so the committed results stay).
# NAME          run only these. Without names: the product set (issue 12's
#               numbers): cold_sync partial_sync partial_sync_45k churn
#               dataplane. The levers of bench/levers.py (shard tables,
#               split full commits, gc.freeze) run only when named: levers
#               partial_sync_levers partial_sync_noaff partial_sync_ladder
#               cold_sync_levers cold_sync_nofresh cold_sync_split
#               churn_levers churn_gcfreeze; so does sync_phases (where a
#               first full sync's CPU goes, phase by phase).
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out="$here/bench/results"
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

# run GROUP NAME SCRIPT [ARGS...]: GROUP product runs by default, levers only when named.
run() {
  local group=$1 name=$2 us suffix
  shift 2
  if [ ${#selected[@]} -gt 0 ]; then
    [[ " ${selected[*]} " == *" $name "* ]] || return 0
  elif [ "$group" != product ]; then
    return 0
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

# The product as it is (issue 12's numbers).
run product cold_sync bench/cold_sync.py --sources api,api-restart,pod,agent-file,file --variants baseline \
  --sizes 1000x10,10000x10,5000x50,45000x1
run product partial_sync bench/partial_sync.py --variants baseline --sizes 1000x10,10000x10
run product partial_sync_45k bench/partial_sync.py --variants baseline --sizes 45000x1
run product churn bench/churn.py --variants baseline
run product dataplane bench/dataplane.py
run levers sync_phases bench/sync_phases.py --sizes 10000x10,45000x1

# The levers (bench/levers.py) around the real Proxier: shard tables, split
# full commits, gc.freeze (the inline DNAT and shared source-range sets are
# the product since ruleset v2).
run levers levers bench/levers.py --variants baseline,shard4,shard16+split+gcfreeze
run levers partial_sync_levers bench/partial_sync.py --variants baseline,shard16
run levers partial_sync_noaff bench/partial_sync.py --no-affinity --variants baseline,shard16
run levers partial_sync_ladder bench/partial_sync.py --sizes 10000 --reps 20 \
  --variants baseline,shard4,shard16
run levers cold_sync_levers bench/cold_sync.py --sources file --sizes 1000x10,10000x10,5000x50 \
  --variants baseline,shard16
run levers cold_sync_nofresh bench/cold_sync.py --sources file --sizes 10000x10 \
  --variants baseline-nofresh
run levers cold_sync_split bench/cold_sync.py --sources file --sizes 10000x10,5000x50 \
  --variants shard16+split
run levers churn_levers bench/churn.py --variants baseline,shard16
run levers churn_gcfreeze bench/churn.py --variants baseline+gcfreeze,shard16+gcfreeze

if [ ${#failed[@]} -gt 0 ]; then
  echo "run_all: failed: ${failed[*]}" >&2
  exit 1
fi
