#!/usr/bin/env bash
# Delivery throughput and memory against a mock SMS provider of fixed latency.
#
#   cargo build --release --examples --bins && bash bench/delivery.sh [messages] [latency_ms] [concurrency] [slow_every]
#
# 1. Starts the mock provider (examples/mock_sms.rs) with the given latency.
# 2. Starts fairlane with consumers off and fills the fast lane with
#    `messages` SMS through the API (wrk, 64 connections).
# 3. Restarts fairlane on the same file with consumers on (lane concurrency
#    as given, gate far above it) and times the drain from the first to the
#    last delivery, sampling /v1/admin/queues every 0.5 s. Expected ceiling:
#    concurrency / latency (Little's law).
# 4. Prints RSS while draining the backlog.
# DRAIN_SECS=N stops after N seconds of draining (for memory checks on a
# large backlog); the rate is then computed over what was delivered so far.
set -euo pipefail
cd "$(dirname "$0")/.."
messages=${1:-20000}
latency=${2:-50}
concurrency=${3:-32}
slow_every=${4:-0}   # e.g. 100: every 100th provider call takes 2 s
target=${CARGO_TARGET_DIR:-target}/release
[ -x "$target/fairlane" ] && [ -x "$target/examples/mock_sms" ] || { echo "build first: cargo build --release --examples --bins" >&2; exit 1; }
command -v wrk >/dev/null || { echo "wrk is needed: apt-get install wrk" >&2; exit 1; }

work=$(mktemp -d)
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
mock_port=$(free_port)
port=$(free_port)
admin=bench-admin-token-0123456789
"$target/examples/mock_sms" "$mock_port" "$latency" "$slow_every" 2000 & mock=$!
pid=
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; kill "$mock" 2>/dev/null; wait 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT

start() {
  FAIRLANE__SERVER__LISTEN=127.0.0.1:$port \
  FAIRLANE__SERVER__ADMIN_TOKEN=$admin \
  FAIRLANE__STORAGE__URL=sqlite://$work/fairlane.db \
  FAIRLANE__CONSUMERS__ENABLED=$1 \
  FAIRLANE__LANES__FAST__CONCURRENCY=$concurrency \
  FAIRLANE__LANES__FAST__HIGH_WATER_MARK=1000000000 \
  FAIRLANE__PROVIDERS__SMS__KIND=http \
  FAIRLANE__PROVIDERS__SMS__BASE_URL=http://127.0.0.1:$mock_port \
  FAIRLANE__PROVIDERS__SMS__ACCOUNT_SID=ACbench \
  FAIRLANE__PROVIDERS__SMS__AUTH_TOKEN=bench \
  FAIRLANE__PROVIDERS__SMS__FROM=+15550001111 \
  FAIRLANE__PROVIDERS__SMS__RATE_PER_SECOND=100000 \
  FAIRLANE__PROVIDERS__SMS__BURST=1000 \
  RUST_LOG=warn "$target/fairlane" serve >>"$work/log" 2>&1 &
  pid=$!
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/healthz" >/dev/null && return; sleep 0.1; done
  echo "fairlane did not start" >&2; cat "$work/log" >&2; exit 1
}
api() { curl -sf -H "Authorization: Bearer $admin" -H 'Content-Type: application/json' "$@"; }
depth() { api "http://127.0.0.1:$port/v1/admin/queues" | python3 -c 'import json,sys; l=json.load(sys.stdin)["lanes"][0]; print(l["depth"]+l["in_flight"])'; }

start false
api -X PUT "http://127.0.0.1:$port/v1/admin/plans/bench" \
  -d '{"lane":"fast","rate_per_second":1000000,"burst":1000000,"daily_quota":1000000000,"max_in_flight":100000}' >/dev/null
api -X POST "http://127.0.0.1:$port/v1/admin/tenants" -d '{"id":"bench","name":"Bench","plan":"bench"}' >/dev/null
KEY=$(api -X POST "http://127.0.0.1:$port/v1/admin/tenants/bench/keys" | python3 -c 'import json,sys; print(json.load(sys.stdin)["key"])')
export KEY
while [ "$(depth)" -lt "$messages" ]; do
  wrk -t2 -c64 -d1s -s bench/send.lua "http://127.0.0.1:$port/v1/messages" >/dev/null
done
filled=$(depth)
kill "$pid"; wait "$pid" 2>/dev/null || true
echo "filled the fast lane with $filled messages"

start true
t0=$(date +%s.%N)
rss_max=0
while :; do
  left=$(depth)
  rss=$(awk '/VmRSS/ {print $2}' /proc/$pid/status)
  [ "$rss" -gt "$rss_max" ] && rss_max=$rss
  [ "$left" -eq 0 ] && break
  if [ -n "${DRAIN_SECS:-}" ] && [ "$(python3 -c "import time; print(int(time.time() - $t0 >= $DRAIN_SECS))")" = 1 ]; then
    echo "stopped after ${DRAIN_SECS} s with $left still queued"
    break
  fi
  sleep 0.5
done
t1=$(date +%s.%N)
filled=$((filled - left))
# Mean provider call latency as fairlane saw it (HTTP round trip included).
measured_ms=$(curl -sf "http://127.0.0.1:$port/metrics" | python3 -c '
import sys
s = c = 0.0
for line in sys.stdin:
    if line.startswith("fairlane_provider_call_seconds_sum") and "outcome=\"sent\"" in line:
        s += float(line.split()[-1])
    if line.startswith("fairlane_provider_call_seconds_count") and "outcome=\"sent\"" in line:
        c += float(line.split()[-1])
print(f"{1000 * s / c:.2f}" if c else "0")')
python3 - "$filled" "$t0" "$t1" "$concurrency" "$latency" "$rss_max" "$slow_every" "$measured_ms" <<'PY'
import sys
n, t0, t1, c, l, rss, every = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
measured = float(sys.argv[8])
rate = n / (t1 - t0)
mean_ms = l if every == 0 else ((every - 1) * l + 2000) / every
ceiling = c / (mean_ms / 1000)
print(f"delivered {n} in {t1-t0:.1f} s: {rate:.0f}/s; Little's-law ceiling {c} / {mean_ms:.1f} ms mean latency = {ceiling:.0f}/s; {100*rate/ceiling:.1f} %")
if measured > 0:
    real_ceiling = c / (measured / 1000)
    print(f"measured mean provider call {measured:.2f} ms (round trip): ceiling {real_ceiling:.0f}/s; {100*rate/real_ceiling:.1f} %")
print(f"max RSS while draining: {rss/1024:.1f} MiB")
PY
