#!/usr/bin/env bash
# The several-instance product end to end on a fast SQS-compatible server,
# beside the embedded default, in one run (issue 26, item 3).
#
#   cargo build --release --bins --examples && bash bench/several.sh [messages] [connections] [configs]
#
# Installs fauxqs 1.9.2 from npm into ~/.cache/fairlane-fauxqs (once) and
# starts it on 127.0.0.1 on a free port (a small launcher, since its own CLI
# binds every interface); stopped by its PID at the end. Then:
#   fauxqs    its own rate alone: examples/sqs_rate (the same SDK client,
#             SendMessageBatch of 10, ReceiveMessage of 10 + one
#             DeleteMessageBatch, 4 senders and 4 receivers, 10 s)
#   and, back to back, each with fresh state (SQLite file, PostgreSQL
#   database created here and dropped, queue prefix, Redis key prefix):
#   sqlite-embedded  one instance, SQLite, embedded queue (the default)
#   sqlite-sqs       one instance, SQLite, SQS lanes on fauxqs
#   pg-1             one instance, PostgreSQL, SQS lanes (limits $PG1_LIMITS, default local)
#   pg-2             two instances on one PostgreSQL database, SQS lanes, Redis limits
#   pgq-1            one instance, PostgreSQL, the lanes in PostgreSQL (limits $PG1_LIMITS)
#   pgq-2            two instances on one PostgreSQL database, the lanes in it, Redis limits
# CONFIGS (third argument, comma-separated) picks some of them.
# Each configuration: consumers on, SMS provider `log` to /dev/null with its
# gate far above any rate reached, four tenants on a plan whose limits are out
# of the way. wrk (--latency, bench/send_tenants.lua, CONNECTIONS shared out
# over the instances, one wrk per instance) sends until MESSAGES (default
# 60,000) are accepted, faster than they are delivered, so a backlog builds;
# then the script waits until every accepted message is delivered.
# Per configuration it prints:
#   accepted/s during the load and accept p99 (wrk; the worst instance's p99)
#   end to end: messages ÷ (first request → last delivery)
#   the backlog when the load stopped (accepted − delivered)
#   CPU per message: user + system time of the fairlane PIDs (/proc/PID/stat)
#     over the run ÷ messages; the same for fauxqs and for the PostgreSQL
#     backends serving the database (pg_stat_activity's PIDs at the end)
#   PostgreSQL round trips per message: pg_stat_statements' calls of the
#     run's database (top-level statements, BEGIN and COMMIT included; not those a trigger runs) ÷ messages,
#     and transactions per message (pg_stat_database xact_commit +
#     xact_rollback ÷ messages). The PostgreSQL is a cluster of the bench's
#     own (initdb into a temporary directory, a free port on 127.0.0.1,
#     pg_stat_statements preloaded, the server's default durability), stopped
#     with pg_ctl at the end; PG_URL=postgres://… uses another server instead
#     (round trips then need pg_stat_statements preloaded there).
#   SQS calls per message: fairlane_sqs_calls_total (all instances) ÷
#     messages, and by operation
# Needs: wrk, node + npm, PostgreSQL's initdb and pg_ctl (runuser when root),
# the Redis of this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
messages=${1:-60000}
connections=${2:-64}
configs=${3:-sqlite-embedded,sqlite-sqs,pg-1,pg-2,pgq-1,pgq-2}
target=${CARGO_TARGET_DIR:-target}/release
bin=${BIN:-$target/fairlane}
[ -x "$bin" ] && [ -x "$target/examples/sqs_rate" ] || { echo "build first: cargo build --release --bins --examples" >&2; exit 1; }
command -v wrk >/dev/null || { echo "wrk is needed: apt-get install wrk" >&2; exit 1; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
hz=$(getconf CLK_TCK)
admin=bench-admin-token-0123456789

# shellcheck source=bench/fauxqs.sh
. bench/fauxqs.sh

work=$(mktemp -d)
pids=()
dbs=()
pg_dir=""
as_pg=()
[ "$(id -u)" = 0 ] && as_pg=(runuser -u postgres --)
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
  if [ -n "$fauxqs_pid" ]; then kill "$fauxqs_pid" 2>/dev/null || true; wait "$fauxqs_pid" 2>/dev/null || true; fi
  for db in "${dbs[@]}"; do psql_admin "DROP DATABASE IF EXISTS $db WITH (FORCE)" || true; done
  if [ -n "$pg_dir" ]; then
    "${as_pg[@]}" pg_ctl stop -D "$pg_dir/data" -m fast -w >/dev/null 2>&1 || true
    rm -rf "$pg_dir"
  fi
  rm -rf "$work"
}
trap cleanup EXIT

# PostgreSQL: the bench's own cluster with pg_stat_statements, or PG_URL.
if [ -n "${PG_URL:-}" ]; then
  pg_base=${PG_URL%/*}
else
  pg_dir=$(mktemp -d /tmp/fairlane-bench-pg.XXXXXX)
  [ ${#as_pg[@]} -gt 0 ] && chown postgres: "$pg_dir"
  pg_port=$(free_port)
  "${as_pg[@]}" initdb -D "$pg_dir/data" -U root --auth=trust -E UTF8 --no-sync >"$pg_dir/initdb.log" 2>&1 \
    || { cat "$pg_dir/initdb.log" >&2; exit 1; }
  "${as_pg[@]}" pg_ctl start -D "$pg_dir/data" -l "$pg_dir/server.log" -w -o \
    "-p $pg_port -k $pg_dir -c listen_addresses=127.0.0.1 -c max_connections=200 -c shared_preload_libraries=pg_stat_statements -c pg_stat_statements.track=top" \
    >/dev/null || { cat "$pg_dir/server.log" >&2; exit 1; }
  pg_base=postgres://root@127.0.0.1:$pg_port
fi
psql_admin() { psql "$pg_base/postgres" -qAtc "$1"; }

# fauxqs on 127.0.0.1 only.
start_fauxqs "$work"

echo "fairlane $(git rev-parse --short HEAD 2>/dev/null || echo '?'), fauxqs $(fauxqs_version) on node $(node --version), $(psql_admin 'show server_version'), wrk -c$connections, $messages messages per configuration; load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "== fauxqs alone"
"$target/examples/sqs_rate" "$sqs" 10 4 4 | tee "$work/fauxqs-rate.txt"

# start NAME STORE_URL QUEUE LIMITS PREFIX: starts an instance, sets $port.
# Runs in this shell (never in $(...)), so its PID is kept for the cleanup.
start() {
  local name=$1 store=$2 queue=$3 limits=$4 prefix=$5
  port=$(free_port)
  FAIRLANE__SERVER__LISTEN=127.0.0.1:$port \
  FAIRLANE__SERVER__ADMIN_TOKEN=$admin \
  FAIRLANE__SERVER__INSTANCE=$name \
  FAIRLANE__STORAGE__URL=$store \
  FAIRLANE__QUEUE__BACKEND=$queue \
  FAIRLANE__QUEUE__SQS__ENDPOINT_URL=$sqs \
  FAIRLANE__QUEUE__SQS__QUEUE_PREFIX=$prefix \
  FAIRLANE__QUEUE__SQS__ACCESS_KEY_ID=test \
  FAIRLANE__QUEUE__SQS__SECRET_ACCESS_KEY=test \
  FAIRLANE__LIMITS__BACKEND=$limits \
  FAIRLANE__LIMITS__REDIS_URL=redis://127.0.0.1:6379 \
  FAIRLANE__LIMITS__KEY_PREFIX=$prefix \
  FAIRLANE__LANES__FAST__HIGH_WATER_MARK=1000000000 \
  FAIRLANE__CONSUMERS__RECEIVE_WAIT_SECS=1 \
  FAIRLANE__PROVIDERS__SMS__LOG_PATH=/dev/null \
  FAIRLANE__PROVIDERS__SMS__RATE_PER_SECOND=1000000 \
  FAIRLANE__PROVIDERS__SMS__BURST=100000 \
  RUST_LOG=warn "$bin" serve >"$work/$prefix-$name.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 150); do curl -sf "http://127.0.0.1:$port/readyz" >/dev/null 2>&1 && break; sleep 0.1; done
  curl -sf "http://127.0.0.1:$port/readyz" >/dev/null || { echo "instance $name did not start:" >&2; cat "$work/$prefix-$name.log" >&2; exit 1; }
}

# tenants PORT: four tenants on a plan out of the way; prints their keys.
tenants() {
  local base=http://127.0.0.1:$1 keys=()
  api() { curl -sf -H "Authorization: Bearer $admin" -H 'Content-Type: application/json' "$@"; }
  api -X PUT "$base/v1/admin/plans/bench" \
    -d '{"lane":"fast","rate_per_second":1000000,"burst":1000000,"daily_quota":1000000000,"max_in_flight":100000}' >/dev/null
  for t in t1 t2 t3 t4; do
    api -X POST "$base/v1/admin/tenants" -d "{\"id\":\"$t\",\"name\":\"$t\",\"plan\":\"bench\"}" >/dev/null
    keys+=("$(api -X POST "$base/v1/admin/tenants/$t/keys" | python3 -c 'import json,sys; print(json.load(sys.stdin)["key"])')")
  done
  (IFS=,; echo "${keys[*]}")
}

# counter NAME PORT...: the sum of a metric over the instances.
counter() {
  local name=$1; shift
  for p in "$@"; do curl -sf "http://127.0.0.1:$p/metrics"; done \
    | awk -v name="$name" '$1 ~ "^"name"(\\{|$)" {s += $NF} END {printf "%d\n", s}'
}
# sqs_by_op PORT...: fairlane_sqs_calls_total by operation, summed.
sqs_by_op() {
  for p in "$@"; do curl -sf "http://127.0.0.1:$p/metrics"; done \
    | awk '$1 ~ /^fairlane_sqs_calls_total\{/ { match($1, /operation="[^"]*"/); op = substr($1, RSTART + 11, RLENGTH - 12); s[op] += $NF }
           END { for (op in s) printf "%s=%d ", op, s[op]; print "" }'
}
# cpu_ticks PID...: user + system clock ticks used so far.
cpu_ticks() {
  local t=0
  for p in "$@"; do t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0))); done
  echo "$t"
}
pg_backends() { psql_admin "select pid from pg_stat_activity where datname = '$1'" | tr '\n' ' '; }
# pg_ticks PID...: "pid ticks" lines, to subtract per backend (the pools
# open connections during the run; a new one counts from zero).
pg_ticks() { for p in "$@"; do echo "$p $(cpu_ticks "$p")"; done; }
pg_xacts() { psql_admin "select xact_commit + xact_rollback from pg_stat_database where datname = '$1'"; }
# pg_calls DB: statements run in DB since the last pg_stat_statements_reset()
# (empty when pg_stat_statements is not loaded).
pg_calls() {
  psql "$pg_base/$1" -qAtc "select coalesce(sum(calls), 0) from pg_stat_statements s join pg_database d on d.oid = s.dbid where d.datname = '$1'" 2>/dev/null || true
}

# run LABEL DB PORT...: the load and the drain; prints the figures.
run() {
  local label=$1 db=$2; shift 2
  local ports=("$@") keys wrk_pids=() per=$((connections / $#))
  keys=$(tenants "${ports[0]}")
  sleep 1
  local x0=0 x1=0 pgpids="" pgc0=0 pgc1=0
  local calls=""
  if [ -n "$db" ]; then
    pgpids=$(pg_backends "$db")
    x0=$(pg_xacts "$db")
    psql "$pg_base/$db" -qAtc "create extension if not exists pg_stat_statements; select pg_stat_statements_reset()" >/dev/null 2>&1 || true
  fi
  local a0 d0 s0 c0 f0 t0 t_load t1 a1 d_load d1 s1 c1 f1
  a0=$(counter fairlane_messages_accepted_total "${ports[@]}")
  d0=$(counter fairlane_messages_delivered_total "${ports[@]}")
  s0=$(counter fairlane_sqs_calls_total "${ports[@]}")
  sqs_by_op "${ports[@]}" >"$work/ops0"
  c0=$(cpu_ticks "${pids[@]}")
  f0=$(cpu_ticks "$fauxqs_pid")
  [ -n "$pgpids" ] && pg_ticks $pgpids >"$work/pg0"
  t0=$(date +%s.%N)
  for p in "${ports[@]}"; do
    KEYS=$keys wrk -t$(( 2 / ${#ports[@]} > 0 ? 2 / ${#ports[@]} : 1 )) -c"$per" -d600s --latency -s bench/send_tenants.lua \
      "http://127.0.0.1:$p/v1/messages" >"$work/wrk-$label-$p.txt" 2>&1 &
    wrk_pids+=($!)
  done
  while [ "$(counter fairlane_messages_accepted_total "${ports[@]}")" -lt $((a0 + messages)) ]; do sleep 0.1; done
  for w in "${wrk_pids[@]}"; do kill -INT "$w"; done
  for w in "${wrk_pids[@]}"; do wait "$w" || true; done
  t_load=$(date +%s.%N)
  a1=$(counter fairlane_messages_accepted_total "${ports[@]}")
  d_load=$(counter fairlane_messages_delivered_total "${ports[@]}")
  local deadline=$(( $(date +%s) + 600 ))
  while [ "$(counter fairlane_messages_delivered_total "${ports[@]}")" -lt $((d0 + a1 - a0)) ]; do
    [ "$(date +%s)" -lt "$deadline" ] || { echo "  not all delivered after 600 s" >&2; break; }
    sleep 0.1
  done
  t1=$(date +%s.%N)
  d1=$(counter fairlane_messages_delivered_total "${ports[@]}")
  c1=$(cpu_ticks "${pids[@]}")
  f1=$(cpu_ticks "$fauxqs_pid")
  s1=$(counter fairlane_sqs_calls_total "${ports[@]}")
  sqs_by_op "${ports[@]}" >"$work/ops1"
  if [ -n "$db" ]; then
    pg_ticks $(pg_backends "$db") >"$work/pg1"
    pgc1=$(awk 'NR == FNR {t0[$1] = $2; next} {s += $2 - t0[$1]} END {print s + 0}' "$work/pg0" "$work/pg1")
    # A backend flushes its statistics at most once a second, and an idle
    # one only after 10 s; one that ends flushes them at once.
    stop_all
    sleep 1
    x1=$(pg_xacts "$db")
    calls=$(pg_calls "$db")
    # Where the round trips go: the statements run most, per message.
    psql "$pg_base/$db" -qAtF '|' -c "select calls, round(total_exec_time::numeric * 1000), shared_blks_hit + shared_blks_read, left(regexp_replace(query, '\s+', ' ', 'g'), 100) from pg_stat_statements s join pg_database d on d.oid = s.dbid where d.datname = '$db' order by calls desc limit 10" 2>/dev/null \
      | awk -F'|' -v n=$((messages)) '{printf "    %6.3f/msg %6.1f µs/msg %7.1f blocks/call  %s\n", $1 / n, $2 / n, $3 / $1, $4}' >"$work/top-$label" || true
  fi
  local p99s
  p99s=$(for p in "${ports[@]}"; do awk '$1 == "99%" {print $2}' "$work/wrk-$label-$p.txt"; done | tr '\n' ' ')
  [ -s "$work/top-$label" ] && { echo "  statements run most (calls and execution time per message accepted, buffers touched per call):"; cat "$work/top-$label"; }
  python3 - "$label" "$((a1 - a0))" "$((d1 - d0))" "$((d_load - d0))" "$t0" "$t_load" "$t1" \
    "$((c1 - c0))" "$((f1 - f0))" "$((pgc1 - pgc0))" "$hz" "$((x1 - x0))" "$((s1 - s0))" "$db" "$p99s" \
    "$(cat "$work/ops0")" "$(cat "$work/ops1")" "$calls" <<'PY' | tee -a "$work/results"
import sys
(label, acc, dlv, dlv_load, t0, tl, t1, cpu, fcpu, pgcpu, hz, xacts, sqs, db, p99s, ops0, ops1, calls) = sys.argv[1:]
acc, dlv, dlv_load, cpu, fcpu, pgcpu, hz, xacts, sqs = (int(x) for x in (acc, dlv, dlv_load, cpu, fcpu, pgcpu, hz, xacts, sqs))
t0, tl, t1 = float(t0), float(tl), float(t1)
def ms(v):
    v = v.strip()
    for unit, f in (("us", 1e-3), ("ms", 1.0), ("s", 1e3)):
        if v.endswith(unit):
            return float(v[: -len(unit)]) * f
    return float("nan")
p99 = max(ms(v) for v in p99s.split()) if p99s.split() else float("nan")
parse = lambda s: {k: int(v) for k, v in (kv.split("=") for kv in s.split())}
o0, o1 = parse(ops0), parse(ops1)
by_op = ", ".join(f"{k} {(o1[k] - o0.get(k, 0)) / max(dlv, 1):.3f}" for k in sorted(o1) if o1[k] - o0.get(k, 0))
n = max(dlv, 1)
print(f"  accepted {acc} in {tl - t0:.1f} s: {acc / (tl - t0):.0f}/s, accept p99 {p99:.2f} ms (per wrk: {p99s.strip()})")
print(f"  delivered {dlv}: {dlv_load} during the load ({dlv_load / (tl - t0):.0f}/s), backlog {acc - dlv_load} at its end, drained in {t1 - tl:.1f} s")
print(f"  end to end: {dlv} in {t1 - t0:.1f} s = {dlv / (t1 - t0):.0f}/s")
print(f"  CPU per message: fairlane {1e6 * cpu / hz / n:.0f} µs, fauxqs {1e6 * fcpu / hz / n:.0f} µs"
      + (f", PostgreSQL backends {1e6 * pgcpu / hz / n:.0f} µs" if db else ""))
trips = f"{int(calls) / n:.3f}" if calls.strip() else "?"
if db:
    print(f"  PostgreSQL round trips per message: {trips} ({calls.strip() or 'pg_stat_statements not loaded'}), transactions per message: {xacts / n:.3f} ({xacts})")
print(f"  SQS calls per message: {sqs / n:.3f} ({sqs}){': ' + by_op if by_op else ''}")
print(f"RESULT|{label}|{acc / (tl - t0):.0f}|{p99:.2f}|{dlv / (t1 - t0):.0f}|{1e6 * cpu / hz / n:.0f}|"
      + (f"{trips}|{xacts / n:.3f}" if db else "–|–") + f"|{sqs / n:.3f}|{1e6 * fcpu / hz / n:.0f}|"
      + (f"{1e6 * pgcpu / hz / n:.0f}" if db else "–"))
PY
}

stop_all() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
  pids=()
}

for config in ${configs//,/ }; do
  echo "== $config (load $(cut -d' ' -f1-3 /proc/loadavg))"
  prefix="b${config//[^a-z0-9]/}$RANDOM"
  case $config in
    sqlite-embedded)
      start a "sqlite://$work/$prefix.db" embedded local "$prefix"
      run "$config" "" "$port" ;;
    sqlite-sqs)
      start a "sqlite://$work/$prefix.db" sqs local "$prefix"
      run "$config" "" "$port" ;;
    pg-1 | pg-2 | pgq-1 | pgq-2)
      n=${config#*-}
      queue=sqs
      [ "${config%-*}" = pgq ] && queue=postgres
      db="fl_bench_$prefix"
      psql_admin "CREATE DATABASE $db"
      dbs+=("$db")
      limits=redis
      [ "$n" = 1 ] && limits=${PG1_LIMITS:-local}
      ports=()
      for i in $(seq "$n"); do
        start "i$i" "$pg_base/$db" "$queue" "$limits" "$prefix"
        ports+=("$port")
      done
      run "$config" "$db" "${ports[@]}" ;;
    *) echo "unknown configuration $config" >&2; exit 1 ;;
  esac
  stop_all
done
echo "== summary: configuration | accepted/s | accept p99 ms | end to end /s | fairlane CPU µs/msg | PG round trips/msg | PG xacts/msg | SQS calls/msg | fauxqs CPU µs/msg | PG backend CPU µs/msg"
grep -h "^RESULT" "$work/results" | cut -d'|' -f2- || true
