#!/usr/bin/env python3
"""Soak test (issue 14, part 4): mixed traffic through restarts and provider faults.

    python3 bench/soak.py [--minutes 10] [--binary PATH] [--rate 24] [--seed 14] [--keep]

The binary defaults to $CARGO_TARGET_DIR/debug/fairlane (then .../release/,
then target/debug/ and target/release/ in the repository). It is copied to a
temporary directory first and the copy is run, so a rebuild meanwhile changes
nothing. The script never runs cargo. Standard library only (Python 3.11).

Method
------
* A mock provider runs in its own Python process (ThreadingHTTPServer on
  127.0.0.1, free port) and serves both providers fairlane is configured
  with: the Twilio-compatible SMS API (`POST /2010-04-01/Accounts/{sid}/
  Messages.json`, form `To`/`From`/`Body`, success 201 {"sid"}) and SES v2
  (`POST /v2/email/outbound-emails`, JSON, success 200 {"MessageId"}; the AWS
  SDK signs with test keys, the mock ignores signatures). Every call is logged
  (arrival, answer, status, fault, the unique token "soak-<tenant>-<n>" found
  in the text). Faults, random but seeded: 3 % 429 with Retry-After: 1, 3 %
  500/503, 1 % timeouts (the mock sleeps 4 s, past fairlane's 3 s
  timeout_ms, then answers 504), 5 % slow calls (0.3-1 s, then success), and
  every 40-80 s a burst of 503 on one provider for 2.5 s (it opens fairlane's
  circuit breaker; expected).
* fairlane runs on a fresh SQLite file in a temporary directory, consumers
  on, configured through FAIRLANE__SECTION__KEY variables: email `ses` and
  SMS `http` pointed at the mock, each gate 30/s burst 10, timeout 3000 ms;
  retry.max_attempts 8, base_delay_ms 200, max_delay_secs 5; visibility
  timeout 10 s on both lanes; RUST_LOG=warn, logs in the temporary directory.
* Five tenants: four on a fast-lane plan and one on a slow-lane plan, both
  with limits out of the way. One sender thread per tenant, about --rate
  sends/s in all (default 24), half email and half SMS, priorities high 20 %,
  normal 50 %, low 30 %. 90 % of sends carry an Idempotency-Key; 2 % of the
  actions are invalid requests (422, 400, 415, 401, a reused key with another
  body), 2 % replay an earlier accepted request with its key and body.
  A send refused at connect (fairlane down), answered 429/503/409, or whose
  connection broke after the request went out, is sent again with the same
  key until it gets a definite answer; a keyless send whose connection broke
  mid-request is "ambiguous" (never retried: it may have been accepted).
  Only a 202 counts as accepted; every accepted id is kept with its token.
* At 30 %, 55 % and 80 % of the duration: kill -9, SIGTERM (graceful: it must
  exit 0), kill -9, each at a moment when the mock is answering a call
  (waiting up to 5 s for one); each time fairlane is started again at once on
  the same file and port while the senders go on. (On the embedded queue a
  receive's lease lives in memory and a start resets `sending` to `queued`,
  so messages a killed process held come back at once, not after the
  visibility timeout.)
* RSS (VmRSS) and open fds (/proc/PID/fd) are sampled every 5 s (kept in
  samples.csv in the temporary directory with --keep).
* After the traffic: wait (at most 3 min) until every accepted id has a
  terminal status (GET /v1/messages/{id} with its tenant's key), stop
  fairlane with SIGTERM, stop the mock, and read its log.

Checks (a summary table, then PASS or FAIL; exit status 1 on FAIL)
----------------------------------------------------------------
* lost: accepted ids without a terminal status (sent, delivered, bounced,
  complained, failed, suppressed, dead_lettered, cancelled, rejected) = 0.
* fairlane never answers a 5xx other than 503; every invalid request gets a
  4xx application/problem+json answer; every replay answers 202 with the
  first id and Idempotent-Replayed: true; every accepted id is distinct.
* Successful provider arrivals = `sent` messages + duplicates (+ arrivals
  of ambiguous keyless sends): the tokens the mock answered with success
  are exactly the `sent` ones, and each `sent` message's provider id is one
  the mock gave for its token.
* Duplicates (a token answered with success more than once) are at most the
  bound: the sum over the two kill -9 of the calls in flight at the kill
  plus the successes answered in the 1 s before it (answered, perhaps not yet
  recorded); each duplicate lies in a crash window: its first success was
  under way at a kill -9 or answered at most 10 s (the visibility timeout)
  before it, and the second call came after that kill. The graceful restart
  has no crash window.
* Rate: per provider, the most calls (failed ones included) in any sliding
  1 s window <= rate + burst (40). Also printed, not judged: the worst
  excess over the gate's promise burst + rate x t for windows t <= 1 s (a
  few tenths of a call is timing noise at the mock).
* Printed for information: latency from 202 to `sent_at` per priority, the
  delay from the provider's answer to `sent_at`, attempts per message,
  fairlane's WARN (counted by message) and ERROR lines.
* Unexpected exits of fairlane: 0; the graceful stop exits 0.
* Flat: for the last process life, RSS at the end <= 1.25 x RSS after
  warm-up (its first sample >= 60 s after start, else its first sample) and
  open fds at the end <= fds after warm-up + 20.
"""

import argparse
import collections
import concurrent.futures
import datetime
import http.client
import http.server
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADMIN = "soak-admin-token-0123456789"

# fairlane settings the checks depend on.
RATE, BURST = 30.0, 10
PROVIDER_TIMEOUT_MS = 3000
VISIBILITY_SECS = 10
MAX_ATTEMPTS = 8
# Mock faults.
P_429, P_5XX, P_TIMEOUT, P_SLOW = 0.03, 0.03, 0.01, 0.05
TIMEOUT_SLEEP = 4.0
SLOW_RANGE = (0.3, 1.0)
BURST_EVERY = (40.0, 80.0)
BURST_SECS = 2.5
# Checks.
RSS_GROWTH, FD_GROWTH = 1.25, 20
WARM_UP_SECS = 60
SAMPLE_SECS = 5
DRAIN_SECS = 180
TERMINAL = {"sent", "delivered", "bounced", "complained", "failed", "suppressed",
            "dead_lettered", "cancelled", "rejected"}
SENT_LIKE = {"sent", "delivered", "bounced", "complained", "failed"}
TOKEN_RE = re.compile(r"soak-[a-z0-9]+-\d+")
SMS_PATH = re.compile(r"^/2010-04-01/Accounts/[^/]+/Messages\.json$")
SES_PATH = "/v2/email/outbound-emails"


# --------------------------------------------------------------------------
# The mock provider (its own process: `soak.py --mock-provider LOG SEED DIR`).
# --------------------------------------------------------------------------

class MockState:
    def __init__(self, log_path, seed, work_dir):
        self.lock = threading.Lock()
        self.rng = random.Random(seed)
        self.log = open(log_path, "a", buffering=1)
        self.work_dir = work_dir
        self.seq = 0
        self.in_flight = collections.Counter()
        self.arrivals = 0
        self.burst_until = {"sms": 0.0, "email": 0.0}
        self.bursts_on = True
        self.first_logged = set()

    def write(self, record):
        self.log.write(json.dumps(record) + "\n")

    def arrive(self, channel, token, at):
        with self.lock:
            self.seq += 1
            seq = self.seq
            self.arrivals += 1
            self.in_flight[channel] += 1
            if at < self.burst_until[channel]:
                fault = "burst"
            else:
                r = self.rng.random()
                if r < P_429:
                    fault = "429"
                elif r < P_429 + P_5XX:
                    fault = "5xx"
                elif r < P_429 + P_5XX + P_TIMEOUT:
                    fault = "timeout"
                elif r < P_429 + P_5XX + P_TIMEOUT + P_SLOW:
                    fault = "slow"
                else:
                    fault = "ok"
            extra = self.rng.uniform(*SLOW_RANGE) if fault == "slow" else self.rng.choice([500, 503])
            self.write(["a", seq, at, channel, token])
            return seq, fault, extra

    def done(self, seq, channel, status, fault, provider_id, written):
        with self.lock:
            self.in_flight[channel] -= 1
            self.write(["d", seq, time.time(), status, fault, provider_id, written])

    def first_request(self, channel, path, headers, body):
        with self.lock:
            if channel in self.first_logged:
                return
            self.first_logged.add(channel)
        with open(os.path.join(self.work_dir, f"first-{channel}-request.txt"), "wb") as f:
            f.write(f"POST {path}\n{headers}\n".encode() + body)

    def burster(self):
        channels = ["sms", "email"]
        n = 0
        while True:
            with self.lock:
                wait = self.rng.uniform(*BURST_EVERY)
            time.sleep(wait)
            with self.lock:
                if not self.bursts_on:
                    continue
                channel = channels[n % 2]
                n += 1
                now = time.time()
                self.burst_until[channel] = now + BURST_SECS
                self.write(["b", now, channel, BURST_SECS])


def make_handler(state):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def parse_request(self):
            # Arrival: the request line has just been read.
            self.arrived_at = time.time()
            return super().parse_request()

        def read_body(self):
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                data = b""
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if size == 0:
                        self.rfile.readline()
                        return data
                    data += self.rfile.read(size)
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def answer(self, status, body, headers=()):
            payload = json.dumps(body).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                for name, value in headers:
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(payload)
                self.wfile.flush()
                return True
            except OSError:
                self.close_connection = True
                return False

        def do_GET(self):
            if self.path == "/_stats":
                with state.lock:
                    body = {"in_flight": dict(state.in_flight), "arrivals": state.arrivals}
                self.answer(200, body)
            else:
                self.answer(404, {"message": "not found"})

        def do_POST(self):
            at = self.arrived_at
            path = urllib.parse.urlsplit(self.path).path
            body = self.read_body()
            if path == "/_control":
                with state.lock:
                    state.bursts_on = bool(json.loads(body).get("bursts", True))
                self.answer(200, {})
                return
            if SMS_PATH.match(path):
                channel = "sms"
                text = urllib.parse.parse_qs(body.decode()).get("Body", [""])[0]
            elif path == SES_PATH:
                channel = "email"
                try:
                    text = json.loads(body)["Content"]["Simple"]["Body"]["Text"]["Data"]
                except (ValueError, KeyError, TypeError):
                    text = body.decode(errors="replace")
            else:
                self.answer(404, {"message": f"no route {path}"})
                return
            state.first_request(channel, self.path, str(self.headers), body)
            found = TOKEN_RE.search(text)
            token = found.group(0) if found else None
            seq, fault, extra = state.arrive(channel, token, at)
            provider_id = None
            if fault in ("ok", "slow"):
                if fault == "slow":
                    time.sleep(extra)
                if channel == "sms":
                    provider_id = f"SM{seq:032d}"
                    status, reply = 201, {"sid": provider_id, "status": "queued"}
                else:
                    provider_id = f"0100-soak-{seq:012d}"
                    status, reply = 200, {"MessageId": provider_id}
                headers = ()
            elif fault == "429":
                status, reply = 429, {"code": 20429, "message": "Too Many Requests"}
                headers = [("Retry-After", "1")]
                if channel == "email":
                    reply = {"message": "Maximum sending rate exceeded."}
                    headers.append(("x-amzn-ErrorType", "TooManyRequestsException"))
            elif fault == "timeout":
                time.sleep(TIMEOUT_SLEEP)
                status, reply, headers = 504, {"message": "gateway timeout"}, ()
            else:
                status = 503 if fault == "burst" else extra
                reply, headers = {"code": 20500, "message": "provider error"}, ()
                if channel == "email":
                    reply = {"message": "provider error"}
                    headers = [("x-amzn-ErrorType", "InternalFailure" if status == 500 else "ServiceUnavailable")]
            written = self.answer(status, reply, headers)
            state.done(seq, channel, status, fault, provider_id, written)

    return Handler


def run_mock(log_path, seed, work_dir):
    state = MockState(log_path, seed, work_dir)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
    server.daemon_threads = True
    server.request_queue_size = 256
    threading.Thread(target=state.burster, daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    print(server.server_address[1], flush=True)
    server.serve_forever()


# --------------------------------------------------------------------------
# The driver.
# --------------------------------------------------------------------------

def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def default_binary():
    targets = [os.environ.get("CARGO_TARGET_DIR"), os.path.join(ROOT, "target")]
    for target in filter(None, targets):
        for profile in ("debug", "release"):
            path = os.path.join(target, profile, "fairlane")
            if os.access(path, os.X_OK):
                return path
    return None


class Refused(Exception):
    """Nothing reached fairlane (connection refused): safe to send again."""


class Lost(Exception):
    """The request may have reached fairlane but no answer came back."""


class Client:
    """One keep-alive connection to fairlane."""

    def __init__(self, port, timeout=30):
        self.port, self.timeout, self.conn = port, timeout, None

    def close(self):
        if self.conn:
            self.conn.close()
        self.conn = None

    def request(self, method, path, body=None, headers=None):
        """(status, headers, payload); Refused or Lost."""
        if self.conn is None:
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
            try:
                self.conn.connect()
            except OSError as err:
                self.close()
                raise Refused(str(err)) from err
        try:
            self.conn.request(method, path, body, headers or {})
            response = self.conn.getresponse()
            payload = response.read()
        except (OSError, http.client.HTTPException) as err:
            self.close()
            raise Lost(f"{type(err).__name__}: {err}") from err
        if response.getheader("Connection", "").lower() == "close":
            self.close()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, payload


class Fairlane:
    """The copied binary, restarted on the same file and port."""

    def __init__(self, binary, work, port, mock_port):
        self.binary, self.work, self.port = binary, work, port
        self.log_path = os.path.join(work, "fairlane.log")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FAIRLANE", "AWS_"))}
        env.update(
            RUST_LOG="warn",
            FAIRLANE__SERVER__LISTEN=f"127.0.0.1:{port}",
            FAIRLANE__SERVER__ADMIN_TOKEN=ADMIN,
            FAIRLANE__STORAGE__URL=f"sqlite://{work}/fairlane.db",
            FAIRLANE__CONSUMERS__ENABLED="true",
            FAIRLANE__RETRY__MAX_ATTEMPTS=str(MAX_ATTEMPTS),
            FAIRLANE__RETRY__BASE_DELAY_MS="200",
            FAIRLANE__RETRY__MAX_DELAY_SECS="5",
            FAIRLANE__PROVIDERS__EMAIL__KIND="ses",
            FAIRLANE__PROVIDERS__EMAIL__ENDPOINT_URL=f"http://127.0.0.1:{mock_port}",
            FAIRLANE__PROVIDERS__EMAIL__REGION="us-east-1",
            FAIRLANE__PROVIDERS__EMAIL__ACCESS_KEY_ID="AKIDSOAKTEST",
            FAIRLANE__PROVIDERS__EMAIL__SECRET_ACCESS_KEY="soak-secret-key",
            FAIRLANE__PROVIDERS__EMAIL__FROM="soak@example.com",
            FAIRLANE__PROVIDERS__EMAIL__TIMEOUT_MS=str(PROVIDER_TIMEOUT_MS),
            FAIRLANE__PROVIDERS__EMAIL__RATE_PER_SECOND=str(RATE),
            FAIRLANE__PROVIDERS__EMAIL__BURST=str(BURST),
            FAIRLANE__PROVIDERS__SMS__KIND="http",
            FAIRLANE__PROVIDERS__SMS__BASE_URL=f"http://127.0.0.1:{mock_port}",
            FAIRLANE__PROVIDERS__SMS__ACCOUNT_SID="ACsoak",
            FAIRLANE__PROVIDERS__SMS__AUTH_TOKEN="soak-auth-token",
            FAIRLANE__PROVIDERS__SMS__FROM="+15550001111",
            FAIRLANE__PROVIDERS__SMS__TIMEOUT_MS=str(PROVIDER_TIMEOUT_MS),
            FAIRLANE__PROVIDERS__SMS__RATE_PER_SECOND=str(RATE),
            FAIRLANE__PROVIDERS__SMS__BURST=str(BURST),
        )
        for lane in ("FAST", "SLOW"):
            env[f"FAIRLANE__LANES__{lane}__VISIBILITY_TIMEOUT_SECS"] = str(VISIBILITY_SECS)
            env[f"FAIRLANE__LANES__{lane}__HIGH_WATER_MARK"] = "1000000000"
        self.env = env
        self.proc = None
        self.lives = []  # [start time, pid]
        self.expected_exit = False
        self.unexpected_exits = []
        self.lock = threading.Lock()

    def start(self):
        with open(self.log_path, "a") as log:
            log.write(f"==== soak: start {len(self.lives) + 1} at {time.time():.3f}\n")
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen([self.binary, "serve"], env=self.env, stdout=log,
                                     stderr=subprocess.STDOUT, cwd=self.work)
        log.close()
        self.expected_exit = False
        self.lives.append([time.time(), self.proc.pid])
        client = Client(self.port, timeout=2)
        deadline = time.time() + 90
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fairlane exited at start with {self.proc.returncode}")
            try:
                if client.request("GET", "/healthz")[0] == 200:
                    client.close()
                    return time.time()
            except (Refused, Lost):
                pass
            time.sleep(0.05)
        raise RuntimeError("fairlane did not answer /healthz within 90 s")

    def kill9(self):
        with self.lock:
            self.expected_exit = True
            at = time.time()
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            up = self.start()
            return at, up

    def terminate(self, restart=True):
        with self.lock:
            self.expected_exit = True
            at = time.time()
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                code = "hung (killed after 90 s)"
            stopped = time.time()
            up = self.start() if restart else None
            return at, stopped, code, up

    def watch(self):
        """Restarts fairlane if it died on its own (counted as a failure)."""
        with self.lock:
            if self.proc and not self.expected_exit and self.proc.poll() is not None:
                self.unexpected_exits.append((time.time(), self.proc.returncode))
                self.start()

    def kill_quietly(self):
        if self.proc and self.proc.poll() is None:
            self.expected_exit = True
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def tail(self, lines=60):
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.accepted = []           # dicts: id, tenant, token, channel, priority, at, keyed
        self.api_status = collections.Counter()
        self.refused = 0
        self.lost = 0
        self.recovered_by_replay = 0  # keyed sends retried after Lost and answered as replays
        self.ambiguous = {}          # token -> tenant (keyless sends whose connection broke)
        self.abandoned = {}          # token -> tenant (keyed sends given up at the end)
        self.unexpected = []         # (what, status, payload) for valid requests
        self.invalid = collections.Counter()      # kind -> sent
        self.invalid_ok = collections.Counter()   # kind -> 4xx problem+json
        self.invalid_bad = []        # (kind, status, content type, payload)
        self.invalid_mismatch = collections.Counter()  # (kind, expected, got)
        self.replays = 0
        self.replays_same = 0
        self.replays_bad = []


INVALID = [
    # (kind, expected status)
    ("missing_to", 422), ("bad_e164", 422), ("unknown_field", 422), ("malformed_json", 400),
    ("text_plain", 415), ("bad_key", 401), ("key_reused_other_body", 422), ("bad_idempotency_key", 400),
]


class Sender(threading.Thread):
    def __init__(self, run, tenant, key, rate, seed):
        super().__init__(daemon=True, name=f"sender-{tenant}")
        self.run_, self.tenant, self.key, self.rate = run, tenant, key, rate
        self.rng = random.Random(seed)
        self.client = Client(run.port)
        self.n = 0
        self.keyed = []  # (key, body bytes, id)

    def headers(self, idem=None, content_type="application/json", key=None):
        h = {"Authorization": f"Bearer {key or self.key}", "Content-Type": content_type}
        if idem is not None:
            h["Idempotency-Key"] = idem
        return h

    def new_request(self):
        self.n += 1
        token = f"soak-{self.tenant}-{self.n}"
        channel = "email" if self.rng.random() < 0.5 else "sms"
        r = self.rng.random()
        priority = "high" if r < 0.2 else "normal" if r < 0.7 else "low"
        if channel == "email":
            body = {"channel": "email", "to": f"user{self.n % 97}@example.com",
                    "subject": f"Soak {token}", "text": f"Hello, this is {token}.", "priority": priority}
        else:
            body = {"channel": "sms", "to": f"+1555{self.n % 10000000:07d}",
                    "text": f"Your code for {token} is {self.n % 1000000:06d}", "priority": priority}
        if self.rng.random() < 0.3:
            body["reference"] = token
        return token, channel, priority, json.dumps(body).encode()

    def give_up_at(self):
        return self.run_.stop_at + 30

    def post(self, body, headers):
        """Sends until fairlane answers; returns (status, headers, payload, lost_before) or None."""
        lost_before = False
        while time.time() < self.give_up_at():
            try:
                status, h, payload = self.client.request("POST", "/v1/messages", body, headers)
                return status, h, payload, lost_before
            except Refused:
                with self.run_.stats.lock:
                    self.run_.stats.refused += 1
                time.sleep(0.2)
            except Lost:
                with self.run_.stats.lock:
                    self.run_.stats.lost += 1
                lost_before = True
                if "Idempotency-Key" not in headers:
                    return None, None, None, True
                time.sleep(0.2)
        return None, None, None, lost_before

    def send_new(self):
        token, channel, priority, body = self.new_request()
        keyed = self.rng.random() < 0.9
        idem = f"idem-{token}" if keyed else None
        stats = self.run_.stats
        while True:
            status, h, payload, lost_before = self.post(body, self.headers(idem))
            if status is None:
                with stats.lock:
                    if lost_before and not keyed:
                        stats.ambiguous[token] = self.tenant
                    else:
                        stats.abandoned[token] = self.tenant
                return
            with stats.lock:
                stats.api_status[status] += 1
            if status == 202:
                answer = json.loads(payload)
                replayed = h.get("idempotent-replayed") == "true"
                with stats.lock:
                    stats.accepted.append({"id": answer["id"], "tenant": self.tenant, "token": token,
                                           "channel": channel, "priority": priority, "at": time.time(),
                                           "keyed": keyed})
                    if replayed and lost_before:
                        stats.recovered_by_replay += 1
                    elif replayed:
                        stats.unexpected.append(("first send answered as a replay", status, payload[:200]))
                if keyed:
                    self.keyed.append((idem, body, answer["id"]))
                return
            if status in (409, 429, 503) and time.time() < self.give_up_at():
                time.sleep(min(5.0, float(h.get("retry-after", "0.5") or 0.5)))
                continue
            with stats.lock:
                stats.unexpected.append((f"send {token}", status, payload[:300]))
            return

    def send_replay(self):
        if not self.keyed:
            return self.send_new()
        idem, body, first_id = self.rng.choice(self.keyed)
        status, h, payload, _ = self.post(body, self.headers(idem))
        stats = self.run_.stats
        if status is None:
            return
        with stats.lock:
            stats.api_status[status] += 1
            stats.replays += 1
            try:
                same = status == 202 and json.loads(payload)["id"] == first_id \
                    and h.get("idempotent-replayed") == "true"
            except (ValueError, KeyError):
                same = False
            if same:
                stats.replays_same += 1
            else:
                stats.replays_bad.append((idem, status, payload[:200]))

    def send_invalid(self):
        kind, expected = self.rng.choice(INVALID)
        good = {"channel": "sms", "to": "+15551230000", "text": "invalid soak request"}
        headers = self.headers()
        body = None
        if kind == "missing_to":
            body = {"channel": "email", "subject": "s", "text": "t"}
        elif kind == "bad_e164":
            body = dict(good, to="555-CALL-NOW")
        elif kind == "unknown_field":
            body = {"channel": "email", "to": "a@example.com", "subjet": "s", "text": "t"}
        elif kind == "malformed_json":
            body = b'{"channel": "sms", "to": '
        elif kind == "text_plain":
            headers = self.headers(content_type="text/plain")
            body = good
        elif kind == "bad_key":
            headers = self.headers(key="fl_not_a_real_key_0000000000")
            body = good
        elif kind == "key_reused_other_body":
            if not self.keyed:
                return self.send_new()
            idem, _, _ = self.rng.choice(self.keyed)
            headers = self.headers(idem)
            body = dict(good, text="another body under a used key")
        elif kind == "bad_idempotency_key":
            headers = self.headers("has spaces in it")
            body = good
        if isinstance(body, dict):
            body = json.dumps(body).encode()
        status, h, payload, _ = self.post(body, headers)
        stats = self.run_.stats
        if status is None:
            return
        with stats.lock:
            stats.api_status[status] += 1
            stats.invalid[kind] += 1
            content_type = h.get("content-type", "")
            if 400 <= status < 500 and content_type.startswith("application/problem+json"):
                stats.invalid_ok[kind] += 1
                if status != expected:
                    stats.invalid_mismatch[(kind, expected, status)] += 1
            elif status in (429, 503):
                stats.invalid[kind] -= 1  # refused for load, not judged: not counted
            else:
                stats.invalid_bad.append((kind, status, content_type, payload[:200]))

    def run(self):
        interval = 1.0 / self.rate
        next_at = time.time() + self.rng.uniform(0, interval)
        while time.time() < self.run_.stop_at:
            now = time.time()
            if next_at > now:
                time.sleep(next_at - now)
            r = self.rng.random()
            if r < 0.02:
                self.send_invalid()
            elif r < 0.04:
                self.send_replay()
            else:
                self.send_new()
            next_at = max(next_at + self.rng.uniform(0.5, 1.5) * interval, time.time() - 1.0)
        self.client.close()


class Run:
    def __init__(self, args):
        self.args = args
        self.stats = Stats()
        self.stop_at = float("inf")
        self.samples = []  # (t, life, rss kB, fds)
        self.sampling = True

    def sampler(self):
        while self.sampling:
            self.fl.watch()
            life = len(self.fl.lives)
            pid = self.fl.proc.pid
            try:
                with open(f"/proc/{pid}/status") as f:
                    rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
                fds = len(os.listdir(f"/proc/{pid}/fd"))
                if life == len(self.fl.lives):
                    self.samples.append((time.time(), life, rss, fds))
                    with open(os.path.join(self.fl.work, "samples.csv"), "a") as f:
                        f.write(f"{time.time():.3f},{life},{pid},{rss},{fds}\n")
            except (OSError, StopIteration, ValueError):
                pass
            time.sleep(SAMPLE_SECS)

    def mock_call(self, method, path, body=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.mock_port, timeout=5)
        try:
            conn.request(method, path, json.dumps(body) if body is not None else None)
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()

    def admin(self, method, path, body=None):
        client = Client(self.port)
        try:
            status, _, payload = client.request(method, path, json.dumps(body) if body is not None else None,
                                                {"Authorization": f"Bearer {ADMIN}",
                                                 "Content-Type": "application/json"})
        finally:
            client.close()
        if status >= 300:
            raise RuntimeError(f"{method} {path}: {status} {payload[:300]!r}")
        return json.loads(payload) if payload else None

    def poll_statuses(self, records, found):
        """GET every record's status (4 threads); fills found[id] = view."""
        def work(chunk):
            client = Client(self.port, timeout=10)
            for rec in chunk:
                try:
                    status, _, payload = client.request("GET", f"/v1/messages/{rec['id']}",
                                                        headers={"Authorization": f"Bearer {self.keys[rec['tenant']]}"})
                except (Refused, Lost):
                    continue
                if status == 200:
                    found[rec["id"]] = json.loads(payload)
            client.close()
        chunks = [records[i::4] for i in range(4)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(work, chunks))


def fmt_t(t, t0):
    return f"{t - t0:7.1f} s"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--binary")
    parser.add_argument("--rate", type=float, default=24.0, help="sends per second, all tenants together")
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument("--mock-provider", nargs=3, metavar=("LOG", "SEED", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mock_provider:
        log, seed, work = args.mock_provider
        return run_mock(log, int(seed), work)

    source = args.binary or default_binary()
    if not source or not os.access(source, os.X_OK):
        raise SystemExit("no fairlane binary: pass --binary PATH or build one "
                         "(cargo build --bin fairlane), with CARGO_TARGET_DIR as usual")
    work = tempfile.mkdtemp(prefix="fairlane-soak-")
    binary = os.path.join(work, "fairlane")
    shutil.copy2(source, binary)
    print(f"soak: {args.minutes:g} min, {args.rate:g} sends/s, seed {args.seed}; binary {source} "
          f"(copied to {binary}); work dir {work}", flush=True)

    run = Run(args)
    mock_log = os.path.join(work, "provider.jsonl")
    mock = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--mock-provider", mock_log,
                             str(args.seed), work], stdout=subprocess.PIPE, text=True)
    run.mock_port = int(mock.stdout.readline())
    run.port = free_port()
    fl = Fairlane(binary, work, run.port, run.mock_port)
    run.fl = fl
    ok = False
    try:
        ok = soak(run, fl, work)
    except BaseException:
        print("---- fairlane log (tail) ----\n" + fl.tail(), file=sys.stderr)
        raise
    finally:
        run.sampling = False
        fl.kill_quietly()
        mock.terminate()
        mock.wait()
        if args.keep or not ok:
            print(f"work dir kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    sys.exit(0 if ok else 1)


def soak(run, fl, work):
    args, stats = run.args, run.stats
    fl.start()
    run.admin("PUT", "/v1/admin/plans/soak", {"lane": "fast", "rate_per_second": 1e6, "burst": 1000000,
                                             "daily_quota": 1000000000, "max_in_flight": 16})
    run.admin("PUT", "/v1/admin/plans/soak-slow", {"lane": "slow", "rate_per_second": 1e6, "burst": 1000000,
                                                  "daily_quota": 1000000000, "max_in_flight": 4})
    tenants = {"t1": "soak", "t2": "soak", "t3": "soak", "t4": "soak", "ts": "soak-slow"}
    run.keys = {}
    for tenant, plan in tenants.items():
        run.admin("POST", "/v1/admin/tenants", {"id": tenant, "name": f"Soak {tenant}", "plan": plan})
        run.keys[tenant] = run.admin("POST", f"/v1/admin/tenants/{tenant}/keys")["key"]

    duration = args.minutes * 60
    t0 = time.time()
    run.stop_at = t0 + duration
    threading.Thread(target=run.sampler, daemon=True).start()
    shares = {"t1": 0.22, "t2": 0.22, "t3": 0.22, "t4": 0.22, "ts": 0.12}
    senders = [Sender(run, t, run.keys[t], args.rate * shares[t], args.seed * 100 + i)
               for i, t in enumerate(tenants)]
    for s in senders:
        s.start()

    restarts = []  # dicts
    plan = [(0.30, "kill -9"), (0.55, "graceful"), (0.80, "kill -9")]
    next_report = t0 + 30
    while time.time() < run.stop_at:
        now = time.time()
        if plan and now >= t0 + plan[0][0] * duration:
            _, kind = plan.pop(0)
            # Stop while the provider is answering a call (waiting up to 5 s
            # for one), so the crash window and the graceful path are used.
            snapshot, waited_until = {}, time.time() + 5
            while time.time() < waited_until:
                try:
                    snapshot = run.mock_call("GET", "/_stats")["in_flight"]
                except OSError:
                    snapshot = {}
                if sum(snapshot.values()) > 0:
                    break
                time.sleep(0.02)
            if kind == "kill -9":
                at, up = fl.kill9()
                restarts.append({"kind": kind, "at": at, "up": up, "snapshot": snapshot})
                print(f"[{fmt_t(at, t0)}] kill -9; provider calls in flight just before: "
                      f"{sum(snapshot.values())} {snapshot}; up again after {up - at:.2f} s", flush=True)
            else:
                at, stopped, code, up = fl.terminate()
                restarts.append({"kind": kind, "at": at, "stopped": stopped, "code": code, "up": up,
                                 "snapshot": snapshot})
                print(f"[{fmt_t(at, t0)}] SIGTERM; provider calls in flight just before: "
                      f"{sum(snapshot.values())} {snapshot}; exited {code} after {stopped - at:.2f} s; "
                      f"up again after {up - at:.2f} s", flush=True)
            continue
        if now >= next_report:
            next_report += 30
            try:
                st = run.mock_call("GET", "/_stats")
            except OSError:
                st = {"arrivals": "?"}
            rss = run.samples[-1][2] / 1024 if run.samples else 0
            with stats.lock:
                accepted = len(stats.accepted)
            print(f"[{fmt_t(now, t0)}] accepted {accepted}, provider calls {st['arrivals']}, "
                  f"RSS {rss:.1f} MiB, life {len(fl.lives)}", flush=True)
        time.sleep(0.1)

    # Traffic ends: no more provider bursts, senders finish what they hold.
    t_stop = time.time()
    try:
        run.mock_call("POST", "/_control", {"bursts": False})
    except OSError:
        pass
    for s in senders:
        s.join(timeout=60)
    t_senders = time.time()
    accepted = list(stats.accepted)
    print(f"[{fmt_t(t_senders, t0)}] traffic stopped: {len(accepted)} accepted; waiting for terminal statuses",
          flush=True)

    views = {}
    deadline = time.time() + DRAIN_SECS
    pending = accepted
    while True:
        run.poll_statuses(pending, views)
        pending = [r for r in accepted if views.get(r["id"], {}).get("status") not in TERMINAL]
        if not pending or time.time() > deadline:
            break
        time.sleep(2)
    t_drained = time.time()
    print(f"[{fmt_t(t_drained, t0)}] {len(accepted) - len(pending)} of {len(accepted)} terminal", flush=True)
    time.sleep(SAMPLE_SECS + 1)  # one more sample after the drain
    run.sampling = False
    final_life = len(fl.lives)
    at, stopped, final_code, _ = fl.terminate(restart=False)
    time.sleep(0.5)  # the mock logs calls it was still answering
    return report(run, fl, work, t0, t_stop, t_drained, accepted, views, pending, restarts,
                  final_life, final_code, stopped - at)


def report(run, fl, work, t0, t_stop, t_drained, accepted, views, pending, restarts,
           final_life, final_code, final_stop_secs):
    stats = run.stats
    failures = []
    rows = []

    def row(label, value, ok=None, why=None):
        rows.append((label, str(value), "" if ok is None else ("ok" if ok else "FAIL")))
        if ok is False:
            failures.append(why or label)

    # ---- the provider's log
    arrivals, dones, bursts = {}, {}, []
    with open(os.path.join(work, "provider.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if rec[0] == "a":
                arrivals[rec[1]] = rec[2:]            # t, channel, token
            elif rec[0] == "d":
                dones[rec[1]] = rec[2:]               # t, status, fault, provider id, written
            else:
                bursts.append(rec[1:])
    calls = []
    for seq, (t, channel, token) in sorted(arrivals.items()):
        done = dones.get(seq)
        calls.append({"seq": seq, "t": t, "channel": channel, "token": token,
                      "done": done[0] if done else None, "status": done[1] if done else None,
                      "fault": done[2] if done else "unanswered", "pid": done[3] if done else None,
                      "written": done[4] if done else False})
    success = [c for c in calls if c["status"] in (200, 201)]
    by_token = collections.defaultdict(list)
    for c in success:
        by_token[c["token"]].append(c)
    faults = collections.Counter(c["fault"] for c in calls)

    kills = [r for r in restarts if r["kind"] == "kill -9"]
    graceful = [r for r in restarts if r["kind"] == "graceful"]

    # ---- accepted and statuses
    by_channel = collections.Counter(r["channel"] for r in accepted)
    ids = [r["id"] for r in accepted]
    token_of = {r["id"]: r["token"] for r in accepted}
    accepted_tokens = {r["token"]: r for r in accepted}
    status_counts = collections.Counter(views.get(i, {}).get("status", "unknown") for i in ids)
    sent_tokens = {token_of[i] for i in ids if views.get(i, {}).get("status") in SENT_LIKE}

    row("duration of traffic", f"{(t_stop - t0) / 60:.1f} min; drained {t_drained - t_stop:.0f} s after it")
    row("messages accepted (202)", f"{len(accepted)}: email {by_channel['email']}, sms {by_channel['sms']}; "
        f"{len(accepted) / max(1.0, t_stop - t0):.1f}/s")
    row("accepted ids distinct", f"{len(set(ids))} of {len(ids)}", len(set(ids)) == len(ids))
    api = ", ".join(f"{k}: {v}" for k, v in sorted(stats.api_status.items()))
    bad5xx = sum(v for k, v in stats.api_status.items() if k >= 500 and k != 503)
    row("fairlane answers", api, bad5xx == 0, "fairlane answered a 5xx other than 503")
    row("sends to a stopped fairlane", f"{stats.refused} refused at connect (sent again), "
        f"{stats.lost} connections lost mid-request; {stats.recovered_by_replay} keyed sends recovered "
        f"as replays, {len(stats.ambiguous)} keyless ambiguous, {len(stats.abandoned)} abandoned")
    row("unexpected answers to valid sends", len(stats.unexpected), not stats.unexpected)
    n_invalid = sum(stats.invalid.values())
    n_invalid_ok = sum(stats.invalid_ok.values())
    row("invalid requests sent / refused 4xx problem+json", f"{n_invalid} / {n_invalid_ok}",
        n_invalid == n_invalid_ok and not stats.invalid_bad, "an invalid request was not a 4xx problem+json")
    mismatch = "; ".join(f"{k} expected {e} got {g} x{n}" for (k, e, g), n in stats.invalid_mismatch.items())
    row("invalid requests by kind", ", ".join(f"{k} {v}" for k, v in sorted(stats.invalid.items()))
        + (f" (codes differing: {mismatch})" if mismatch else ""))
    row("idempotent replays / same id", f"{stats.replays} / {stats.replays_same}",
        stats.replays == stats.replays_same, "a replay did not answer the first id")
    row("provider calls", f"{len(calls)}: sms {sum(c['channel'] == 'sms' for c in calls)}, "
        f"email {sum(c['channel'] == 'email' for c in calls)}")
    row("faults injected", ", ".join(f"{k} {faults[k]}" for k in ("429", "5xx", "timeout", "slow", "burst"))
        + f" (503 bursts: {len(bursts)}); ok {faults['ok']}")

    row("restarts", f"{len(kills)} kill -9, {len(graceful)} graceful (exit "
        + ", ".join(str(g["code"]) for g in graceful) + ")",
        len(kills) == 2 and len(graceful) == 1 and all(g["code"] == 0 for g in graceful),
        "the restarts did not all happen, or the graceful stop did not exit 0")
    for r in restarts:
        extra = f", stopped in {r['stopped'] - r['at']:.2f} s" if "stopped" in r else ""
        busy = [c for c in calls if c["t"] <= r["at"] and (c["done"] is None or c["done"] > r["at"])]
        faults_busy = ", ".join(f"{k} {v}" for k, v in collections.Counter(c["fault"] for c in busy).items())
        row(f"  {r['kind']} at", f"{r['at'] - t0:.1f} s with {len(busy)} provider calls under way"
            + (f" ({faults_busy})" if busy else "") + f"{extra}; serving again {r['up'] - r['at']:.2f} s later")
    row("unexpected exits of fairlane", len(fl.unexpected_exits), not fl.unexpected_exits)
    row("final stop (SIGTERM)", f"exit {final_code} in {final_stop_secs:.1f} s", final_code == 0)

    row("lost (accepted, not terminal)", len(pending), not pending)
    row("statuses", ", ".join(f"{k} {v}" for k, v in status_counts.most_common()))
    attempts = collections.Counter(views[i].get("attempts") for i in ids if i in views)
    row("attempts per message", ", ".join(f"{k}: {v}" for k, v in sorted(attempts.items(), key=lambda x: x[0] or 0)))

    # ---- arrivals against `sent`
    dup_extra = sum(len(v) - 1 for v in by_token.values())
    unknown = {t for t in by_token if t not in accepted_tokens}
    unknown_ok = {t for t in unknown if t in stats.ambiguous or t in stats.abandoned}
    known_success = {t for t in by_token if t in accepted_tokens}
    sent_not_arrived = sent_tokens - known_success
    arrived_not_sent = known_success - sent_tokens
    # A success answered to a process killed mid-call, after which the
    # message ran out of attempts: the one documented way to this.
    in_crash = {c["token"] for k in kills for c in success
                if c["t"] <= k["at"] and k["at"] - 1.0 <= c["done"]}
    arrived_not_sent_bad = {t for t in arrived_not_sent if t not in in_crash}
    row("successful provider arrivals", f"{len(success)} = {len(known_success)} accepted tokens + "
        f"{dup_extra} duplicates + {len(unknown)} tokens of unacknowledged sends; `sent` count "
        f"{len(sent_tokens)}", not sent_not_arrived and not arrived_not_sent_bad,
        "successful arrivals do not match the `sent` messages")
    row("`sent` without a successful arrival", len(sent_not_arrived), not sent_not_arrived)
    row("successful arrival, message not `sent`", f"{len(arrived_not_sent)} "
        f"({len(arrived_not_sent) - len(arrived_not_sent_bad)} answered to a killed process)",
        not arrived_not_sent_bad, "a message the provider took is not `sent`")
    row("arrivals of tokens never answered 202", f"{len(unknown)} ({len(unknown_ok)} from ambiguous or "
        "abandoned sends)", unknown == unknown_ok, "the provider got a message nobody was given a 202 for")
    pid_bad = []
    for i in ids:
        v = views.get(i, {})
        if v.get("status") in SENT_LIKE:
            pids = {c["pid"] for c in by_token.get(token_of[i], [])}
            if v.get("provider_message_id") not in pids:
                pid_bad.append((token_of[i], v.get("provider_message_id")))
    lags = []
    for i in ids:
        v = views.get(i, {})
        calls_of = {c["pid"]: c for c in by_token.get(token_of[i], [])}
        call = calls_of.get(v.get("provider_message_id"))
        if call and v.get("sent_at"):
            sent_at = datetime.datetime.fromisoformat(v["sent_at"].replace("Z", "+00:00")).timestamp()
            lags.append(sent_at - call["done"])
    latency = collections.defaultdict(list)
    for r in accepted:
        v = views.get(r["id"], {})
        if v.get("sent_at"):
            sent_at = datetime.datetime.fromisoformat(v["sent_at"].replace("Z", "+00:00")).timestamp()
            latency[r["priority"]].append(sent_at - r["at"])
    parts = []
    for priority in ("high", "normal", "low"):
        xs = sorted(latency[priority])
        if xs:
            parts.append(f"{priority} p50 {xs[len(xs) // 2]:.2f} / p99 {xs[int(len(xs) * 0.99)]:.2f} / "
                         f"max {xs[-1]:.1f}")
    row("202 to `sent_at`, seconds", "; ".join(parts))
    if lags:
        lags.sort()
        row("provider answer to `sent_at`", f"p50 {lags[len(lags) // 2] * 1000:.0f} ms, "
            f"p99 {lags[int(len(lags) * 0.99)] * 1000:.0f} ms, max {lags[-1] * 1000:.0f} ms")
    unseen = sum(1 for c in success if not c["written"])
    row("successes answered to a closed connection", unseen)
    row("`sent` provider ids the mock gave for that token", f"{len(sent_tokens) - len(pid_bad)} of "
        f"{len(sent_tokens)}", not pid_bad)

    # ---- duplicates and crash windows
    bound_parts = []
    for k in kills:
        in_flight = sum(1 for c in calls if c["t"] <= k["at"] and (c["done"] is None or c["done"] > k["at"]))
        just_before = sum(1 for c in success if k["at"] - 1.0 <= c["done"] <= k["at"])
        bound_parts.append((in_flight, just_before))
    bound = sum(a + b for a, b in bound_parts)
    outside = []
    dup_lines = []
    for token, cs in sorted(by_token.items()):
        if len(cs) < 2:
            continue
        for first, later in zip(cs, cs[1:]):
            # The first success was under way or answered at most the
            # visibility timeout before a kill -9, and the second call came
            # after that kill.
            window = [k for k in kills
                      if first["t"] <= k["at"] < later["t"] and k["at"] - VISIBILITY_SECS <= first["done"]]
            if window:
                k = window[0]
                state = "in flight at" if first["done"] > k["at"] else \
                    f"answered {k['at'] - first['done']:.2f} s before"
                where = (f"first success {state} the kill -9 at {k['at'] - t0:.1f} s; called again "
                         f"{later['t'] - k['at']:.2f} s after the kill")
            else:
                where = (f"OUTSIDE any crash window: first success at {first['done'] - t0:.1f} s, called "
                         f"again {later['t'] - first['done']:.1f} s later")
            dup_lines.append(f"    {token}: {where}")
            if not window:
                outside.append(token)
    row("duplicates (successful arrivals beyond the first)", f"{dup_extra}; bound {bound} = "
        + " + ".join(f"({a} in flight + {b} answered in the last 1 s) at kill {n + 1}"
                     for n, (a, b) in enumerate(bound_parts)),
        dup_extra <= bound, "more duplicates than calls in flight at the kills")
    row("duplicates outside a crash window", len(outside), not outside)

    # ---- provider rate
    for channel in ("email", "sms"):
        times = sorted(c["t"] for c in calls if c["channel"] == channel)
        worst, at = 0, None
        j = 0
        for i in range(len(times)):
            while times[i] - times[j] >= 1.0:
                j += 1
            if i - j + 1 > worst:
                worst, at = i - j + 1, times[j]
        # The gate's own promise: at most burst + rate x t calls in any
        # window of length t; the worst excess over it (t <= 1 s).
        excess, dense = 0.0, ""
        for i in range(len(times)):
            k = i
            while k < len(times) and times[k] - times[i] <= 1.0:
                over = (k - i + 1) - (BURST + RATE * (times[k] - times[i]))
                if over > excess:
                    excess = over
                    dense = (f" ({k - i + 1} calls in {(times[k] - times[i]) * 1000:.0f} ms at "
                             f"{times[i] - t0:.1f} s)")
                k += 1
        near = [r["kind"] for r in restarts if at is not None and r["at"] - 2 <= at <= r["up"] + 2]
        where = f" at {at - t0:.1f} s" + (f" (around the {near[0]} restart)" if near else "") if at else ""
        row(f"most {channel} calls in any 1 s", f"{worst} (rate + burst = {RATE + BURST:.0f}){where}; "
            f"worst excess over burst + rate x t: {excess:+.2f} calls{dense}",
            worst <= RATE + BURST, f"{channel} calls above the provider rate")

    # ---- memory and open files
    lives = collections.defaultdict(list)
    for t, life, rss, fds in run.samples:
        lives[life].append((t, rss, fds))
    for life in sorted(lives):
        s = lives[life]
        # Least-squares slope of RSS after warm-up, for information.
        start = fl.lives[life - 1][0]
        late = [(t, rss) for t, rss, _ in s if t - start >= WARM_UP_SECS]
        slope = ""
        if len(late) >= 3:
            mt = sum(t for t, _ in late) / len(late)
            mr = sum(r for _, r in late) / len(late)
            var = sum((t - mt) ** 2 for t, _ in late)
            slope = f"; RSS after {WARM_UP_SECS} s {sum((t - mt) * (r - mr) for t, r in late) / var * 60 / 1024:+.2f} MiB/min"
        row(f"life {life}: RSS MiB first/max/last", f"{s[0][1] / 1024:.1f} / {max(x[1] for x in s) / 1024:.1f} / "
            f"{s[-1][1] / 1024:.1f}; fds {s[0][2]} / {max(x[2] for x in s)} / {s[-1][2]} "
            f"({len(s)} samples over {s[-1][0] - start:.0f} s{slope})")
    final = lives.get(final_life, [])
    if final:
        start = fl.lives[final_life - 1][0]
        warm = next((x for x in final if x[0] - start >= WARM_UP_SECS), final[0])
        end = final[-1]
        all_rss = [x[2] for x in run.samples]
        all_fds = [x[3] for x in run.samples]
        row("RSS after warm-up / at the end (last life)",
            f"{warm[1] / 1024:.1f} MiB at {warm[0] - start:.0f} s / {end[1] / 1024:.1f} MiB at "
            f"{end[0] - start:.0f} s (limit x{RSS_GROWTH}); all lives min {min(all_rss) / 1024:.1f}, "
            f"max {max(all_rss) / 1024:.1f} MiB", end[1] <= warm[1] * RSS_GROWTH, "RSS grew")
        row("open fds after warm-up / at the end (last life)",
            f"{warm[2]} / {end[2]} (limit +{FD_GROWTH}); all lives min {min(all_fds)}, max {max(all_fds)}",
            end[2] <= warm[2] + FD_GROWTH, "open files grew")
    else:
        row("RSS / fds samples of the last life", "none", False)

    # ---- fairlane's own WARN lines (breaker opens, 429 pauses, ...)
    warnings = collections.Counter()
    with open(fl.log_path, errors="replace") as f:
        for line in f:
            found = re.search(r" WARN (\S+): (.*?\.)(?: \w+=|$)", line.strip())
            if found:
                warnings[found.group(2)[:90]] += 1
    row("fairlane WARN lines", "; ".join(f"{n} x {text}" for text, n in warnings.most_common(6)) or "none")

    # ---- print
    width = max(len(r[0]) for r in rows)
    print()
    print("soak summary")
    print("-" * (width + 60))
    for label, value, mark in rows:
        print(f"{label:<{width}}  {mark:<4}  {value}")
    print("-" * (width + 60))
    if dup_lines:
        print("duplicates:")
        print("\n".join(dup_lines))
    details = []
    if stats.unexpected:
        details.append("unexpected answers: " + "; ".join(map(str, stats.unexpected[:10])))
    if stats.invalid_bad:
        details.append("invalid requests not refused as expected: " + "; ".join(map(str, stats.invalid_bad[:10])))
    if stats.replays_bad:
        details.append("replays answered differently: " + "; ".join(map(str, stats.replays_bad[:10])))
    if pending:
        details.append("not terminal: " + "; ".join(f"{r['id']} {r['token']} "
                                                     f"{views.get(r['id'], {}).get('status')}" for r in pending[:10]))
    if arrived_not_sent:
        details.append("taken by the provider but not `sent`: " + "; ".join(
            f"{t} {views.get(accepted_tokens[t]['id'], {}).get('status')}" for t in sorted(arrived_not_sent)[:10]))
    if sent_not_arrived:
        details.append("`sent` without arrival: " + ", ".join(sorted(sent_not_arrived)[:10]))
    if pid_bad:
        details.append("provider id not the mock's: " + "; ".join(map(str, pid_bad[:10])))
    if unknown - unknown_ok:
        details.append("unacknowledged tokens at the provider: " + ", ".join(sorted(unknown - unknown_ok)[:10]))
    for line in details:
        print(line)
    errors = collections.Counter()
    with open(fl.log_path, errors="replace") as f:
        for line in f:
            if " ERROR " in line:
                errors[re.sub(r"^\S+\s+ERROR\s+", "", line.strip())[:160]] += 1
    if errors:
        print("ERROR lines in fairlane's log:")
        for text, n in errors.most_common(10):
            print(f"  {n} x {text}")
    if failures:
        print("---- fairlane log (tail) ----\n" + fl.tail(40))
        print("FAIL: " + "; ".join(failures))
        return False
    print("PASS")
    return True


if __name__ == "__main__":
    main()
