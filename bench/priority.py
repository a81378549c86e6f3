#!/usr/bin/env python3
"""Priority and fairness benchmarks against a release build (issue 8).

    cargo build --release --bin fairlane --examples
    python3 bench/priority.py [scenario ...]     # blast, slow_gate, quiet, utilisation

SQS_ENDPOINT=http://... puts the lanes on that SQS-compatible server (fresh
queues per run; receive_wait_secs 1) instead of the embedded queue.

Each scenario starts examples/mock_sms (logging every request's arrival time
and text) and a fresh `fairlane serve` on the embedded default with the SMS
gate set as the scenario says, creates tenants on a plan whose own limits stay
out of the way (max_in_flight 8, like the built-in `pro` plan), sends through
the HTTP API, and reads the order and times at which the provider saw the
messages. Latency is provider arrival minus the moment the 202 came back, on
one clock. Standard library only.
"""

import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
BIN = os.environ.get("BIN", os.path.join(TARGET, "release", "fairlane"))
MOCK = os.path.join(TARGET, "release", "examples", "mock_sms")
ADMIN = "bench-admin-token-0123456789"


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Rig:
    """A mock provider and a fairlane, torn down on exit."""

    def __init__(self, rate, burst=1, latency_ms=5, concurrency=32):
        self.work = tempfile.mkdtemp(prefix="fairlane-prio-")
        self.log_path = os.path.join(self.work, "sms.log")
        mock_port, self.port = free_port(), free_port()
        env = dict(os.environ, MOCK_SMS_LOG=self.log_path)
        self.mock = subprocess.Popen([MOCK, str(mock_port), str(latency_ms)], env=env)
        env = dict(
            os.environ,
            FAIRLANE__SERVER__LISTEN=f"127.0.0.1:{self.port}",
            FAIRLANE__SERVER__ADMIN_TOKEN=ADMIN,
            FAIRLANE__STORAGE__URL=f"sqlite://{self.work}/fairlane.db",
            FAIRLANE__LANES__FAST__CONCURRENCY=str(concurrency),
            FAIRLANE__LANES__FAST__HIGH_WATER_MARK="1000000000",
            FAIRLANE__PROVIDERS__SMS__KIND="http",
            FAIRLANE__PROVIDERS__SMS__BASE_URL=f"http://127.0.0.1:{mock_port}",
            FAIRLANE__PROVIDERS__SMS__ACCOUNT_SID="ACbench",
            FAIRLANE__PROVIDERS__SMS__AUTH_TOKEN="bench",
            FAIRLANE__PROVIDERS__SMS__FROM="+15550001111",
            FAIRLANE__PROVIDERS__SMS__RATE_PER_SECOND=str(rate),
            FAIRLANE__PROVIDERS__SMS__BURST=str(burst),
            RUST_LOG="warn",
        )
        if os.environ.get("SQS_ENDPOINT"):
            # Lanes on an SQS-compatible server, fresh queues per rig.
            env.update(
                FAIRLANE__QUEUE__BACKEND="sqs",
                FAIRLANE__QUEUE__SQS__ENDPOINT_URL=os.environ["SQS_ENDPOINT"],
                FAIRLANE__QUEUE__SQS__QUEUE_PREFIX=f"prio-{os.getpid()}-{mock_port}",
                FAIRLANE__QUEUE__SQS__ACCESS_KEY_ID="test",
                FAIRLANE__QUEUE__SQS__SECRET_ACCESS_KEY="test",
                FAIRLANE__CONSUMERS__RECEIVE_WAIT_SECS="1",
            )
        self.log_file = open(os.path.join(self.work, "fairlane.log"), "w")
        self.proc = subprocess.Popen([BIN, "serve"], env=env, stdout=self.log_file, stderr=subprocess.STDOUT)
        for _ in range(200):
            try:
                if self.request("GET", "/healthz")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.05)
        else:
            raise SystemExit("fairlane did not start")
        self.admin("PUT", "/v1/admin/plans/open", {"lane": "fast", "rate_per_second": 1e6, "burst": 1000000,
                                                   "daily_quota": 1000000000, "max_in_flight": 8})

    def request(self, method, path, body=None, token=ADMIN, conn=None):
        own = conn is None
        conn = conn or http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        headers = {"Authorization": f"Bearer {token}"}
        data = None
        if body is not None:
            data = json.dumps(body)
            headers["Content-Type"] = "application/json"
        conn.request(method, path, data, headers)
        response = conn.getresponse()
        payload = response.read()
        if own:
            conn.close()
        return response.status, payload

    def admin(self, method, path, body=None):
        status, payload = self.request(method, path, body)
        assert status < 300, (status, payload)
        return json.loads(payload) if payload else None

    def tenant(self, name):
        self.admin("POST", "/v1/admin/tenants", {"id": name, "name": name, "plan": "open"})
        return self.admin("POST", f"/v1/admin/tenants/{name}/keys")["key"]

    def send(self, conn, key, text, priority):
        body = {"channel": "sms", "to": "+15551234567", "text": text, "priority": priority}
        status, payload = self.request("POST", "/v1/messages", body, token=key, conn=conn)
        assert status == 202, (status, payload)
        return time.time()

    def arrivals(self):
        """(arrival time, text) of every SMS the provider saw, in order."""
        try:
            with open(self.log_path) as f:
                return [(float(t), text) for t, text in (line.rstrip("\n").split("\t", 1) for line in f)]
        except FileNotFoundError:
            return []

    def wait_for(self, predicate, timeout=120):
        deadline = time.time() + timeout
        while time.time() < deadline:
            seen = self.arrivals()
            if predicate(seen):
                return seen
            time.sleep(0.05)
        raise SystemExit("timed out waiting for the provider")

    def close(self):
        self.proc.terminate()
        self.mock.terminate()
        self.proc.wait()
        self.mock.wait()
        self.log_file.close()


def connection(rig):
    return http.client.HTTPConnection("127.0.0.1", rig.port, timeout=30)


def blast():
    """3,000 low + 10 high from one tenant at a 100/s gate: every high <= 1 s."""
    rig = Rig(rate=100)
    try:
        key = rig.tenant("acme")
        conn = connection(rig)
        for n in range(3000):
            rig.send(conn, key, f"low {n}", "low")
        rig.wait_for(lambda seen: len(seen) >= 50)
        accepted = {}
        for n in range(10):
            accepted[f"high {n}"] = rig.send(conn, key, f"high {n}", "high")
            time.sleep(0.01)
        seen = rig.wait_for(lambda seen: sum(1 for _, t in seen if t.startswith("high")) == 10)
        at = {text: t for t, text in seen}
        lat = [at[h] - accepted[h] for h in accepted]
        lows_before = sum(1 for _, t in seen if t.startswith("low"))
        print(f"blast: 10 highs behind {3000} lows at 100/s: latency max {max(lat)*1000:.0f} ms, "
              f"mean {statistics.mean(lat)*1000:.0f} ms (target <= 1000 ms); {lows_before} lows had been sent by then")
    finally:
        rig.close()


def slow_gate():
    """100 low queued at a 10/s gate, then 10 high: last high <= 1.5 s, <= 2 lows between first and last high."""
    rig = Rig(rate=10)
    try:
        key = rig.tenant("acme")
        conn = connection(rig)
        for n in range(100):
            rig.send(conn, key, f"low {n}", "low")
        rig.wait_for(lambda seen: len(seen) >= 3)
        accepted = {}
        for n in range(10):
            accepted[f"high {n}"] = rig.send(conn, key, f"high {n}", "high")
        first_accept = min(accepted.values())
        seen = rig.wait_for(lambda seen: sum(1 for _, t in seen if t.startswith("high")) == 10)
        order = [text for _, text in seen]
        at = {text: t for t, text in seen}
        first = min(order.index(h) for h in accepted)
        last = max(order.index(h) for h in accepted)
        lows_between = sum(1 for t in order[first:last] if t.startswith("low"))
        last_high = max(at[h] for h in accepted) - first_accept
        print(f"slow_gate: last high {last_high*1000:.0f} ms after the first 202 (target <= 1500 ms); "
              f"{lows_between} lows between the first and the last high (target <= 2)")
    finally:
        rig.close()


def quiet_latencies(with_noise):
    rig = Rig(rate=100, latency_ms=int(os.environ.get("MOCK_LATENCY_MS", "5")))
    try:
        quiet = rig.tenant("quiet")
        if with_noise:
            noisy = rig.tenant("noisy")
            conn = connection(rig)
            for n in range(2000):
                rig.send(conn, noisy, f"noisy {n}", "normal")
            rig.wait_for(lambda seen: len(seen) >= 50)
        conn = connection(rig)
        accepted = {}
        for n in range(20):
            accepted[f"quiet {n}"] = rig.send(conn, quiet, f"quiet {n}", "normal")
            time.sleep(0.05)
        seen = rig.wait_for(lambda seen: sum(1 for _, t in seen if t.startswith("quiet")) == 20)
        at = {text: t for t, text in seen}
        if os.environ.get("QUIET_SHOW"):
            print("  in sending order (ms):", " ".join(f"{(at[q] - accepted[q]) * 1000:.0f}" for q in accepted))
        return sorted(at[q] - accepted[q] for q in accepted)
    finally:
        rig.close()


def quiet():
    """Quiet tenant (20 SMS, 50 ms apart) beside a noisy 2,000 backlog, gate 100/s: p99 <= solo p99 + 20 ms.

    QUIET_RUNS=5 repeats the pair of runs; MOCK_LATENCY_MS sets the provider's latency (5 ms);
    QUIET_SHOW=1 prints each quiet message's latency in sending order."""

    def p99(xs):
        return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]

    for _ in range(int(os.environ.get("QUIET_RUNS", "1"))):
        solo = quiet_latencies(False)
        noisy = quiet_latencies(True)
        print(f"quiet: solo p50 {statistics.median(solo)*1000:.1f} ms p99 {p99(solo)*1000:.1f} ms; "
              f"beside the noisy backlog p50 {statistics.median(noisy)*1000:.1f} ms p99 {p99(noisy)*1000:.1f} ms; "
              f"difference {(p99(noisy)-p99(solo))*1000:.1f} ms (target <= 20 ms)", flush=True)


def utilisation():
    """Backlog at a 100/s gate, burst 10: share of the rate used and the worst window excess."""
    rate, burst = 100.0, 10
    rig = Rig(rate=rate, burst=burst)
    try:
        keys = [rig.tenant(f"t{i}") for i in range(4)]
        conns = [connection(rig) for _ in keys]
        for n in range(400):
            for i, key in enumerate(keys):
                rig.send(conns[i], key, f"t{i} {n}", ["high", "normal", "low"][n % 3])
        seen = rig.wait_for(lambda seen: len(seen) >= 1600, timeout=60)
        times = [t for t, _ in seen]
        # Steady state: after the first burst, until the backlog ran out.
        steady = times[burst:]
        used = (len(steady) - 1) / (steady[-1] - steady[0]) / rate
        worst = 0.0
        # Largest excess over burst + rate * window over every pair of arrivals.
        for i in range(len(times)):
            for k in range(i, min(len(times), i + 400)):
                worst = max(worst, (k - i + 1) - (burst + rate * (times[k] - times[i])))
        per_tenant = [sum(1 for _, text in seen[:800] if text.startswith(f"t{i} ")) for i in range(4)]
        jain = sum(per_tenant) ** 2 / (len(per_tenant) * sum(x * x for x in per_tenant))
        print(f"utilisation: {used*100:.2f} % of {rate:.0f}/s under backlog (target >= 99 %); "
              f"worst window excess over burst + rate x t at the provider: {worst:.2f} calls "
              f"(includes loopback jitter); first 800 calls per tenant {per_tenant}, Jain's index {jain:.3f}")
    finally:
        rig.close()


SCENARIOS = {"blast": blast, "slow_gate": slow_gate, "quiet": quiet, "utilisation": utilisation}

if __name__ == "__main__":
    for exe in (BIN, MOCK):
        if not os.access(exe, os.X_OK):
            raise SystemExit(f"{exe} missing: cargo build --release --bin fairlane --examples")
    for name in sys.argv[1:] or list(SCENARIOS):
        SCENARIOS[name]()
