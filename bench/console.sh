#!/usr/bin/env bash
# The console's overview beside 50 tenants and a million messages (issue 47).
#
#   cargo build --release --bin fairlane && bash bench/console.sh [messages] [tenants]
#
# 1. fairlane starts on a fresh SQLite store (the embedded default) with
#    its consumers off, so the fill is quick and every message stays
#    queued. TENANTS tenants (default 50) on a plan whose limits are out
#    of the way, a key each.
# 2. bench/fill_list.py sends MESSAGES (default 1,000,000) through the
#    batch API, MESSAGES/TENANTS per tenant, so each tenant has usage rows.
# 3. fairlane is stopped and started again on the same store with its
#    consumers on (the default log providers, at their configured rates):
#    the product as it runs, draining a backlog of a million messages
#    while the overview is read. Messages it accepted in this run (none)
#    would draw the last hour's chart; the bench sends 1,000 more first.
#    With SCHEDULED=1 it also schedules one for tomorrow: the case where the
#    overview reads the lane's rows for each tenant's delayed count.
# 4. curl signs in to the console with the admin token (a session cookie);
#    wrk (one connection, 10 s, --latency) reads GET /console with it. It
#    prints the page's size, latency p50 / p99, requests a second, and
#    fairlane's CPU per page (/proc/PID/stat over the wrk run, the
#    consumers' work included: an upper bound of the page's own).
# Everything runs on this machine's cores.
set -euo pipefail
cd "$(dirname "$0")/.."
rows=${1:-1000000}
tenants=${2:-50}
target=${CARGO_TARGET_DIR:-target}/release
bin=${BIN:-$target/fairlane}
[ -x "$bin" ] || { echo "build first: cargo build --release --bin fairlane" >&2; exit 1; }
command -v wrk >/dev/null || { echo "wrk is needed: apt-get install wrk" >&2; exit 1; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
work=$(mktemp -d)
pid=
cleanup() {
  [ -n "$pid" ] && { kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; }
  rm -rf "$work"
}
trap cleanup EXIT
admin=bench-admin-token-0123456789
port=$(free_port)
start() { # $1: consumers on (true) or off (false)
  FAIRLANE__SERVER__LISTEN=127.0.0.1:$port \
  FAIRLANE__SERVER__ADMIN_TOKEN=$admin \
  FAIRLANE__STORAGE__URL=sqlite://$work/fairlane.db \
  FAIRLANE__CONSUMERS__ENABLED=$1 \
  FAIRLANE__LANES__FAST__HIGH_WATER_MARK=1000000000 \
  RUST_LOG=warn "$bin" serve >>"$work/log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/readyz" >/dev/null && break; sleep 0.1; done
  curl -sf "http://127.0.0.1:$port/readyz" >/dev/null || { echo "fairlane did not start:" >&2; cat "$work/log" >&2; exit 1; }
}
start false
api() { curl -sf -H "Authorization: Bearer $admin" -H 'Content-Type: application/json' "$@"; }
api -X PUT "http://127.0.0.1:$port/v1/admin/plans/bench" \
  -d '{"lane":"fast","rate_per_second":1000000,"burst":1000000,"daily_quota":1000000000,"max_in_flight":100}' >/dev/null

started=$(date +%s)
for n in $(seq "$tenants"); do
  api -X POST "http://127.0.0.1:$port/v1/admin/tenants" -d "{\"id\":\"t$n\",\"name\":\"t$n\",\"plan\":\"bench\"}" >/dev/null
  key=$(api -X POST "http://127.0.0.1:$port/v1/admin/tenants/t$n/keys" | python3 -c 'import json,sys; print(json.load(sys.stdin)["key"])')
  python3 bench/fill_list.py "http://127.0.0.1:$port" "$key" $((rows / tenants)) >/dev/null
done
echo "filled: $rows messages of $tenants tenants in $(( $(date +%s) - started )) s"
kill "$pid"; wait "$pid" || true
start true
python3 bench/fill_list.py "http://127.0.0.1:$port" "$key" 1000 >/dev/null
if [ -n "${SCHEDULED:-}" ]; then
  # One message scheduled for tomorrow: a lane with a delayed message, whose
  # tenants' delayed counts the overview finds among the lane's rows.
  curl -sf -H "Authorization: Bearer $key" -H 'Content-Type: application/json' "http://127.0.0.1:$port/v1/messages" \
    -d "{\"channel\":\"sms\",\"to\":\"+15550100\",\"text\":\"later\",\"send_at\":\"$(date -u -d tomorrow +%Y-%m-%dT%H:%M:%SZ)\"}" >/dev/null
  echo "one message scheduled for tomorrow"
fi

cookie=$(curl -s -o /dev/null -D - -X POST --data-urlencode "token=$admin" "http://127.0.0.1:$port/console/login" \
  | awk -F'[:;]' 'tolower($1)=="set-cookie"{gsub(/^ /,"",$2); print $2}')
[ -n "$cookie" ] || { echo "could not sign in to the console" >&2; exit 1; }
size=$(curl -sf -H "Cookie: $cookie" "http://127.0.0.1:$port/console" | wc -c)
ticks() { awk '{print $14 + $15}' "/proc/$pid/stat"; }
hz=$(getconf CLK_TCK)
before=$(ticks)
out=$(wrk -t1 -c1 -d10s --latency -H "Cookie: $cookie" "http://127.0.0.1:$port/console")
after=$(ticks)
requests=$(awk '/requests in/{print $1}' <<<"$out")
p50=$(awk '$1=="50%"{print $2}' <<<"$out"); p99=$(awk '$1=="99%"{print $2}' <<<"$out")
rps=$(awk '/Requests\/sec/{print $2}' <<<"$out")
cpu=$(python3 -c "print(f'{($after - $before) / $hz / $requests * 1000:.2f}')")
echo "GET /console: $size bytes, p50 $p50, p99 $p99, $rps pages/s, fairlane CPU $cpu ms per page"
backlog=$(curl -sf -H "Authorization: Bearer $admin" "http://127.0.0.1:$port/v1/admin/queues" | python3 -c 'import json,sys; print(sum(q.get("depth",0) for q in json.load(sys.stdin).get("lanes",[])))' 2>/dev/null || echo "?")
echo "backlog still queued at the end: $backlog"
