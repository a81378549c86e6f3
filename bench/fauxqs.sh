# Sourced by the benchmarks that need a fast SQS-compatible server (needs
# node + npm, and `free_port` defined by the caller).
#
# fauxqs 1.9.2 (MIT, npm) is installed into ~/.cache/fairlane-fauxqs once
# (FAUXQS_DIR to change). `start_fauxqs WORKDIR` starts it on 127.0.0.1 on a
# free port, through a small launcher around its `buildApp` since its own CLI
# binds every interface, and sets `fauxqs_pid` (for the caller to stop) and
# `sqs` (its endpoint URL).
fauxqs_dir=${FAUXQS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/fairlane-fauxqs}
fauxqs_pid=""
start_fauxqs() {
  local work=$1 port
  if [ ! -f "$fauxqs_dir/node_modules/fauxqs/dist/app.js" ]; then
    npm install --silent --prefix "$fauxqs_dir" fauxqs@1.9.2 >/dev/null 2>&1
  fi
  port=$(free_port)
  cat >"$work/fauxqs.mjs" <<JS
import { buildApp } from "$fauxqs_dir/node_modules/fauxqs/dist/app.js";
const app = buildApp({ logger: false });
await app.listen({ port: $port, host: "127.0.0.1" });
JS
  node "$work/fauxqs.mjs" >"$work/fauxqs.log" 2>&1 &
  fauxqs_pid=$!
  sqs="http://127.0.0.1:$port"
  for _ in $(seq 100); do curl -s -o /dev/null "$sqs/" && break; sleep 0.1; done
}
fauxqs_version() { node -p "require('$fauxqs_dir/node_modules/fauxqs/package.json').version"; }
