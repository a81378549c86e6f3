#!/usr/bin/env bash
# The whole pipeline at once: accepting and delivering (issue 9).
#
#   cargo build --release --bin fairlane --examples && bash bench/pipeline.sh [messages] [connections]
#
# 1. The ceiling: examples/bare_axum (parse the JSON body, answer 202) under
#    wrk -t2 -cCONNECTIONS -d10s with bench/send.lua.
# 2. fairlane serve on a fresh SQLite file, embedded default, consumers on,
#    the email provider `log` writing to /dev/null with a gate far above any
#    rate reached (so delivery is limited by fairlane alone), one tenant on a
#    plan whose limits are out of the way.
# 3. wrk sends emails on CONNECTIONS connections (default 64) until MESSAGES
#    (default 100,000) are accepted; meanwhile the script samples RSS and the
#    delivered counter. Then it waits until every accepted message is sent.
# PAUSED_BACKLOG=N first gives a paused tenant N messages (see below).
# TEMPLATE=1 sends by template (bench/send_template.lua) instead (issue 48).
# MAX_IN_FLIGHT (default 100000), EMAIL_RATE (1000000) and EMAIL_BURST
# (100000) set the tenant's max_in_flight and the provider's gate: e.g.
# MAX_IN_FLIGHT=8 EMAIL_RATE=3000 EMAIL_BURST=100 keeps the tenant at its cap
# with its backlog parked.
# Prints: accepts/s and accept p50/p99 (wrk), deliveries/s during the load
# and after it, the end-to-end rate (first request to last `sent`) and its
# share of the ceiling, the peak RSS, fairlane's CPU per message, and the
# store's rows written and commits per message (fairlane_store_*_total), and
# the bytes fairlane wrote to disk per message (/proc/PID/io write_bytes).
set -euo pipefail
cd "$(dirname "$0")/.."
messages=${1:-100000}
connections=${2:-64}
target=${CARGO_TARGET_DIR:-target}/release
bin=${BIN:-$target/fairlane}
[ -x "$bin" ] && [ -x "$target/examples/bare_axum" ] || { echo "build first: cargo build --release --bin fairlane --examples" >&2; exit 1; }
command -v wrk >/dev/null || { echo "wrk is needed: apt-get install wrk" >&2; exit 1; }

work=$(mktemp -d)
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
port=$(free_port)
admin=bench-admin-token-0123456789
pid=
bare=
hook=
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; [ -n "$bare" ] && kill "$bare" 2>/dev/null; [ -n "$hook" ] && kill "$hook" 2>/dev/null; wait 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT

# 1. The ceiling, measured in the same run.
bare_port=$(free_port)
"$target/examples/bare_axum" "127.0.0.1:$bare_port" & bare=$!
sleep 0.5
ceiling=$(KEY=x wrk -t2 -c"$connections" -d10s -s bench/send.lua "http://127.0.0.1:$bare_port/v1/messages" | awk '/Requests\/sec/ {print $2}')
kill "$bare"; wait "$bare" 2>/dev/null || true; bare=
echo "ceiling (bare axum): $ceiling requests/s"

# WEBHOOK=1: the tenant has a webhook for `message.sent`, answered 202 by a
# second bare_axum over plain http; the run then also waits until every
# call is delivered. WEBHOOK=h2 or WEBHOOK=h1: the same handler over https
# (examples/tls_endpoint, its CA given to fairlane as webhooks.ca_file),
# offering HTTP/2 and HTTP/1.1 in its handshake, or HTTP/1.1 only.
# WEBHOOK_BATCH=N: the endpoint takes up to N events per call (its
# `max_events_per_call`; 1, one event per call, by default).
webhook=${WEBHOOK:-0}
if [ "$webhook" != 0 ]; then
  hook_port=$(free_port)
  case "$webhook" in
    1) "$target/examples/bare_axum" "127.0.0.1:$hook_port" & hook=$!; scheme=http ;;
    h2|h1) "$target/examples/tls_endpoint" "127.0.0.1:$hook_port" "$work/ca.pem" "$webhook" & hook=$!; scheme=https ;;
    *) echo "WEBHOOK is 0, 1, h2 or h1" >&2; exit 1 ;;
  esac
  for _ in $(seq 50); do [ "$scheme" = http ] || [ -s "$work/ca.pem" ] && break; sleep 0.1; done
  sleep 0.3
  [ "$scheme" = http ] || export FAIRLANE__WEBHOOKS__CA_FILE=$work/ca.pem
fi

# 2. fairlane with consumers on.
FAIRLANE__SERVER__LISTEN=127.0.0.1:$port \
FAIRLANE__SERVER__ADMIN_TOKEN=$admin \
FAIRLANE__STORAGE__URL=sqlite://$work/fairlane.db \
FAIRLANE__LANES__FAST__HIGH_WATER_MARK=1000000000 \
FAIRLANE__PROVIDERS__EMAIL__KIND=log \
FAIRLANE__PROVIDERS__EMAIL__LOG_PATH=/dev/null \
FAIRLANE__PROVIDERS__EMAIL__RATE_PER_SECOND=${EMAIL_RATE:-1000000} \
FAIRLANE__PROVIDERS__EMAIL__BURST=${EMAIL_BURST:-100000} \
FAIRLANE__WEBHOOKS__ALLOW_HTTP=true \
FAIRLANE__WEBHOOKS__ALLOW_PRIVATE='["127.0.0.1/32"]' \
RUST_LOG=warn "$bin" serve >>"$work/log" 2>&1 &
pid=$!
# PID_FILE=F: fairlane's PID is written to F (to attach a profiler).
[ -n "${PID_FILE:-}" ] && echo "$pid" >"$PID_FILE"
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/healthz" >/dev/null && break; sleep 0.1; done
curl -sf "http://127.0.0.1:$port/healthz" >/dev/null || { echo "fairlane did not start:" >&2; cat "$work/log" >&2; exit 1; }
api() { curl -sf -H "Authorization: Bearer $admin" -H 'Content-Type: application/json' "$@"; }
api -X PUT "http://127.0.0.1:$port/v1/admin/plans/bench" \
  -d '{"lane":"fast","rate_per_second":1000000,"burst":1000000,"daily_quota":1000000000,"max_in_flight":'"${MAX_IN_FLIGHT:-100000}"'}' >/dev/null
api -X POST "http://127.0.0.1:$port/v1/admin/tenants" -d '{"id":"bench","name":"Bench","plan":"bench"}' >/dev/null
KEY=$(api -X POST "http://127.0.0.1:$port/v1/admin/tenants/bench/keys" | python3 -c 'import json,sys; print(json.load(sys.stdin)["key"])')
export KEY
if [ "$webhook" != 0 ]; then
  api -X PUT "http://127.0.0.1:$port/v1/admin/tenants/bench/webhook" \
    -d "{\"url\":\"$scheme://127.0.0.1:$hook_port/v1/messages\",\"events\":[\"message.sent\"],\"max_events_per_call\":${WEBHOOK_BATCH:-1}}" >/dev/null
fi
# TEMPLATE=1: every send names a template (subject and text with two
# placeholders) instead of carrying its content; otherwise the same email.
script=bench/send_email.lua
if [ "${TEMPLATE:-0}" != 0 ]; then
  TEMPLATE_ID=$(api -X POST "http://127.0.0.1:$port/v1/admin/tenants/bench/templates" \
    -d '{"name":"receipt","channel":"email","subject":"Your receipt, ((name))","text":"Thank you for your order ((order)), ((name))."}' \
    | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')
  export TEMPLATE_ID
  script=bench/send_template.lua
fi
counter() { curl -sf "http://127.0.0.1:$port/metrics" | awk -v name="$1" '$1 ~ "^"name"(\\{|$)" {s += $NF} END {printf "%d\n", s}'; }
rss_max=0
# CPU time (user + system, seconds) fairlane has used so far: per message,
# a figure that stays comparable when other work shares the machine.
cpu_secs() { awk -v hz="$(getconf CLK_TCK)" '{printf "%.3f\n", ($14 + $15) / hz}' /proc/$pid/stat; }
# Bytes fairlane has sent to storage (its SQLite log and the checkpoints
# into the database file; the `log` provider writes to /dev/null).
disk_bytes() { awk '$1 == "write_bytes:" {print $2}' /proc/$pid/io; }
sample_rss() { local r; r=$(awk '/VmRSS/ {print $2}' /proc/$pid/status); [ "$r" -gt "$rss_max" ] && rss_max=$r; true; }

# With PAUSED_BACKLOG=N, a second tenant is paused first and given N
# messages, which must cost the load below nothing (they are set aside).
paused_backlog=${PAUSED_BACKLOG:-0}
if [ "$paused_backlog" -gt 0 ]; then
  api -X POST "http://127.0.0.1:$port/v1/admin/tenants" -d '{"id":"held","name":"Held","plan":"bench"}' >/dev/null
  api -X PATCH "http://127.0.0.1:$port/v1/admin/tenants/held" -d '{"status":"paused"}' >/dev/null
  held_key=$(api -X POST "http://127.0.0.1:$port/v1/admin/tenants/held/keys" | python3 -c 'import json,sys; print(json.load(sys.stdin)["key"])')
  KEY=$held_key wrk -t2 -c"$connections" -d600s -s bench/send_email.lua "http://127.0.0.1:$port/v1/messages" >/dev/null &
  fill_pid=$!
  while [ "$(counter fairlane_messages_accepted_total)" -lt "$paused_backlog" ]; do sleep 0.2; done
  kill -INT "$fill_pid"; wait "$fill_pid" || true
  sleep 2
  echo "paused tenant's backlog: $(api "http://127.0.0.1:$port/v1/admin/queues" | python3 -c 'import json,sys; l=json.load(sys.stdin)["lanes"][0]; print(l["held"], "held,", l["depth"], "in depth")')"
  messages=$((messages + $(counter fairlane_messages_accepted_total)))
fi

# 3. The load: wrk until MESSAGES are accepted, then SIGINT (wrk prints its
# latency figures on SIGINT).
before_load=$(counter fairlane_messages_accepted_total)
rows0=$(counter fairlane_store_rows_written_total)
commits0=$(counter fairlane_store_commits_total)
disk0=$(disk_bytes)
cpu0=$(cpu_secs)
hook_cpu0=0
[ -n "$hook" ] && hook_cpu0=$(awk -v hz="$(getconf CLK_TCK)" '{printf "%.3f\n", ($14 + $15) / hz}' /proc/$hook/stat)
t0=$(date +%s.%N)
wrk -t2 -c"$connections" -d600s --latency -s "$script" \
  "http://127.0.0.1:$port/v1/messages" >"$work/wrk.txt" &
wrk_pid=$!
while [ "$(counter fairlane_messages_accepted_total)" -lt "$messages" ]; do
  sample_rss
  kill -0 "$wrk_pid" 2>/dev/null || { echo "wrk ended early:" >&2; cat "$work/wrk.txt" >&2; exit 1; }
  sleep 0.1
done
kill -INT "$wrk_pid"; wait "$wrk_pid" || true
t_load=$(date +%s.%N)
delivered_during=$(counter fairlane_messages_delivered_total)
accepted=$(counter fairlane_messages_accepted_total)
accepted=$((accepted - before_load))
while [ "$(counter fairlane_messages_delivered_total)" -lt "$accepted" ]; do sample_rss; sleep 0.1; done
t1=$(date +%s.%N)
cpu1=$(cpu_secs)
rows1=$(counter fairlane_store_rows_written_total)
commits1=$(counter fairlane_store_commits_total)
disk1=$(disk_bytes)
sample_rss
# Rows and commits of the SQLite store per message accepted and delivered
# (builds from issue 45 on count them; older ones print nothing).
if [ "$commits1" -gt "$commits0" ]; then
  python3 -c "import sys; a, r, c = (int(x) for x in sys.argv[1:]); print(f'store: {r/a:.2f} rows written and {c/a:.3f} commits per message ({a/c:.1f} messages per commit)')" \
    "$accepted" "$((rows1 - rows0))" "$((commits1 - commits0))"
fi
python3 -c "import sys; a, b = (int(x) for x in sys.argv[1:]); print(f'disk: {b/a:,.0f} bytes written per message (the SQLite log and its checkpoints)')" \
  "$accepted" "$((disk1 - disk0))"

if [ -n "$hook" ]; then
  hook_deadline=$(( $(date +%s) + 600 ))
  while [ "$(curl -sf "http://127.0.0.1:$port/metrics" | awk '$1 ~ /^fairlane_webhook_attempts_total\{/ && /result="delivered"/ {s += $NF} END {printf "%d\n", s}')" -lt "$accepted" ]; do
    [ "$(date +%s)" -lt "$hook_deadline" ] || { echo "webhooks not all delivered after 600 s" >&2; break; }
    sample_rss; sleep 0.2
  done
  t_hooks=$(date +%s.%N)
  cpu_hooks=$(cpu_secs)
  hook_cpu1=$(awk -v hz="$(getconf CLK_TCK)" '{printf "%.3f\n", ($14 + $15) / hz}' /proc/$hook/stat)
  hook_calls=$(counter fairlane_webhook_calls_total)
  echo "webhook calls: ${hook_calls:-?} for $accepted events"
  python3 -c "import sys; a, t0, t1, th, c0, c1, h0, h1 = (float(x) for x in sys.argv[1:]); print(f'webhooks: {int(a)} delivered {th - t1:.1f} s after the last delivery; end to end with them {a/(th - t0):.0f}/s; CPU {1e6*(c1-c0)/a:.0f} µs per message with its webhook; the endpoint {1e6*(h1-h0)/a:.0f} µs per event')" \
    "$accepted" "$t0" "$t1" "$t_hooks" "$cpu0" "$cpu_hooks" "$hook_cpu0" "$hook_cpu1"
  kill "$hook"; wait "$hook" 2>/dev/null || true; hook=
fi
awk '/Latency Distribution|  50%|  99%/' "$work/wrk.txt"
python3 - "$accepted" "$delivered_during" "$t0" "$t_load" "$t1" "$ceiling" "$rss_max" "$cpu0" "$cpu1" <<'PY'
import sys
accepted, during = int(sys.argv[1]), int(sys.argv[2])
t0, t_load, t1, ceiling, rss, cpu0, cpu1 = (float(x) for x in sys.argv[3:10])
load, drain, total = t_load - t0, t1 - t_load, t1 - t0
print(f"accepted {accepted} in {load:.1f} s: {accepted/load:.0f}/s")
print(f"delivered during the load: {during} ({during/load:.0f}/s); the other {accepted-during} in {drain:.1f} s after it"
      + (f" ({(accepted-during)/drain:.0f}/s)" if drain > 0 else ""))
rate = accepted / total
print(f"end to end: {accepted} in {total:.1f} s = {rate:.0f}/s, {100*rate/ceiling:.1f} % of the bare-axum ceiling ({ceiling:.0f}/s)")
print(f"peak RSS: {rss/1024:.1f} MiB")
print(f"fairlane CPU: {cpu1-cpu0:.2f} s, {1e6*(cpu1-cpu0)/accepted:.0f} µs per message accepted and delivered")
PY
