#!/usr/bin/env bash
# A page of the message list beside a million messages of one tenant
# (issues 29 and 46, item 3).
#
#   cargo build --release --bin fairlane --examples && bash bench/message_list.sh [rows]
#
# 1. fairlane starts on a fresh store with its consumers off (every message
#    stays `queued`), a plan whose limits are out of the way, the tenants
#    `bench` and `other` with a key each.
# 2. bench/fill_list.py sends ROWS (default 1,000,000) messages of `bench`
#    and ROWS/10 of `other` through the batch API: one in 3 an email,
#    reference `ref-<n mod 1000>` (so each reference has ROWS/1000
#    messages). Then `bench` cancels reference `ref-7` (DELETE
#    /v1/messages?reference=…): ROWS/1000 messages, 0.1 %, are `cancelled`.
#    Nothing runs ANALYZE: the reads below go to the same process, whose
#    statistics are whatever it took itself (at its start, on an empty
#    store, and hourly).
# 3. wrk (one connection, 5 s each, --latency) reads: the first page of 100;
#    a page half way down (a cursor at the middle batch's time); one
#    reference; status=cancelled (0.1 %); status=sent (none has it);
#    channel=email; a 10-second window in the middle. It prints each one's
#    messages on the first page, latency p50 / p99 and requests a second.
# 4. Then the two-tenant read test (below): `other`'s status reads alone,
#    and beside eight clients of `bench` scanning its messages.
# PG_URL=postgres://root@127.0.0.1:5432 runs the same on PostgreSQL: a fresh
# database there (dropped at the end), the lanes on fauxqs; PG_SOCKET=DIR
# too: fairlane connects through the Unix socket in DIR.
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
  # PG_SOCKET=DIR (e.g. /var/run/postgresql): fairlane reaches PostgreSQL
  # through its Unix socket there instead of TCP.
  store=$PG_URL/$pg_db${PG_SOCKET:+?host=$PG_SOCKET}
  queue_env=(FAIRLANE__QUEUE__BACKEND=sqs FAIRLANE__QUEUE__SQS__ENDPOINT_URL=$sqs
             FAIRLANE__QUEUE__SQS__QUEUE_PREFIX=lb$$ FAIRLANE__QUEUE__SQS__REGION=us-east-1
             FAIRLANE__QUEUE__SQS__ACCESS_KEY_ID=test FAIRLANE__QUEUE__SQS__SECRET_ACCESS_KEY=test)
else
  store=sqlite://$work/fairlane.db
  queue_env=()
fi
start_fairlane() {
  env "${queue_env[@]}" \
  FAIRLANE__SERVER__LISTEN=127.0.0.1:$port \
  FAIRLANE__SERVER__ADMIN_TOKEN=$admin \
  FAIRLANE__STORAGE__URL=$store \
  FAIRLANE__CONSUMERS__ENABLED=false \
  FAIRLANE__LANES__FAST__HIGH_WATER_MARK=1000000000 \
  RUST_LOG=warn "$target/fairlane" serve >>"$work/log" 2>&1 &
  pid=$!
  for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/readyz" >/dev/null && return; sleep 0.1; done
  echo "fairlane did not start:" >&2; cat "$work/log" >&2; exit 1
}
api() { curl -sf -H "Authorization: Bearer $admin" -H 'Content-Type: application/json' "$@"; }

start_fairlane
api -X PUT "http://127.0.0.1:$port/v1/admin/plans/bench" \
  -d '{"lane":"fast","rate_per_second":1000000,"burst":1000000,"daily_quota":1000000000,"max_in_flight":100}' >/dev/null
for t in bench other; do
  api -X POST "http://127.0.0.1:$port/v1/admin/tenants" -d "{\"id\":\"$t\",\"name\":\"$t\",\"plan\":\"bench\"}" >/dev/null
done
key=$(api -X POST "http://127.0.0.1:$port/v1/admin/tenants/bench/keys" | python3 -c 'import json,sys; print(json.load(sys.stdin)["key"])')
other_key=$(api -X POST "http://127.0.0.1:$port/v1/admin/tenants/other/keys" | python3 -c 'import json,sys; print(json.load(sys.stdin)["key"])')

read -r count secs middle < <(python3 bench/fill_list.py "http://127.0.0.1:$port" "$key" "$rows")
echo "bench: $count messages through the batch API in $secs s"
read -r count secs _ < <(python3 bench/fill_list.py "http://127.0.0.1:$port" "$other_key" $((rows / 10)))
echo "other: $count messages in $secs s"
cancelled=$(curl -sf -X DELETE -H "Authorization: Bearer $key" "http://127.0.0.1:$port/v1/messages?reference=ref-7" \
  | python3 -c 'import json,sys; print(json.load(sys.stdin)["cancelled"])')
echo "bench: $cancelled messages of ref-7 cancelled"

# SETTLE_SECS=N waits before reading (e.g. for PostgreSQL's autovacuum).
sleep "${SETTLE_SECS:-0}"
iso() { python3 -c "import datetime; print(datetime.datetime.fromtimestamp($1/1000, datetime.timezone.utc).isoformat(timespec='milliseconds').replace('+00:00','Z'))"; }
from=$(iso $((middle - 5000))); to=$(iso $((middle + 5000)))
url=http://127.0.0.1:$port/v1/messages
for case in \
  "first page|$url?limit=100" \
  "half way down|$url?limit=100&cursor=$middle.z" \
  "one reference|$url?limit=100&reference=ref-8" \
  "status=cancelled|$url?limit=100&status=cancelled" \
  "status=sent|$url?limit=100&status=sent" \
  "channel=email|$url?limit=100&channel=email" \
  "10-second window|$url?limit=100&since=$from&until=$to"; do
  name=${case%%|*}; target_url=${case#*|}
  count=$(curl -sf -H "Authorization: Bearer $key" "$target_url" | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["messages"]))')
  out=$(wrk -t1 -c1 -d5s --latency -H "Authorization: Bearer $key" "$target_url")
  p50=$(awk '$1=="50%"{print $2}' <<<"$out"); p99=$(awk '$1=="99%"{print $2}' <<<"$out")
  rps=$(awk '/Requests\/sec/{print $2}' <<<"$out")
  printf '%-18s %3d messages  p50 %-9s p99 %-9s %s req/s\n' "$name" "$count" "$p50" "$p99" "$rps"
done

# 4. Two tenants: eight clients of `bench` scan for a status none of its
#    messages has (each page reads limits.list_scan_rows rows), while one client of
#    `other` reads one message's status. The other tenant's p50 / p99 alone
#    first, then beside the scans (limits.tenant_list_reads keeps the scans
#    to their own turns).
status_url=$url/$(curl -sf -H "Authorization: Bearer $other_key" "$url?limit=1" \
  | python3 -c 'import json,sys; print(json.load(sys.stdin)["messages"][0]["id"])')
status_read() {
  out=$(wrk -t1 -c1 -d"$1" --latency -H "Authorization: Bearer $other_key" "$status_url")
  printf '%-32s p50 %-9s p99 %-9s %s req/s\n' "$2" "$(awk '$1=="50%"{print $2}' <<<"$out")" \
    "$(awk '$1=="99%"{print $2}' <<<"$out")" "$(awk '/Requests\/sec/{print $2}' <<<"$out")"
}
status_read 5s "other's status, alone"
wrk -t2 -c8 -d12s --latency -H "Authorization: Bearer $key" "$url?limit=100&status=sent" >"$work/scans" &
scans=$!
sleep 1
status_read 10s "other's status, beside 8 scans"
wait "$scans"
printf '%-32s p50 %-9s p99 %-9s %s req/s (429s: %s)\n' "bench's 8 scans" \
  "$(awk '$1=="50%"{print $2}' "$work/scans")" "$(awk '$1=="99%"{print $2}' "$work/scans")" \
  "$(awk '/Requests\/sec/{print $2}' "$work/scans")" \
  "$(awk '/Non-2xx/{print $NF}' "$work/scans" | grep . || echo 0)"
