#!/usr/bin/env bash
# The least a webhook call costs on this machine, client and endpoint (issue
# 27): examples/call_floor makes COUNT calls shaped like fairlane's webhook
# calls, CONCURRENCY at once, to the pipeline bench's endpoint
# (examples/bare_axum: parse the JSON body, answer 202), with the
# dispatcher's own client (CLIENT=fairlane, the default) or a reqwest client
# built as the dispatcher's was before (CLIENT=reqwest). Prints the client's
# CPU per call and the endpoint's, measured from /proc, with nothing else
# of fairlane running (no store, no pipeline).
#
#   cargo build --release --examples && CLIENT=fairlane bash bench/call_floor.sh [count] [concurrency]
set -euo pipefail
cd "$(dirname "$0")/.."
count=${1:-50000}
concurrency=${2:-64}
target=${CARGO_TARGET_DIR:-target}/release
[ -x "$target/examples/call_floor" ] && [ -x "$target/examples/bare_axum" ] || { echo "build first: cargo build --release --examples" >&2; exit 1; }
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$target/examples/bare_axum" "127.0.0.1:$port" & endpoint=$!
trap 'kill "$endpoint" 2>/dev/null; wait 2>/dev/null' EXIT
sleep 0.5
cpu() { awk -v hz="$(getconf CLK_TCK)" '{printf "%.3f\n", ($14 + $15) / hz}' "/proc/$1/stat"; }
before=$(cpu "$endpoint")
"$target/examples/call_floor" "http://127.0.0.1:$port/v1/messages" "$count" "$concurrency" "${CLIENT:-fairlane}"
after=$(cpu "$endpoint")
python3 -c "import sys; b, a, n = (float(x) for x in sys.argv[1:]); print(f'endpoint CPU {1e6*(a-b)/n:.1f} µs per call')" "$before" "$after" "$count"
