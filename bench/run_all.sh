#!/usr/bin/env bash
# Every benchmark at full size, one after the other (never two at once: they
# would skew each other on a 2-core machine). Results (JSON lines) go to
# bench/results/<name>.jsonl, the human tables and progress to <name>.log.
# Takes about 60 minutes; needs root. Each script waits for the machine to be
# quiet before measuring and records the CPU share other processes took
# (`foreign_cpu`) next to every number.
#
#   sudo bash bench/run_all.sh            # everything
#   sudo bash bench/run_all.sh churn      # only the named ones
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py="$here/.venv/bin/python"
out="$here/bench/results"
mkdir -p "$out"

run() {
  local name=$1; shift
  if [ ${#selected[@]} -gt 0 ] && [[ ! " ${selected[*]} " =~ " $name " ]]; then
    return
  fi
  echo "== $name: $*" >&2
  "$py" "$@" >"$out/$name.jsonl" 2>"$out/$name.log"
  tail -n 40 "$out/$name.log" >&2
}

selected=("$@")
cd "$here"
run levers bench/levers.py
run partial_sync bench/partial_sync.py \
  --variants baseline,inline,inline+shard16,inline+fwset+shard16
run partial_sync_noaff bench/partial_sync.py --no-affinity --variants inline+fwset+shard16
run partial_sync_ladder bench/partial_sync.py --sizes 10000 --reps 20 \
  --variants fwset,inline+fwset,fwset+shard16
run cold_sync bench/cold_sync.py --sizes 1000x10,10000x10,5000x50 \
  --variants baseline,inline+fwset+shard16
run cold_sync_nofresh bench/cold_sync.py --sizes 10000x10 --variants baseline-nofresh
run cold_sync_split bench/cold_sync.py --sizes 10000x10,5000x50 \
  --variants inline+fwset+shard16+split
run churn bench/churn.py --variants baseline,inline+fwset+shard16
run churn_gcfreeze bench/churn.py --variants baseline+gcfreeze,inline+fwset+shard16+gcfreeze
run dataplane bench/dataplane.py
