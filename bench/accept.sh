#!/usr/bin/env bash
# Accept-path load test against a release build on the embedded default.
#
#   cargo build --release && bash bench/accept.sh [duration] [connections]
#
# Starts fairlane on a free port with a fresh SQLite file, creates a tenant on
# a plan whose limits are out of the way, and drives POST /v1/messages with
# wrk (2 threads). Prints wrk's figures, then checks the database: every 2xx
# wrk counted must be a queued row. FSYNC=true measures storage.fsync = true.
set -euo pipefail
cd "$(dirname "$0")/.."
duration=${1:-20s}
connections=${2:-64}
bin=${BIN:-${CARGO_TARGET_DIR:-target}/release/fairlane}
[ -x "$bin" ] || { echo "build first: cargo build --release" >&2; exit 1; }
command -v wrk >/dev/null || { echo "wrk is needed: apt-get install wrk" >&2; exit 1; }

work=$(mktemp -d)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
admin=bench-admin-token-0123456789
FAIRLANE__SERVER__LISTEN=127.0.0.1:$port \
FAIRLANE__SERVER__ADMIN_TOKEN=$admin \
FAIRLANE__STORAGE__URL=sqlite://$work/fairlane.db \
FAIRLANE__STORAGE__FSYNC=${FSYNC:-false} \
FAIRLANE__LANES__FAST__HIGH_WATER_MARK=1000000000 \
FAIRLANE__CONSUMERS__ENABLED=false \
RUST_LOG=warn "$bin" serve >"$work/log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true; rm -rf "$work"' EXIT
for _ in $(seq 50); do curl -sf "http://127.0.0.1:$port/healthz" >/dev/null && break; sleep 0.1; done

api() { curl -sf -H "Authorization: Bearer $admin" -H 'Content-Type: application/json' "$@"; }
api -X PUT "http://127.0.0.1:$port/v1/admin/plans/bench" \
  -d '{"lane":"fast","rate_per_second":1000000,"burst":1000000,"daily_quota":1000000000,"max_in_flight":64}' >/dev/null
api -X POST "http://127.0.0.1:$port/v1/admin/tenants" -d '{"id":"bench","name":"Bench","plan":"bench"}' >/dev/null
KEY=$(api -X POST "http://127.0.0.1:$port/v1/admin/tenants/bench/keys" | python3 -c 'import json,sys; print(json.load(sys.stdin)["key"])')
export KEY

echo "fairlane $(git rev-parse --short HEAD 2>/dev/null || echo '?') fsync=${FSYNC:-false} wrk -t2 -c$connections -d$duration"
wrk -t2 -c"$connections" -d"$duration" --latency -s bench/send.lua "http://127.0.0.1:$port/v1/messages"

sleep 1
queued=$(python3 -c "import sqlite3,sys; c=sqlite3.connect('$work/fairlane.db'); print(c.execute(\"select count(*) from queue_messages where queue='fast'\").fetchone()[0])")
echo "queued rows in the fast lane: $queued"
echo "peak RSS of fairlane (kB): $(grep VmHWM /proc/$pid/status | awk '{print $2}')"
