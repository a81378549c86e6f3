#!/usr/bin/env bash
# A page of the message list beside a million messages of one tenant
# (issue 29, item 3).
#
#   cargo build --release --bin fairlane --examples && bash bench/message_list.sh [rows]
#
# 1. fairlane starts on a fresh store (so the migrations run), makes the
#    tenant `bench` with a key and the tenant `other`, and stops.
# 2. ROWS (default 1,000,000) status rows of `bench` and ROWS/10 of `other`
#    go in with one INSERT … SELECT over a generated series (sqlite3 or
#    psql): time-ordered ids, created a millisecond apart, one in 20
#    `failed` and the rest `delivered`, one in 3 an email, reference
#    `ref-<n mod 1000>` (so each reference has ROWS/1000 messages).
# 3. fairlane starts again, consumers off, and wrk (one connection, 5 s
#    each, --latency) reads: the first page of 100; a page half way down
#    (the cursor of row ROWS/2); one reference; status=failed; channel=email;
#    a window of 10 minutes in the middle. It prints each one's latency
#    p50 / p99 and requests a second.
# 4. Then the two-tenant read test (below): `other`'s status reads alone,
#    and beside eight clients of `bench` scanning its messages.
# PG_URL=postgres://root@127.0.0.1:5432 runs the same on PostgreSQL: a fresh
# database there (dropped at the end), the lanes on fauxqs.
# Everything runs on this machine's cores.
set -euo pipefail
cd "$(dirname "$0")/.."
rows=${1:-1000000}
target=${CARGO_TARGET_DIR:-target}/release
[ -x "$target/fairlane" ] || { echo "build first: cargo build --release --bin fairlane --examples" >&2; exit 1; }
command -v wrk >/dev/null || { echo "wrk is needed: apt-get install wrk" >&2; exit 1; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
work=$(mktemp -d)
pid=
fauxqs_pid=
pg_db=
# shellcheck source=bench/fauxqs.sh
. bench/fauxqs.sh
cleanup() {
  for p in $pid $fauxqs_pid; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  [ -n "$pg_db" ] && psql "$PG_URL/postgres" -qAtc "DROP DATABASE IF EXISTS $pg_db WITH (FORCE)" >/dev/null 2>&1
  rm -rf "$work"
}
trap cleanup EXIT
admin=bench-admin-token-0123456789
port=$(free_port)
if [ -n "${PG_URL:-}" ]; then
  command -v psql >/dev/null || { echo "PG_URL needs psql" >&2; exit 1; }
  start_fauxqs "$work"
  pg_db=fairlane_list_bench_$$
  psql "$PG_URL/postgres" -qAtc "CREATE DATABASE $pg_db" >/dev/null
  store=$PG_URL/$pg_db
  queue_env=(FAIRLANE__QUEUE__BACKEND=sqs FAIRLANE__QUEUE__SQS__ENDPOINT_URL=$sqs
             FAIRLANE__QUEUE__SQS__QUEUE_PREFIX=lb$$ FAIRLANE__QUEUE__SQS__REGION=us-east-1
             FAIRLANE__QUEUE__SQS__ACCESS_KEY_ID=test FAIRLANE__QUEUE__SQS__SECRET_ACCESS_KEY=test)
else
  command -v sqlite3 >/dev/null || { echo "sqlite3 is needed: apt-get install sqlite3" >&2; exit 1; }
  store=sqlite://$work/fairlane.db
  queue_env=()
fi
start_fairlane() {
  env "${queue_env[@]}" \
  FAIRLANE__SERVER__LISTEN=127.0.0.1:$port \
  FAIRLANE__SERVER__ADMIN_TOKEN=$admin \
  FAIRLANE__STORAGE__URL=$store \
  FAIRLANE__CONSUMERS__ENABLED=false \
  RUST_LOG=warn "$target/fairlane" serve >>"$work/log" 2>&1 &
  pid=$!
  for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/readyz" >/dev/null && return; sleep 0.1; done
  echo "fairlane did not start:" >&2; cat "$work/log" >&2; exit 1
}
stop_fairlane() { kill "$pid"; wait "$pid" 2>/dev/null || true; pid=; }
api() { curl -sf -H "Authorization: Bearer $admin" -H 'Content-Type: application/json' "$@"; }

start_fairlane
for t in bench other; do
  api -X POST "http://127.0.0.1:$port/v1/admin/tenants" -d "{\"id\":\"$t\",\"name\":\"$t\",\"plan\":\"pro\"}" >/dev/null
done
key=$(api -X POST "http://127.0.0.1:$port/v1/admin/tenants/bench/keys" | python3 -c 'import json,sys; print(json.load(sys.stdin)["key"])')
other_key=$(api -X POST "http://127.0.0.1:$port/v1/admin/tenants/other/keys" | python3 -c 'import json,sys; print(json.load(sys.stdin)["key"])')
stop_fairlane

base=1764000000000
# The generated rows: $1 tenant, $2 how many; n from 1.
fill_sql() {
  local tenant=$1 count=$2 series id
  if [ -n "${PG_URL:-}" ]; then
    series="generate_series(1, $count) AS g(n)"
    id="'$tenant-' || lpad(to_hex(n), 12, '0')"
  else
    series="(WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < $count) SELECT n FROM g)"
    id="printf('$tenant-%012x', n)"
  fi
  cat <<SQL
INSERT INTO messages (id, tenant_id, channel, status, priority, lane, attempts, reference,
                      created_at, updated_at, sent_at, provider_message_id, test, fragments)
SELECT $id, '$tenant',
       CASE WHEN n % 3 = 0 THEN 'email' ELSE 'sms' END,
       CASE WHEN n % 20 = 0 THEN 'failed' ELSE 'delivered' END,
       'normal', 'fast', 1, 'ref-' || (n % 1000),
       $base + n, $base + n, $base + n, 'p-' || n, FALSE,
       CASE WHEN n % 3 = 0 THEN NULL ELSE 1 END
FROM $series;
SQL
}
now() { python3 -c 'import time; print(time.time())'; }
started=$(now)
for spec in "bench $rows" "other $((rows / 10))"; do
  # shellcheck disable=SC2086
  if [ -n "${PG_URL:-}" ]; then
    fill_sql $spec | psql "$store" -qAt >/dev/null
  else
    fill_sql $spec | sqlite3 "$work/fairlane.db"
  fi
done
# SQLite: fairlane takes the planner's statistics itself when it opens the
# file (and hourly); PostgreSQL: autovacuum's ANALYZE may not have run yet
# after a bulk INSERT, so the script runs it there.
if [ -n "${PG_URL:-}" ]; then psql "$store" -qAtc "ANALYZE messages" >/dev/null; fi
python3 -c "print('%d + %d rows written in %.1f s' % ($rows, $rows // 10, $(now) - $started))"

# SETTLE_SECS=N waits before reading (for autovacuum of the fresh rows).
sleep "${SETTLE_SECS:-0}"
start_fairlane
half=$((rows / 2))
half_id=$(python3 -c "print('bench-%012x' % $half)")
iso() { python3 -c "import datetime; print(datetime.datetime.fromtimestamp($1/1000, datetime.timezone.utc).isoformat().replace('+00:00','Z'))"; }
from=$(iso $((base + half))); to=$(iso $((base + half + 600000)))
url=http://127.0.0.1:$port/v1/messages
for case in \
  "first page|$url?limit=100" \
  "half way down|$url?limit=100&cursor=$((base + half)).$half_id" \
  "one reference|$url?limit=100&reference=ref-7" \
  "status=failed|$url?limit=100&status=failed" \
  "channel=email|$url?limit=100&channel=email" \
  "10-minute window|$url?limit=100&since=$from&until=$to"; do
  name=${case%%|*}; target_url=${case#*|}
  count=$(curl -sf -H "Authorization: Bearer $key" "$target_url" | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["messages"]))')
  out=$(wrk -t1 -c1 -d5s --latency -H "Authorization: Bearer $key" "$target_url")
  p50=$(awk '$1=="50%"{print $2}' <<<"$out"); p99=$(awk '$1=="99%"{print $2}' <<<"$out")
  rps=$(awk '/Requests\/sec/{print $2}' <<<"$out")
  printf '%-18s %3d messages  p50 %-9s p99 %-9s %s req/s\n' "$name" "$count" "$p50" "$p99" "$rps"
done

# 4. Two tenants: eight clients of `bench` scan for a status none of its
#    messages has (each read walks the tenant's rows), while one client of
#    `other` reads one message's status. The other tenant's p50 / p99 alone
#    first, then beside the scans (limits.tenant_list_reads keeps the scans
#    to their own turns).
status_url=http://127.0.0.1:$port/v1/messages/$(python3 -c "print('other-%012x' % 7)")
status_read() {
  out=$(wrk -t1 -c1 -d"$1" --latency -H "Authorization: Bearer $other_key" "$status_url")
  printf '%-32s p50 %-9s p99 %-9s %s req/s\n' "$2" "$(awk '$1=="50%"{print $2}' <<<"$out")" \
    "$(awk '$1=="99%"{print $2}' <<<"$out")" "$(awk '/Requests\/sec/{print $2}' <<<"$out")"
}
status_read 5s "other's status, alone"
wrk -t2 -c8 -d12s --latency -H "Authorization: Bearer $key" "$url?limit=100&status=cancelled" >"$work/scans" &
scans=$!
sleep 1
status_read 10s "other's status, beside 8 scans"
wait "$scans"
printf '%-32s p50 %-9s p99 %-9s %s req/s (429s: %s)\n' "bench's 8 scans" \
  "$(awk '$1=="50%"{print $2}' "$work/scans")" "$(awk '$1=="99%"{print $2}' "$work/scans")" \
  "$(awk '/Requests\/sec/{print $2}' "$work/scans")" \
  "$(awk '/Non-2xx/{print $NF}' "$work/scans" | grep . || echo 0)"
