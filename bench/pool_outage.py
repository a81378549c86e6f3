#!/usr/bin/env python3
"""A 30-second outage of one of two equal SMS providers, end to end (issue 46, item 9).

    cargo build --release --bin fairlane && python3 bench/pool_outage.py [--binary PATH]
        [--rate 20] [--outage-from 20] [--outage-secs 30] [--total-secs 120] [--bin-secs 2]

Two Twilio-compatible providers run in this script (`alpha`, the
`providers.sms` table, and `beta`, `providers.sms_pool.beta`; weight 1
each, the first provider's default rate and burst, the default breaker and
health settings). fairlane
(release build, embedded default, consumers on) gets RATE SMS a second from
one tenant for TOTAL seconds; alpha answers every call with a 503 from
OUTAGE_FROM for OUTAGE_SECS seconds. Each call is recorded with its arrival
time; a call answered 201 took its message.

Prints, per bin of BIN_SECS seconds, the messages each provider took and
alpha's share, then:
- whether every message was taken exactly once (none lost, none twice);
- alpha's largest share in any bin from the end of the outage on (the
  book's "Provider pools": never more than its weight, here 0.5);
- when alpha took its first message after the outage, and its share in
  the first bins after that (the book: from a tenth, back to its weight
  over `recover_secs`, 20 s).
Exits 1 when a message was lost or taken twice.
"""

import argparse
import http.client
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

ADMIN = "bench-admin-token-0123456789"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Provider:
    """One provider: records (seconds since start, text, took) per call."""

    def __init__(self, name, start, failing):
        self.name, self.start, self.failing = name, start, failing
        self.calls = []
        self.lock = threading.Lock()
        provider = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                form = urllib.parse.parse_qs(self.rfile.read(length).decode())
                text = form.get("Body", [""])[0]
                at = time.monotonic() - provider.start
                took = not provider.failing(at)
                with provider.lock:
                    provider.calls.append((at, text, took))
                if took:
                    body = json.dumps({"sid": f"SM{provider.name}{len(provider.calls)}"}).encode()
                    self.send_response(201)
                else:
                    body = b'{"message": "Service Unavailable"}'
                    self.send_response(503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.port = free_port()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def provider_toml(port):
    return (f'kind = "http"\nbase_url = "http://127.0.0.1:{port}"\naccount_sid = "AC123"\n'
            f'auth_token = "secret-token"\nfrom = "+15550001111"\n'
            # The first provider's defaults (config/default.toml), for both.
            f"rate_per_second = 26.67\nburst = 10\n")


def request(port, method, path, token, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    conn.request(method, path, json.dumps(body) if body is not None else None, headers)
    answer = conn.getresponse()
    return answer.status, answer.read()


def main():
    parser = argparse.ArgumentParser()
    target = os.environ.get("CARGO_TARGET_DIR", "target")
    parser.add_argument("--binary", default=f"{target}/release/fairlane")
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--outage-from", type=float, default=20.0)
    parser.add_argument("--outage-secs", type=float, default=30.0)
    parser.add_argument("--total-secs", type=float, default=120.0)
    parser.add_argument("--bin-secs", type=float, default=2.0)
    args = parser.parse_args()
    if not os.access(args.binary, os.X_OK):
        sys.exit(f"build first: cargo build --release --bin fairlane ({args.binary} is missing)")

    start = time.monotonic()
    outage_end = args.outage_from + args.outage_secs
    alpha = Provider("alpha", start, lambda at: args.outage_from <= at < outage_end)
    beta = Provider("beta", start, lambda at: False)

    work = tempfile.mkdtemp()
    config = os.path.join(work, "fairlane.toml")
    with open(config, "w") as f:
        f.write("[consumers]\nenabled = true\n\n"
                f'[providers.sms]\nname = "alpha"\n{provider_toml(alpha.port)}\n'
                f"[providers.sms_pool.beta]\n{provider_toml(beta.port)}\n")
    port = free_port()
    env = dict(os.environ, FAIRLANE__SERVER__LISTEN=f"127.0.0.1:{port}",
               FAIRLANE__SERVER__ADMIN_TOKEN=ADMIN,
               FAIRLANE__STORAGE__URL=f"sqlite://{work}/fairlane.db", RUST_LOG="warn")
    log = open(os.path.join(work, "log"), "w")
    fairlane = subprocess.Popen([args.binary, "serve", "--config", config], env=env,
                                stdout=log, stderr=log)
    try:
        for _ in range(300):
            if fairlane.poll() is not None:
                break
            try:
                if request(port, "GET", "/readyz", ADMIN)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.1)
        else:
            sys.exit("fairlane did not start: " + open(os.path.join(work, "log")).read())
        status, _ = request(port, "POST", "/v1/admin/tenants", ADMIN,
                            {"id": "acme", "name": "Acme", "plan": "pro"})
        assert status == 201, status
        status, body = request(port, "POST", "/v1/admin/tenants/acme/keys", ADMIN)
        key = json.loads(body)["key"]

        # The clock starts again with the load, so the outage's times hold.
        start = time.monotonic()
        alpha.start = beta.start = start
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        total = int(args.rate * args.total_secs)
        for n in range(total):
            due = start + n / args.rate
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            body = {"channel": "sms", "to": "+15551234567", "text": f"pool {n}"}
            conn.request("POST", "/v1/messages", json.dumps(body), headers)
            answer = conn.getresponse()
            answer.read()
            if answer.status != 202:
                sys.exit(f"send {n}: {answer.status}")
        # Until every message is taken, or 60 s more.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with alpha.lock, beta.lock:
                taken = sum(took for p in (alpha, beta) for _, _, took in p.calls)
            if taken >= total:
                break
            time.sleep(0.5)
        time.sleep(1)
    finally:
        fairlane.send_signal(signal.SIGTERM)
        fairlane.wait(timeout=30)

    per_text = {}
    for p in (alpha, beta):
        for _, text, took in p.calls:
            if took:
                per_text[text] = per_text.get(text, 0) + 1
    lost = total - len(per_text)
    twice = sum(1 for count in per_text.values() if count > 1)

    bins = int(args.total_secs / args.bin_secs) + 30
    rows = []
    for b in range(bins):
        low, high = b * args.bin_secs, (b + 1) * args.bin_secs
        a = sum(1 for at, _, took in alpha.calls if took and low <= at < high)
        a_failed = sum(1 for at, _, took in alpha.calls if not took and low <= at < high)
        bb = sum(1 for at, _, took in beta.calls if took and low <= at < high)
        if a + bb + a_failed:
            rows.append((low, a, a_failed, bb))
    print(f"{'from s':>6} {'alpha took':>10} {'alpha 503':>9} {'beta took':>9} {'alpha share':>11}")
    for low, a, a_failed, bb in rows:
        share = a / (a + bb) if a + bb else 0.0
        print(f"{low:6.0f} {a:10d} {a_failed:9d} {bb:9d} {share:11.2f}")

    after = [(low, a, bb) for low, a, _, bb in rows if low >= outage_end and a + bb >= 10]
    back = next((low for low, a, _ in after if a > 0), None)
    worst = max((a / (a + bb) for _, a, bb in after), default=0.0)
    print(f"messages {total}: lost {lost}, taken twice {twice}")
    print(f"alpha's largest share in a bin of 10 or more messages from the outage's end: {worst:.2f}")
    if back is None:
        print("alpha took nothing after the outage")
    else:
        ramp = [f"{a / (a + bb):.2f}" for low, a, bb in after if low >= back][:12]
        print(f"alpha back at {back:.0f} s ({back - outage_end:.0f} s after the outage); "
              f"its share from then, bin by bin: {' '.join(ramp)}")
    sys.exit(1 if lost or twice else 0)


if __name__ == "__main__":
    main()
