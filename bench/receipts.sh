#!/usr/bin/env bash
# Twilio status callbacks at volume (issue 27, item 3).
#
#   cargo build --release --bin fairlane --examples && bash bench/receipts.sh [messages] [concurrency]
#
# 1. fairlane serve on a fresh SQLite file (the embedded default), consumers
#    on, SMS through examples/mock_sms (a Twilio-compatible endpoint that
#    answers at once with a fresh sid), `server.public_url` set so every SMS
#    names its status callback; one tenant whose webhook takes
#    `message.delivered`, answered 202 at once by examples/bare_axum.
# 2. wrk sends MESSAGES (default 20,000) SMS; the script waits until every
#    one is `sent` and reads their provider ids from the SQLite file.
# 3. examples/callbacks_rate POSTs a signed `delivered` callback for each,
#    CONCURRENCY (default 64) at once, and prints callbacks/s and latency.
# 4. The script waits until every `message.delivered` webhook call has
#    been delivered and prints how long after the last callback, then
#    checks each message: status `delivered`, one `delivered` event.
# 5. The SES events queue: fauxqs (bench/fauxqs.sh) holds the email
#    provider's `events_queue_url` from the start. wrk sends MESSAGES more
#    SMS; once they are `sent`, fairlane is stopped, examples/ses_events_fill
#    puts an SES `Delivery` event (`mail.messageId` = the SMS's provider id,
#    its `message_id` tag the SMS's own id: a receipt is matched whatever
#    the channel, and SES itself is not in this run) for each into the queue, and fairlane is
#    started again on the same file: the script times the drain (first
#    event recorded → last) and checks each message as in 4.
# Everything runs on this machine's cores: fairlane, the mock provider, the
# webhook endpoint, fauxqs and the clients.
# PG_URL=postgres://root@127.0.0.1:5432 runs the same on PostgreSQL: a fresh
# database on that server (dropped at the end) and the lanes on fauxqs (the
# embedded queue is SQLite's); the checks then read the database with psql.
set -euo pipefail
cd "$(dirname "$0")/.."
messages=${1:-20000}
concurrency=${2:-64}
target=${CARGO_TARGET_DIR:-target}/release
for b in fairlane examples/mock_sms examples/bare_axum examples/callbacks_rate examples/ses_events_fill; do
  [ -x "$target/$b" ] || { echo "build first: cargo build --release --bin fairlane --examples" >&2; exit 1; }
done
command -v wrk >/dev/null || { echo "wrk is needed: apt-get install wrk" >&2; exit 1; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
work=$(mktemp -d)
pids=()
# shellcheck source=bench/fauxqs.sh
. bench/fauxqs.sh
pg_db=
cleanup() {
  for p in "${pids[@]}" $fauxqs_pid; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  [ -n "$pg_db" ] && psql "$PG_URL/postgres" -qAtc "DROP DATABASE IF EXISTS $pg_db WITH (FORCE)" >/dev/null 2>&1
  rm -rf "$work"
}
trap cleanup EXIT
start_fauxqs "$work"
events_queue=$("$target/examples/ses_events_fill" "$sqs" ses-events /dev/null 2>/dev/null | tail -1)
admin=bench-admin-token-0123456789
port=$(free_port); mock_port=$(free_port); hook_port=$(free_port)
"$target/examples/mock_sms" "$mock_port" 0 >/dev/null 2>&1 & pids+=($!)
"$target/examples/bare_axum" "127.0.0.1:$hook_port" >/dev/null 2>&1 & pids+=($!)
# The store: the bench's SQLite file, or with PG_URL a fresh database and
# the lanes on fauxqs.
if [ -n "${PG_URL:-}" ]; then
  command -v psql >/dev/null || { echo "PG_URL needs psql" >&2; exit 1; }
  pg_db=fairlane_receipts_bench_$$
  psql "$PG_URL/postgres" -qAtc "CREATE DATABASE $pg_db" >/dev/null
  store=$PG_URL/$pg_db
  queue_env=(FAIRLANE__QUEUE__BACKEND=sqs FAIRLANE__QUEUE__SQS__ENDPOINT_URL=$sqs
             FAIRLANE__QUEUE__SQS__QUEUE_PREFIX=rb$$ FAIRLANE__QUEUE__SQS__REGION=us-east-1
             FAIRLANE__QUEUE__SQS__ACCESS_KEY_ID=test FAIRLANE__QUEUE__SQS__SECRET_ACCESS_KEY=test)
else
  store=sqlite://$work/fairlane.db
  queue_env=()
fi
# start_fairlane: on the bench's store; sets pid.
start_fairlane() {
  env "${queue_env[@]}" \
  FAIRLANE__SERVER__LISTEN=127.0.0.1:$port \
  FAIRLANE__SERVER__ADMIN_TOKEN=$admin \
  FAIRLANE__SERVER__PUBLIC_URL=http://127.0.0.1:$port \
  FAIRLANE__STORAGE__URL=$store \
  FAIRLANE__LANES__FAST__HIGH_WATER_MARK=1000000000 \
  FAIRLANE__PROVIDERS__SMS__KIND=http \
  FAIRLANE__PROVIDERS__SMS__BASE_URL=http://127.0.0.1:$mock_port \
  FAIRLANE__PROVIDERS__SMS__ACCOUNT_SID=ACbench \
  FAIRLANE__PROVIDERS__SMS__AUTH_TOKEN=bench \
  FAIRLANE__PROVIDERS__SMS__FROM=+15550001111 \
  FAIRLANE__PROVIDERS__SMS__RATE_PER_SECOND=1000000 \
  FAIRLANE__PROVIDERS__SMS__BURST=100000 \
  FAIRLANE__WEBHOOKS__ALLOW_HTTP=true \
  FAIRLANE__WEBHOOKS__ALLOW_PRIVATE='["127.0.0.1/32"]' \
  FAIRLANE__PROVIDERS__EMAIL__KIND=ses \
  FAIRLANE__PROVIDERS__EMAIL__ENDPOINT_URL=$sqs \
  FAIRLANE__PROVIDERS__EMAIL__REGION=us-east-1 \
  FAIRLANE__PROVIDERS__EMAIL__ACCESS_KEY_ID=test \
  FAIRLANE__PROVIDERS__EMAIL__SECRET_ACCESS_KEY=test \
  FAIRLANE__PROVIDERS__EMAIL__EVENTS_QUEUE_URL=$events_queue \
  RUST_LOG=warn "$target/fairlane" serve >>"$work/log" 2>&1 & pids+=($!)
  pid=${pids[-1]}
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/healthz" >/dev/null && return; sleep 0.1; done
  echo "fairlane did not start:" >&2; cat "$work/log" >&2; exit 1
}
start_fairlane
api() { curl -sf -H "Authorization: Bearer $admin" -H 'Content-Type: application/json' "$@"; }
base=http://127.0.0.1:$port
api -X PUT "$base/v1/admin/plans/bench" \
  -d '{"lane":"fast","rate_per_second":1000000,"burst":1000000,"daily_quota":1000000000,"max_in_flight":100000}' >/dev/null
api -X POST "$base/v1/admin/tenants" -d '{"id":"bench","name":"Bench","plan":"bench"}' >/dev/null
key=$(api -X POST "$base/v1/admin/tenants/bench/keys" | python3 -c 'import json,sys; print(json.load(sys.stdin)["key"])')
api -X PUT "$base/v1/admin/tenants/bench/webhook" \
  -d "{\"url\":\"http://127.0.0.1:$hook_port/v1/messages\",\"events\":[\"message.delivered\"]}" >/dev/null
counter() { curl -sf "$base/metrics" | awk -v name="$1" '$1 ~ "^"name"(\\{|$)" {s += $NF} END {printf "%d\n", s}'; }
hooks_delivered() { curl -sf "$base/metrics" | awk '$1 ~ /^fairlane_webhook_attempts_total\{/ && /result="delivered"/ {s += $NF} END {printf "%d\n", s}'; }
cpu_secs() { awk -v hz="$(getconf CLK_TCK)" '{printf "%.3f\n", ($14 + $15) / hz}' "/proc/$pid/stat"; }

# send_sms FILE: sends MESSAGES more SMS, waits until every one is `sent`
# and writes, for each message `sent` (not yet delivered), its provider id
# and fairlane's id (the one the receipt carries back) to FILE, a line each.
send_sms() {
  local goal total
  goal=$(( $(counter fairlane_messages_accepted_total) + messages ))
  KEYS=$key wrk -t2 -c64 -d600s -s bench/send_tenants.lua "$base/v1/messages" >/dev/null 2>&1 & wrk_pid=$!
  while [ "$(counter fairlane_messages_accepted_total)" -lt "$goal" ]; do sleep 0.1; done
  kill -INT "$wrk_pid"; wait "$wrk_pid" || true
  total=$(counter fairlane_messages_accepted_total)
  while [ "$(counter fairlane_messages_delivered_total)" -lt "$total" ]; do sleep 0.1; done
  if [ -n "$pg_db" ]; then
    psql "$store" -qAt -F ' ' -c "SELECT provider_message_id, id FROM messages WHERE status = 'sent'" >"$1"
    return
  fi
  python3 - "$work/fairlane.db" "$1" <<'PY'
import sqlite3, sys
db = sqlite3.connect(sys.argv[1])
ids = [f"{row[0]} {row[1]}" for row in db.execute("SELECT provider_message_id, id FROM messages WHERE status = 'sent'")]
open(sys.argv[2], "w").write("\n".join(ids) + "\n")
PY
}
# check_delivered FILE: each message of the provider ids in FILE is
# `delivered`, with exactly one `delivered` event.
check_delivered() {
  if [ -n "$pg_db" ]; then
    psql "$store" -qAt -F ' ' <<SQL | { read -r n delivered events distinct
CREATE TEMP TABLE ids(id text PRIMARY KEY, message_id text);
\\copy ids FROM '$1' WITH (DELIMITER ' ')
SELECT (SELECT COUNT(*) FROM ids),
       (SELECT COUNT(*) FROM messages WHERE provider_message_id IN (SELECT id FROM ids) AND status = 'delivered'),
       COUNT(*), COUNT(DISTINCT e.message_id)
  FROM message_events e JOIN messages m ON m.id = e.message_id
 WHERE e.event = 'delivered' AND m.provider_message_id IN (SELECT id FROM ids);
SQL
      mark=""; { [ "$delivered" = "$n" ] && [ "$events" = "$n" ] && [ "$distinct" = "$n" ]; } || mark="  <-- MISMATCH"
      echo "check: $delivered of $n messages delivered; $events delivered events for $distinct messages$mark"; }
    return
  fi
  python3 - "$work/fairlane.db" "$1" <<'PY'
import sqlite3, sys
db = sqlite3.connect(sys.argv[1])
ids = [line.split()[0] for line in open(sys.argv[2]) if line.strip()]
db.execute("CREATE TEMP TABLE ids(id TEXT PRIMARY KEY)")
db.executemany("INSERT INTO ids VALUES (?)", [(i,) for i in ids])
delivered = db.execute("SELECT COUNT(*) FROM messages WHERE provider_message_id IN (SELECT id FROM ids) AND status = 'delivered'").fetchone()[0]
events = db.execute("SELECT COUNT(*), COUNT(DISTINCT e.message_id) FROM message_events e JOIN messages m ON m.id = e.message_id "
                    "WHERE e.event = 'delivered' AND m.provider_message_id IN (SELECT id FROM ids)").fetchone()
n = len(ids)
print(f"check: {delivered} of {n} messages delivered; {events[0]} delivered events for {events[1]} messages"
      + ("" if delivered == n and events[0] == events[1] == n else "  <-- MISMATCH"))
PY
}

send_sms "$work/sids"
accepted=$(wc -l <"$work/sids")
echo "$accepted SMS sent; their provider ids read"
hooks0=$(hooks_delivered)
cpu0=$(cpu_secs)
t0=$(date +%s.%N)
"$target/examples/callbacks_rate" "$base" bench "$work/sids" "$concurrency"
t_cb=$(date +%s.%N)
deadline=$(( $(date +%s) + 600 ))
while [ "$(hooks_delivered)" -lt $((hooks0 + accepted)) ]; do
  [ "$(date +%s)" -lt "$deadline" ] || { echo "webhooks not all delivered after 600 s" >&2; break; }
  sleep 0.1
done
t_hooks=$(date +%s.%N)
cpu1=$(cpu_secs)
python3 - "$accepted" "$t0" "$t_cb" "$t_hooks" "$cpu0" "$cpu1" "$(( $(hooks_delivered) - hooks0 ))" <<'PY'
import sys
n, t0, tc, th, c0, c1, hooks = sys.argv[1:]
n, hooks = int(n), int(hooks)
t0, tc, th, c0, c1 = (float(x) for x in (t0, tc, th, c0, c1))
print(f"webhooks: {hooks} message.delivered calls delivered, the last {th - tc:.1f} s after the last callback; "
      f"callbacks to webhooks end to end {n / (th - t0):.0f}/s; fairlane CPU {1e6 * (c1 - c0) / n:.0f} µs per callback with its webhook")
PY
check_delivered "$work/sids"

# 5. The SES events queue.
send_sms "$work/ses_ids"
events=$(wc -l <"$work/ses_ids")
kill "$pid"; wait "$pid" 2>/dev/null || true
# The stopped instance's long polls (20 s) are still open on the server,
# which would hand them the first events, invisible until their visibility
# timeout: they end before the queue is filled.
sleep 21
# A receipt matches only what its own provider sent, or a message that
# names no provider (sent before fairlane recorded one). These SMS stand in
# for emails, which this run has no SES to send: their provider is cleared
# so the SES provider's events match them as such older rows.
if [ -n "$pg_db" ]; then
  psql "$store" -qAtc "UPDATE messages SET provider = NULL WHERE status = 'sent'" >/dev/null
else
  python3 - "$work/fairlane.db" <<'PY'
import sqlite3, sys
db = sqlite3.connect(sys.argv[1])
db.execute("UPDATE messages SET provider = NULL WHERE status = 'sent'")
db.commit()
PY
fi
"$target/examples/ses_events_fill" "$sqs" ses-events "$work/ses_ids" >/dev/null 2>&1
echo "$events SES Delivery events in the queue; fairlane starts again"
# The SES provider is the email pool's first, named `email` by default.
ses_count() { curl -sf "$base/metrics" | awk '$1 ~ /^fairlane_receipts_total\{/ && /provider="email"/ && /outcome="delivered"/ {s += $NF} END {printf "%d\n", s}'; }
start_fairlane
cpu0=$(cpu_secs)
deadline=$(( $(date +%s) + 600 ))
while [ "$(ses_count)" -lt 1 ]; do
  [ "$(date +%s)" -lt "$deadline" ] || { echo "no SES event recorded after 600 s" >&2; exit 1; }
  sleep 0.01
done
t0=$(date +%s.%N)
while [ "$(ses_count)" -lt "$events" ]; do
  [ "$(date +%s)" -lt "$deadline" ] || { echo "SES events not all recorded after 600 s" >&2; break; }
  sleep 0.05
done
t1=$(date +%s.%N)
cpu1=$(cpu_secs)
python3 - "$events" "$t0" "$t1" "$cpu0" "$cpu1" "$(ses_count)" <<'PY'
import sys
n, t0, t1, c0, c1, got = sys.argv[1:]
n, got = int(n), int(got)
t0, t1, c0, c1 = (float(x) for x in (t0, t1, c0, c1))
print(f"SES events: {got} of {n} recorded in {t1 - t0:.1f} s after the first: {got / (t1 - t0):.0f}/s; fairlane CPU {1e6 * (c1 - c0) / max(got, 1):.0f} µs per event (start-up included)")
PY
check_delivered "$work/ses_ids"
