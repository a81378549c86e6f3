#!/usr/bin/env bash
# Accepts per second of one instance on SQLite against one and two instances
# on PostgreSQL, in one run on one machine, with the product as it runs:
# consumers on (SMS provider `log` to /dev/null, gate out of the way), four
# tenants sending at once, lanes in SQS (moto's server on 127.0.0.1).
#
#   cargo build --release && bash bench/instances.sh [duration] [connections]
#
# Needs: wrk, the PostgreSQL and Redis of this machine (127.0.0.1:5432 user
# root, 127.0.0.1:6379), and moto (FAIRLANE_BENCH_SQS_URL, or the venv that
# `cargo test` makes in ~/.cache/fairlane-test-venv, started here on a free
# port and stopped by its PID at the end). Each configuration gets a fresh
# database (or file), queue prefix and Redis prefix.
#
# Configurations, back to back:
#   sqlite    one instance, SQLite store, SQS lanes, local limits
#   pg-1      one instance, PostgreSQL store, SQS lanes, Redis limits
#   pg-2      two instances on one PostgreSQL database, SQS, Redis; wrk
#             drives both (one wrk per instance, half the connections each)
# After each run the script counts the store's status rows: every 2xx that
# wrk counted must be a row, and it prints how many were delivered (`sent`).
#
# What it measures on this machine: moto. Each accept waits for SQS to
# confirm its message, and a local moto server answers a few dozen
# SendMessageBatch calls a second, so all three configurations land near
# 50-80 accepts/s. examples/store_accepts.rs measures the store's write path
# alone (no HTTP, no SQS); on real SQS the HTTP figure is the one to take.
set -euo pipefail
cd "$(dirname "$0")/.."
duration=${1:-15s}
connections=${2:-64}
bin=${BIN:-${CARGO_TARGET_DIR:-target}/release/fairlane}
[ -x "$bin" ] || { echo "build first: cargo build --release" >&2; exit 1; }
command -v wrk >/dev/null || { echo "wrk is needed: apt-get install wrk" >&2; exit 1; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

work=$(mktemp -d)
pids=()
moto_pid=""
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
  if [ -n "$moto_pid" ]; then kill "$moto_pid" 2>/dev/null || true; wait "$moto_pid" 2>/dev/null || true; fi
  for db in $(psql -h 127.0.0.1 -U root -d postgres -Atc "select datname from pg_database where datname like 'fl_bench_%'"); do
    psql -h 127.0.0.1 -U root -d postgres -qc "DROP DATABASE $db WITH (FORCE)" || true
  done
  rm -rf "$work"
}
trap cleanup EXIT

sqs=${FAIRLANE_BENCH_SQS_URL:-}
if [ -z "$sqs" ]; then
  moto_port=$(free_port)
  "${XDG_CACHE_HOME:-$HOME/.cache}/fairlane-test-venv/bin/moto_server" -H 127.0.0.1 -p "$moto_port" >"$work/moto.log" 2>&1 &
  moto_pid=$!
  sqs="http://127.0.0.1:$moto_port"
  for _ in $(seq 100); do curl -sf "$sqs/moto-api/" >/dev/null 2>&1 && break; sleep 0.2; done
fi
admin=bench-admin-token-0123456789

# start NAME STORE_URL LIMITS PREFIX: starts an instance and sets $port.
# Runs in this shell (never in $(...)), so its PID is kept for the cleanup.
start() {
  local name=$1 store=$2 limits=$3 prefix=$4
  port=$(free_port)
  FAIRLANE__SERVER__LISTEN=127.0.0.1:$port \
  FAIRLANE__SERVER__ADMIN_TOKEN=$admin \
  FAIRLANE__SERVER__INSTANCE=$name \
  FAIRLANE__STORAGE__URL=$store \
  FAIRLANE__QUEUE__BACKEND=sqs \
  FAIRLANE__QUEUE__SQS__ENDPOINT_URL=$sqs \
  FAIRLANE__QUEUE__SQS__QUEUE_PREFIX=$prefix \
  FAIRLANE__QUEUE__SQS__ACCESS_KEY_ID=test \
  FAIRLANE__QUEUE__SQS__SECRET_ACCESS_KEY=test \
  FAIRLANE__LIMITS__BACKEND=$limits \
  FAIRLANE__LIMITS__REDIS_URL=redis://127.0.0.1:6379 \
  FAIRLANE__LIMITS__KEY_PREFIX=$prefix \
  FAIRLANE__LANES__FAST__HIGH_WATER_MARK=1000000000 \
  FAIRLANE__CONSUMERS__RECEIVE_WAIT_SECS=1 \
  FAIRLANE__PROVIDERS__SMS__LOG_PATH=/dev/null \
  FAIRLANE__PROVIDERS__SMS__RATE_PER_SECOND=1000000 \
  FAIRLANE__PROVIDERS__SMS__BURST=1000000 \
  RUST_LOG=warn "$bin" serve >"$work/$prefix-$name.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/readyz" >/dev/null 2>&1 && break; sleep 0.1; done
  curl -sf "http://127.0.0.1:$port/readyz" >/dev/null || { echo "instance $name did not start:" >&2; cat "$work/$prefix-$name.log" >&2; exit 1; }
}

# tenants PORT: four tenants on a plan out of the way; prints their keys.
tenants() {
  local base=http://127.0.0.1:$1 keys=()
  api() { curl -sf -H "Authorization: Bearer $admin" -H 'Content-Type: application/json' "$@"; }
  api -X PUT "$base/v1/admin/plans/bench" \
    -d '{"lane":"fast","rate_per_second":1000000,"burst":1000000,"daily_quota":1000000000,"max_in_flight":64}' >/dev/null
  for t in t1 t2 t3 t4; do
    api -X POST "$base/v1/admin/tenants" -d "{\"id\":\"$t\",\"name\":\"$t\",\"plan\":\"bench\"}" >/dev/null
    keys+=("$(api -X POST "$base/v1/admin/tenants/$t/keys" | python3 -c 'import json,sys; print(json.load(sys.stdin)["key"])')")
  done
  (IFS=,; echo "${keys[*]}")
}

# load KEYS PORT...: one wrk per port, the connections shared out; prints
# the sum of their requests/s and each wrk's summary.
load() {
  local keys=$1; shift
  local per=$(( connections / $# )) outs=()
  for port in "$@"; do
    KEYS=$keys wrk -t$(( 2 / $# > 0 ? 2 / $# : 1 )) -c"$per" -d"$duration" --latency -s bench/send_tenants.lua \
      "http://127.0.0.1:$port/v1/messages" >"$work/wrk-$port.txt" 2>&1 &
    outs+=($!)
  done
  for pid in "${outs[@]}"; do wait "$pid"; done
  local total=0
  for port in "$@"; do
    grep -E "Requests/sec|99%|Non-2xx" "$work/wrk-$port.txt" | sed "s/^/  [$port] /"
    total=$(python3 -c "print($total + float('$(awk '/Requests\/sec/ {print $2}' "$work/wrk-$port.txt")'))")
  done
  printf '  accepts/s (sum): %.0f\n' "$total"
}

report_pg() {
  sleep 3
  psql -h 127.0.0.1 -U root -d "$1" -Atc "select status || ': ' || count(*) from messages group by status order by 1" | sed 's/^/  status /'
}

stop_all() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
  pids=()
}

echo "fairlane $(git rev-parse --short HEAD 2>/dev/null || echo '?') wrk -c$connections -d$duration, 4 tenants, consumers on, SQS on $sqs"

echo "== sqlite: one instance"
start a "sqlite://$work/bench.db" local "bs$RANDOM"
keys=$(tenants "$port")
load "$keys" "$port"
sleep 3
python3 -c "import sqlite3; c=sqlite3.connect('$work/bench.db'); [print('  status', s + ':', n) for s, n in c.execute('select status, count(*) from messages group by status order by 1')]"
stop_all

for n in 1 2; do
  echo "== postgres: $n instance(s)"
  db="fl_bench_$n$RANDOM"
  psql -h 127.0.0.1 -U root -d postgres -qc "CREATE DATABASE $db"
  prefix="bp$n$RANDOM"
  ports=()
  for i in $(seq "$n"); do
    start "i$i" "postgres://root@127.0.0.1:5432/$db" redis "$prefix"
    ports+=("$port")
  done
  keys=$(tenants "${ports[0]}")
  sleep 1
  load "$keys" "${ports[@]}"
  report_pg "$db"
  stop_all
done
