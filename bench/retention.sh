#!/usr/bin/env bash
# How fast retention erases, and what a run costs the sends beside it (issue 29).
#
#   cargo build --release --bin fairlane --examples && bash bench/retention.sh [rows] [tenants]
#
# 1. fairlane serve on a fresh SQLite file (or, with PG_URL, a fresh
#    PostgreSQL database with the lanes on fauxqs, bench/fauxqs.sh), to
#    create the schema and TENANTS tenants (default 4) with retention_days 1.
# 2. fairlane is stopped and ROWS (default 1,000,000) settled messages are
#    written straight into the store, spread over the tenants, created ten
#    days ago, each with a reference, metadata and an error, and one event
#    with a detail each (as a bounce leaves them). (Written by SQL, not
#    sent: the point is the erasure; usage triggers count them as they go.)
# 3. fairlane is started again with `retention.interval_secs = 3600`: the run
#    at start-up erases everything. Meanwhile wrk sends emails for one other
#    tenant (retention 90, consumers on, `log` provider) at 16 connections.
#    The script waits for the run's INFO line and prints its `erased` and
#    `elapsed_ms` (erasures per second) and the sends' rate and p99 during
#    the run; then it checks that no erased text is left (SQLite: the file
#    and its log as bytes; PostgreSQL: the rows).
set -euo pipefail
cd "$(dirname "$0")/.."
rows=${1:-1000000}
tenants=${2:-4}
target=${CARGO_TARGET_DIR:-target}/release
bin=${BIN:-$target/fairlane}
[ -x "$bin" ] || { echo "build first: cargo build --release --bin fairlane --examples" >&2; exit 1; }
command -v wrk >/dev/null || { echo "wrk is needed: apt-get install wrk" >&2; exit 1; }
command -v sqlite3 >/dev/null || { echo "sqlite3 is needed" >&2; exit 1; }

work=$(mktemp -d)
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
port=$(free_port)
admin=bench-admin-token-0123456789
pid=
pg_db=
# shellcheck source=bench/fauxqs.sh
. bench/fauxqs.sh
cleanup() {
  [ -n "$pid" ] && kill "$pid" 2>/dev/null; [ -n "$fauxqs_pid" ] && kill "$fauxqs_pid" 2>/dev/null; wait 2>/dev/null
  [ -n "$pg_db" ] && psql "$PG_URL/postgres" -qAtc "DROP DATABASE IF EXISTS $pg_db WITH (FORCE)" >/dev/null 2>&1
  if [ -n "${KEEP_WORK:-}" ]; then echo "kept $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT

store=sqlite://$work/fairlane.db
queue_env=()
if [ -n "${PG_URL:-}" ]; then
  command -v psql >/dev/null || { echo "PG_URL needs psql" >&2; exit 1; }
  start_fauxqs "$work"
  pg_db=fairlane_retention_$$
  psql "$PG_URL/postgres" -qAtc "CREATE DATABASE $pg_db" >/dev/null
  store=$PG_URL/$pg_db
  queue_env=(FAIRLANE__QUEUE__BACKEND=sqs FAIRLANE__QUEUE__SQS__ENDPOINT_URL=$sqs
             FAIRLANE__QUEUE__SQS__QUEUE_PREFIX=ret$$ FAIRLANE__QUEUE__SQS__REGION=us-east-1
             FAIRLANE__QUEUE__SQS__ACCESS_KEY_ID=test FAIRLANE__QUEUE__SQS__SECRET_ACCESS_KEY=test)
fi
start() {
  env "${queue_env[@]}" \
    FAIRLANE__SERVER__LISTEN=127.0.0.1:$port FAIRLANE__SERVER__ADMIN_TOKEN=$admin \
    FAIRLANE__STORAGE__URL=$store FAIRLANE__LANES__FAST__HIGH_WATER_MARK=1000000000 \
    FAIRLANE__PROVIDERS__EMAIL__KIND=log FAIRLANE__PROVIDERS__EMAIL__LOG_PATH=/dev/null \
    FAIRLANE__PROVIDERS__EMAIL__RATE_PER_SECOND=1000000 FAIRLANE__PROVIDERS__EMAIL__BURST=100000 \
    RUST_LOG=info "$bin" serve >>"$work/log" 2>&1 &
  pid=$!
  for _ in $(seq 200); do curl -sf "http://127.0.0.1:$port/healthz" >/dev/null && return; sleep 0.1; done
  echo "fairlane did not start:" >&2; cat "$work/log" >&2; exit 1
}
stop() { kill -TERM "$pid"; wait "$pid" 2>/dev/null || true; pid=; }
api() { curl -sf -H "Authorization: Bearer $admin" -H 'Content-Type: application/json' "$@"; }
sql() { if [ -n "$pg_db" ]; then psql "$store" -qAtc "$1"; else sqlite3 "$work/fairlane.db" "PRAGMA secure_delete = ON; $1"; fi; }

# 1. Schema and tenants.
start
api -X PUT "http://127.0.0.1:$port/v1/admin/plans/bench" \
  -d '{"lane":"fast","rate_per_second":1000000,"burst":1000000,"daily_quota":1000000000,"max_in_flight":100000}' >/dev/null
for t in $(seq "$tenants"); do
  api -X POST "http://127.0.0.1:$port/v1/admin/tenants" -d "{\"id\":\"old$t\",\"name\":\"Old $t\",\"plan\":\"bench\",\"retention_days\":1}" >/dev/null
done
api -X POST "http://127.0.0.1:$port/v1/admin/tenants" -d '{"id":"live","name":"Live","plan":"bench","retention_days":90}' >/dev/null
KEY=$(api -X POST "http://127.0.0.1:$port/v1/admin/tenants/live/keys" | python3 -c 'import json,sys; print(json.load(sys.stdin)["key"])')
export KEY
stop

# 2. Settled messages ten days old, written by SQL.
t_fill=$(date +%s.%N)
ten_days_ago=$(( $(date +%s) * 1000 - 10 * 86400000 ))
series=$(if [ -n "$pg_db" ]; then echo "generate_series(1, $rows) AS s(n)"; else
  echo "(WITH RECURSIVE c(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM c WHERE n < $rows) SELECT n FROM c) AS s"; fi)
sql "INSERT INTO messages (id, tenant_id, channel, status, priority, lane, attempts, reference, metadata, created_at, updated_at, last_error, provider_message_id)
     SELECT 'm' || n, 'old' || (n % $tenants + 1), 'email', 'bounced', 'normal', 'fast', 1, 'ref-retsentinel-' || n,
            '{\"who\":\"retsentinel-' || n || '@example.com\"}', $ten_days_ago + n, $ten_days_ago + n,
            'bounced: retsentinel-' || n || '@example.com', 'p' || n FROM $series"
sql "INSERT INTO message_events (message_id, tenant_id, at, event, status, attempts, detail)
     SELECT id, tenant_id, created_at, 'bounced', 'bounced', 1, '550 retsentinel mailbox unknown' FROM messages WHERE tenant_id LIKE 'old%'"
echo "wrote $rows messages and their events in $(python3 -c "import time,sys; print(f'{time.time()-float(sys.argv[1]):.1f}')" "$t_fill") s"

# 3. The run at start-up, beside a live tenant's sends. (The first start's
# run, with no tenants yet, wrote a line of its own: wait for the next.)
runs_before=$(grep -c "Retention run finished" "$work/log" || true)
start
t0=$(date +%s.%N)
wrk -t2 -c16 -d600s --latency -s bench/send_email.lua "http://127.0.0.1:$port/v1/messages" >"$work/wrk.txt" &
wrk_pid=$!
deadline=$(( $(date +%s) + 1800 ))
until [ "$(grep -c "Retention run finished" "$work/log" || true)" -gt "$runs_before" ]; do
  [ "$(date +%s)" -lt "$deadline" ] || { echo "no retention run after 1800 s" >&2; kill "$wrk_pid"; exit 1; }
  sleep 0.2
done
t1=$(date +%s.%N)
kill -INT "$wrk_pid"; wait "$wrk_pid" || true
line=$(grep "Retention run finished" "$work/log" | tail -1)
echo "$line" | sed 's/\x1b\[[0-9;]*m//g'
erased=$(echo "$line" | sed 's/\x1b\[[0-9;]*m//g' | grep -o 'erased=[0-9]*' | cut -d= -f2)
elapsed=$(echo "$line" | sed 's/\x1b\[[0-9;]*m//g' | grep -o 'elapsed_ms=[0-9]*' | cut -d= -f2)
python3 -c "import sys; e, ms = int(sys.argv[1]), int(sys.argv[2]); print(f'erased {e} messages in {ms/1000:.1f} s: {e/(ms/1000):.0f}/s')" "$erased" "$elapsed"
python3 -c "import sys, re; t=open(sys.argv[1]).read(); r=re.search(r'Requests/sec:\s*([\d.]+)', t); print('sends beside the run (16 connections):', r.group(1) if r else '?', 'requests/s')" "$work/wrk.txt"
awk '/  50%|  99%/' "$work/wrk.txt"
stop

# 4. Nothing of the erased text is left.
if [ -n "$pg_db" ]; then
  left=$(sql "SELECT (SELECT COUNT(*) FROM messages WHERE reference IS NOT NULL AND tenant_id LIKE 'old%') + (SELECT COUNT(*) FROM message_events WHERE detail LIKE '%retsentinel%')")
  echo "rows still holding erased text: $left"
else
  hits=$(cat "$work/fairlane.db" "$work/fairlane.db-wal" 2>/dev/null | grep -c -a retsentinel || true)
  echo "lines of the SQLite file and log holding erased text: $hits ($(du -h "$work/fairlane.db" | cut -f1) file)"
fi
