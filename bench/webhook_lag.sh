#!/usr/bin/env bash
# Two tenants' webhooks, one endpoint slow and then failing (issue 27).
#
#   cargo build --release --bin fairlane --examples && bash bench/webhook_lag.sh [rate] [seconds]
#
# fairlane serve on a fresh SQLite file (the embedded default), consumers
# on, the email provider `log` writing to /dev/null, webhooks to
# 127.0.0.1 allowed over http. examples/webhook_lag then makes two tenants
# with a webhook on `message.sent` each, sends RATE emails a second for each
# (default 500) for SECONDS (default 60) and serves both endpoints: the
# healthy tenant's answers 204 at once, the troubled tenant's after 100 ms
# for 15 s, then 500 for 30 s, then at once. It prints the healthy
# tenant's webhook lag (event time → arrival) per 5-second window. At the
# end the script prints what fairlane's own gauges and admin views say.
# Everything runs on this machine's two cores.
set -euo pipefail
cd "$(dirname "$0")/.."
rate=${1:-500}
seconds=${2:-60}
target=${CARGO_TARGET_DIR:-target}/release
for b in fairlane examples/webhook_lag; do
  [ -x "$target/$b" ] || { echo "build first: cargo build --release --bin fairlane --examples" >&2; exit 1; }
done
work=$(mktemp -d)
pid=
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
admin=bench-admin-token-0123456789
FAIRLANE__SERVER__LISTEN=127.0.0.1:$port \
FAIRLANE__SERVER__ADMIN_TOKEN=$admin \
FAIRLANE__STORAGE__URL=sqlite://$work/fairlane.db \
FAIRLANE__LANES__FAST__HIGH_WATER_MARK=1000000000 \
FAIRLANE__PROVIDERS__EMAIL__KIND=log \
FAIRLANE__PROVIDERS__EMAIL__LOG_PATH=/dev/null \
FAIRLANE__PROVIDERS__EMAIL__RATE_PER_SECOND=1000000 \
FAIRLANE__PROVIDERS__EMAIL__BURST=100000 \
FAIRLANE__WEBHOOKS__ALLOW_HTTP=true \
FAIRLANE__WEBHOOKS__ALLOW_PRIVATE='["127.0.0.1/32"]' \
RUST_LOG=warn "$target/fairlane" serve >>"$work/log" 2>&1 &
pid=$!
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/healthz" >/dev/null && break; sleep 0.1; done
curl -sf "http://127.0.0.1:$port/healthz" >/dev/null || { echo "fairlane did not start:" >&2; cat "$work/log" >&2; exit 1; }
"$target/examples/webhook_lag" "http://127.0.0.1:$port" "$admin" "$rate" "$seconds"
echo "fairlane's view at the end:"
curl -sf "http://127.0.0.1:$port/metrics" | grep -E '^fairlane_webhook_(calls_due|oldest_due_age_seconds|attempts_total)' || true
for tenant in healthy troubled; do
  curl -sf -H "Authorization: Bearer $admin" "http://127.0.0.1:$port/v1/admin/tenants/$tenant/webhook" \
    | python3 -c 'import json,sys; v=json.load(sys.stdin); print(v["tenant_id"], {k: v[k] for k in ("state","pending","due","oldest_pending_at","failed","last_error")})'
done
