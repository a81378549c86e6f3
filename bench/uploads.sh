#!/usr/bin/env bash
# Attachments: the memory and CPU of many large uploads at once, then of
# delivering the emails that carry them (issue 48).
#
#   cargo build --release --bin fairlane && bash bench/uploads.sh [uploads] [megabytes]
#
# 1. fairlane serve on a fresh SQLite file, embedded default, consumers on,
#    email through SES's API to a stand-in SES on 127.0.0.1 (a Python HTTP
#    server that reads each call whole and answers a MessageId), so every
#    email is built into raw MIME and sent as it is in production.
#    The tenant's plan allows the run's uploads in one minute
#    (`uploads_per_minute`) and exactly their bytes held
#    (`upload_bytes_held`), so the limits are checked on every upload.
# 2. UPLOADS (default 100) curl processes upload a PDF of MEGABYTES
#    (default 10) each to /v1/attachments at once; meanwhile the script
#    samples fairlane's RSS every 20 ms.
# 3. One email per upload names its file; the script waits until all are
#    sent, sampling RSS the same way.
# 4. The same files again, one more email each (a file serves any number
#    of sends until it expires, issue 68.4), waited for the same way.
# 5. One upload more: the world holds its plan's bytes, so it is refused
#    (429 upload-bytes-held) before its body is read; its time is printed.
# Prints fairlane's idle RSS (after start-up and the tenant's set-up), then,
# for each phase: its wall time, fairlane's peak RSS (sampled) over its RSS
# before the phase, and fairlane's CPU time per file (utime + stime from
# /proc/PID/stat before and after: a figure other work on the machine does
# not move); and at the end the process's VmHWM from /proc/PID/status (the
# kernel's own high-water mark of RSS, which no sampling can miss).
set -euo pipefail
cd "$(dirname "$0")/.."
uploads=${1:-100}
megabytes=${2:-10}
target=${CARGO_TARGET_DIR:-target}/release
bin=${BIN:-$target/fairlane}
[ -x "$bin" ] || { echo "build first: cargo build --release --bin fairlane" >&2; exit 1; }

work=$(mktemp -d)
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
port=$(free_port)
ses_port=$(free_port)
admin=bench-admin-token-0123456789
pid=
ses=
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; [ -n "$ses" ] && kill "$ses" 2>/dev/null; wait 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT

# The stand-in SES: reads the call's body whole, answers as SES v2 does.
cat >"$work/ses.py" <<'PY'
import http.server, sys
class SES(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = b'{"MessageId":"bench"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), SES).serve_forever()
PY
python3 "$work/ses.py" "$ses_port" & ses=$!

FAIRLANE__SERVER__LISTEN=127.0.0.1:$port \
FAIRLANE__SERVER__ADMIN_TOKEN=$admin \
FAIRLANE__STORAGE__URL=sqlite://$work/fairlane.db \
FAIRLANE__PROVIDERS__EMAIL__KIND=ses \
FAIRLANE__PROVIDERS__EMAIL__ENDPOINT_URL=http://127.0.0.1:$ses_port \
FAIRLANE__PROVIDERS__EMAIL__REGION=us-east-1 \
FAIRLANE__PROVIDERS__EMAIL__ACCESS_KEY_ID=bench \
FAIRLANE__PROVIDERS__EMAIL__SECRET_ACCESS_KEY=bench \
FAIRLANE__PROVIDERS__EMAIL__FROM=bench@example.com \
FAIRLANE__PROVIDERS__EMAIL__RATE_PER_SECOND=1000 \
FAIRLANE__PROVIDERS__EMAIL__BURST=100 \
RUST_LOG=warn "$bin" serve >>"$work/log" 2>&1 &
pid=$!
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/healthz" >/dev/null && break; sleep 0.1; done
curl -sf "http://127.0.0.1:$port/healthz" >/dev/null || { echo "fairlane did not start:" >&2; cat "$work/log" >&2; exit 1; }
api() { curl -sf -H "Authorization: Bearer $admin" -H 'Content-Type: application/json' "$@"; }
held=$(( uploads * megabytes * 1024 * 1024 ))
per_minute=$(( uploads < 60 ? 60 : uploads + 1 ))
api -X PUT "http://127.0.0.1:$port/v1/admin/plans/bench" \
  -d '{"lane":"fast","rate_per_second":100000,"burst":100000,"daily_quota":1000000000,"max_in_flight":64,"uploads_per_minute":'"$per_minute"',"upload_bytes_held":'"$held"'}' >/dev/null
api -X POST "http://127.0.0.1:$port/v1/admin/tenants" -d '{"id":"bench","name":"Bench","plan":"bench"}' >/dev/null
key=$(api -X POST "http://127.0.0.1:$port/v1/admin/tenants/bench/keys" | python3 -c 'import json,sys; print(json.load(sys.stdin)["key"])')
python3 - "$work/file.pdf" "$megabytes" <<'PY'
import os, sys
size = int(sys.argv[2]) * 1024 * 1024
with open(sys.argv[1], "wb") as f:
    f.write(b"%PDF-1.4\n" + os.urandom(size - 15) + b"\n%%EOF")
PY

cpu_secs() { awk -v hz="$(getconf CLK_TCK)" '{printf "%.3f\n", ($14 + $15) / hz}' /proc/$pid/stat; }
rss() { awk '/VmRSS/ {print $2}' /proc/$pid/status; }
# watch PID...: samples fairlane's RSS every 20 ms while any PID runs;
# prints the peak (KiB).
watch_rss() {
  local peak=0 r
  while kill -0 "$@" 2>/dev/null; do
    r=$(rss); [ "$r" -gt "$peak" ] && peak=$r
    sleep 0.02
  done
  echo "$peak"
}

hwm() { awk '/VmHWM/ {print $2}' /proc/$pid/status; }
echo "idle: RSS $(( $(rss) / 1024 )) MiB"

echo "== $uploads uploads of $megabytes MiB at once"
before=$(rss); cpu0=$(cpu_secs); t0=$(date +%s.%N)
pids=()
for n in $(seq "$uploads"); do
  curl -s -o "$work/up.$n" -w '%{http_code}\n' -X POST "http://127.0.0.1:$port/v1/attachments?filename=file-$n.pdf" \
    -H "Authorization: Bearer $key" -H 'Content-Type: application/pdf' --data-binary @"$work/file.pdf" >"$work/code.$n" &
  pids+=($!)
done
peak=$(watch_rss "${pids[@]}")
wait "${pids[@]}" || true
t1=$(date +%s.%N); cpu1=$(cpu_secs)
stored=$(cat "$work"/code.* | grep -c '^201$' || true)
[ "$stored" = "$uploads" ] || { echo "only $stored of $uploads uploads were stored:"; cat "$work"/up.1; exit 1; }
python3 - "$before" "$peak" "$t0" "$t1" "$cpu0" "$cpu1" "$uploads" "$megabytes" <<'PY'
import sys
before, peak, t0, t1, c0, c1, n, mb = map(float, sys.argv[1:])
print(f"uploads: {n:.0f} stored in {t1 - t0:.1f} s ({n * mb / (t1 - t0):.0f} MiB/s); "
      f"RSS {before / 1024:.0f} MiB before, peak {peak / 1024:.0f} MiB (+{(peak - before) / 1024:.0f} MiB "
      f"for {n * mb:.0f} MiB in flight); CPU {1000 * (c1 - c0) / n:.1f} ms per upload")
PY

deliver() { # label: one email per upload, waited for until all so far are settled
  local label=$1 want=$2
  echo "== $label"
before=$(rss); cpu0=$(cpu_secs); t0=$(date +%s.%N)
for n in $(seq "$uploads"); do
  id=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["id"])' "$work/up.$n")
  curl -sf -o /dev/null -X POST "http://127.0.0.1:$port/v1/messages" -H "Authorization: Bearer $key" -H 'Content-Type: application/json' \
    -d "{\"channel\":\"email\",\"to\":\"r$n@example.com\",\"subject\":\"File $n\",\"text\":\"Attached.\",\"attachments\":[\"$id\"]}"
done
( while [ "$(settled)" -lt "$want" ]; do sleep 0.05; done ) & waiter=$!
peak=$(watch_rss "$waiter")
wait "$waiter"
t1=$(date +%s.%N); cpu1=$(cpu_secs)
dead=$(counter fairlane_messages_dead_lettered_total)
[ "$dead" = 0 ] || { echo "$dead emails were dead-lettered:"; tail -5 "$work/log"; exit 1; }
python3 - "$before" "$peak" "$t0" "$t1" "$cpu0" "$cpu1" "$uploads" "$label" <<'PY'
import sys
before, peak, t0, t1, c0, c1, n = map(float, sys.argv[1:8])
print(f"{sys.argv[8]}: {n:.0f} emails accepted and sent in {t1 - t0:.1f} s; "
      f"RSS {before / 1024:.0f} MiB before, peak {peak / 1024:.0f} MiB (+{(peak - before) / 1024:.0f} MiB); "
      f"CPU {1000 * (c1 - c0) / n:.1f} ms per email")
PY
}
counter() { curl -sf "http://127.0.0.1:$port/metrics" | awk -v name="$1" '$1 ~ "^"name"(\\{|$)" {s += $NF} END {printf "%d\n", s}'; }
settled() { echo $(( $(counter fairlane_messages_delivered_total) + $(counter fairlane_messages_dead_lettered_total) )); }
deliver "delivery" "$uploads"
deliver "reuse (the same files, one more email each)" $((2 * uploads))
t0=$(date +%s.%N)
code=$(curl -s -o "$work/over" -w '%{http_code}' -X POST "http://127.0.0.1:$port/v1/attachments?filename=over.pdf" \
  -H "Authorization: Bearer $key" -H 'Content-Type: application/pdf' --data-binary @"$work/file.pdf")
t1=$(date +%s.%N)
grep -q upload-bytes-held "$work/over" || { echo "one upload past upload_bytes_held was $code:"; cat "$work/over"; exit 1; }
python3 -c 'import sys; print(f"past upload_bytes_held: {sys.argv[1]} in {1000 * (float(sys.argv[3]) - float(sys.argv[2])):.0f} ms")' "$code" "$t0" "$t1"
echo "VmHWM (peak RSS of the whole run): $(( $(hwm) / 1024 )) MiB"
