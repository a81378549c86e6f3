#!/usr/bin/env bash
# A/B of two release builds on the same machine, alternating runs, so that
# a change can be shown to leave speed as it was (issue 24).
#
#   bash bench/ab.sh OLD_DIR NEW_DIR [rounds]
#
# OLD_DIR and NEW_DIR each hold a release build's binaries as cargo lays
# them out: release/fairlane and release/examples/{bare_axum,mock_sms,
# store_accepts} (a CARGO_TARGET_DIR, or a copy of its binaries). The
# scripts are this tree's, for both builds. Each round runs, for one build
# and then the other (the order swaps every round):
#   bench/pipeline.sh 100000 64       accept + deliver end to end, CPU per message
#   bench/accept.sh 10s 64            the accept path alone (consumers off)
#   store_accepts 10 64               the store's write path, SQLite and PostgreSQL
#   bench/priority.py blast quiet     priority at depth; a quiet tenant beside a noisy one
# Logs go to $OUT (default /tmp/fairlane-ab/), one file per run; the
# headline lines of each are printed at the end. Run on an otherwise idle
# machine.
set -euo pipefail
cd "$(dirname "$0")/.."
old=${1:?OLD_DIR}
new=${2:?NEW_DIR}
rounds=${3:-3}
out=${OUT:-/tmp/fairlane-ab}
mkdir -p "$out"
run_one() { # label dir round
  local label=$1 dir=$2 round=$3
  echo "== round $round: $label ($dir)"
  CARGO_TARGET_DIR=$dir bash bench/pipeline.sh 100000 64 >"$out/$label.$round.pipeline" 2>&1 || echo "pipeline failed, see $out/$label.$round.pipeline"
  CARGO_TARGET_DIR=$dir bash bench/accept.sh 10s 64 >"$out/$label.$round.accept" 2>&1 || echo "accept failed, see $out/$label.$round.accept"
  "$dir/release/examples/store_accepts" 10 64 >"$out/$label.$round.store" 2>&1 || echo "store_accepts failed, see $out/$label.$round.store"
  CARGO_TARGET_DIR=$dir python3 bench/priority.py blast quiet >"$out/$label.$round.priority" 2>&1 || echo "priority failed, see $out/$label.$round.priority"
}
for round in $(seq "$rounds"); do
  if [ $((round % 2)) -eq 1 ]; then
    run_one old "$old" "$round"; run_one new "$new" "$round"
  else
    run_one new "$new" "$round"; run_one old "$old" "$round"
  fi
done
for label in old new; do
  echo "===== $label"
  for round in $(seq "$rounds"); do
    echo "-- round $round"
    grep -hE "^end to end|^fairlane CPU|^peak RSS" "$out/$label.$round.pipeline" || true
    grep -hE "Requests/sec|^ +50%|^ +99%" "$out/$label.$round.accept" || true
    grep -hE "accepts/s" "$out/$label.$round.store" || true
    grep -hvE "^\s*$" "$out/$label.$round.priority" | tail -n 6 || true
  done
done
