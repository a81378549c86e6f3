#!/usr/bin/env python3
"""Checks deploy/grafana/fairlane.json without a Grafana.

1. The dashboard model (always): schemaVersion, a Prometheus datasource
   variable DS_PROMETHEUS, unique panel ids, gridPos inside Grafana's 24
   columns without overlaps, every query panel with targets that have a
   refId, an expr and the templated datasource, and every metric an expr
   names is a metric of fairlane (src/metrics.rs) listed in the book's
   "Metrics" table (docs/src/operations/metrics.md).

2. With --live: starts fairlane (--fairlane BINARY) on a fresh SQLite file
   with an HTTP SMS provider played by this script and the log provider for
   email, a Prometheus (the `prometheus` binary, e.g. Debian's package)
   scraping it every 2 s, and puts load on it for --seconds: tenants on a
   fast and a slow plan and one on a tight plan, emails and SMS of every
   priority, a provider that is slow and sometimes fails (retries, dead
   letters), a slow lane that reaches its high-water mark (429 lane). Then
   every target of every panel is evaluated through Prometheus's HTTP API
   (`/api/v1/query`, `$__rate_interval` as 30s, `$instance` as .*) and
   must return at least one series with a number. Without a `prometheus`
   binary it falls back to checking that each metric has samples in the
   /metrics text, and says so.

3. With --png FILE (and --live): draws every panel from Prometheus's
   query_range results with matplotlib, laid out by gridPos. That picture is
   rendered by this script; it is not a Grafana screenshot.

    python3 deploy/grafana/check.py
    python3 deploy/grafana/check.py --live --fairlane target/release/fairlane \\
        --seconds 60 --png deploy/grafana/fairlane.png

Exit status 0 when every check passed.
"""

import argparse
import http.client
import http.server
import json
import math
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "fairlane.json"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
PANEL_TYPES = {"row", "timeseries", "stat", "gauge", "bargauge", "table", "text"}
ADMIN = "grafana-check-admin-token-0123"
SMS_PATH = "/2010-04-01/Accounts/AC1/Messages.json"
RATE_INTERVAL = "30s"
COUNTS_LOCK = threading.Lock()


class Failures:
    def __init__(self):
        self.items = []

    def add(self, text):
        self.items.append(text)
        print(f"FAIL {text}")


# 1. The model ---------------------------------------------------------------

def metric_constants():
    """Metric names defined in src/metrics.rs."""
    text = (ROOT / "src" / "metrics.rs").read_text()
    return set(re.findall(r'pub const [A-Z_]+: &str = "(fairlane_[a-z_]+)";', text))


def documented_metrics():
    """Metric name -> type from the book's Metrics table."""
    table = (ROOT / "docs" / "src" / "operations" / "metrics.md").read_text()
    found = {}
    for line in table.splitlines():
        match = re.match(r"\| `(fairlane_[a-z_]+)` \| (\w+) \|", line)
        if match:
            found[match.group(1)] = match.group(2)
    return found


def metrics_in(expr, documented):
    """Base metric names an expression reads (histogram series suffixes removed)."""
    names = set()
    for name in re.findall(r"\bfairlane_[a-z_]+", expr):
        for suffix in ("_bucket", "_count", "_sum"):
            base = name[: -len(suffix)] if name.endswith(suffix) else None
            if base and documented.get(base) == "histogram":
                name = base
                break
        names.add(name)
    return names


def query_panels(dashboard):
    return [p for p in dashboard.get("panels", []) if p.get("type") != "row"]


def check_model(dashboard, failures):
    for key, kind in [("title", str), ("uid", str), ("schemaVersion", int), ("panels", list),
                      ("templating", dict), ("time", dict)]:
        if not isinstance(dashboard.get(key), kind):
            failures.add(f"dashboard.{key} should be a {kind.__name__}")
    if isinstance(dashboard.get("schemaVersion"), int) and dashboard["schemaVersion"] < 36:
        failures.add("schemaVersion below 36 (Grafana 9): panels would be migrated on import")
    variables = {v.get("name"): v for v in dashboard.get("templating", {}).get("list", [])}
    ds = variables.get("DS_PROMETHEUS")
    if not ds or ds.get("type") != "datasource" or ds.get("query") != "prometheus":
        failures.add("templating needs a datasource variable DS_PROMETHEUS of type prometheus")

    constants = metric_constants()
    documented = documented_metrics()
    ids = set()
    boxes = []
    for panel in dashboard.get("panels", []):
        name = f"panel {panel.get('id')} {panel.get('title')!r}"
        if not isinstance(panel.get("id"), int) or panel["id"] in ids:
            failures.add(f"{name}: id must be a unique integer")
        ids.add(panel.get("id"))
        if panel.get("type") not in PANEL_TYPES:
            failures.add(f"{name}: unknown type {panel.get('type')!r}")
        if not panel.get("title"):
            failures.add(f"{name}: no title")
        grid = panel.get("gridPos", {})
        if not all(isinstance(grid.get(k), int) for k in "xywh"):
            failures.add(f"{name}: gridPos needs integer x, y, w, h")
            continue
        if grid["x"] < 0 or grid["y"] < 0 or grid["w"] < 1 or grid["h"] < 1 or grid["x"] + grid["w"] > 24:
            failures.add(f"{name}: gridPos {grid} outside the 24 columns")
        for other, box in boxes:
            if (grid["x"] < box["x"] + box["w"] and box["x"] < grid["x"] + grid["w"]
                    and grid["y"] < box["y"] + box["h"] and box["y"] < grid["y"] + grid["h"]):
                failures.add(f"{name}: overlaps {other}")
        boxes.append((name, grid))
        if panel.get("type") == "row":
            continue
        if panel.get("datasource") != DATASOURCE:
            failures.add(f"{name}: datasource should be {DATASOURCE}")
        targets = panel.get("targets") or []
        if not targets:
            failures.add(f"{name}: no targets")
        refs = set()
        for target in targets:
            if not target.get("refId") or target["refId"] in refs:
                failures.add(f"{name}: each target needs its own refId")
            refs.add(target.get("refId"))
            if target.get("datasource") != DATASOURCE:
                failures.add(f"{name} {target.get('refId')}: datasource should be {DATASOURCE}")
            expr = target.get("expr")
            if not isinstance(expr, str) or not expr.strip():
                failures.add(f"{name} {target.get('refId')}: no expr")
                continue
            used = metrics_in(expr, documented)
            if not used:
                failures.add(f"{name} {target.get('refId')}: reads no fairlane metric")
            for metric in used:
                if metric not in constants:
                    failures.add(f"{name}: {metric} is not defined in src/metrics.rs")
                if metric not in documented:
                    failures.add(f"{name}: {metric} is not in the book's Metrics table (docs/src/operations/metrics.md)")


# 2. Live ----------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SmsProvider(http.server.BaseHTTPRequestHandler):
    """A Twilio-compatible Messages API that is slow and sometimes fails."""

    counter = 0
    lock = threading.Lock()

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        time.sleep(random.uniform(0.01, 0.06))
        roll = random.random()
        if self.path != SMS_PATH:
            status, body = 404, {"message": "not found"}
        elif roll < 0.05:
            status, body = 500, {"message": "try again"}
        elif roll < 0.07:
            status, body = 400, {"code": 21211, "message": "invalid number"}
        else:
            with SmsProvider.lock:
                SmsProvider.counter += 1
                sid = f"SM{SmsProvider.counter:032d}"
            status, body = 201, {"sid": sid, "status": "queued"}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def request(base, method, path, token, body=None):
    url = base + path
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, None


def wait_until(what, ready, seconds=60):
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if ready():
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{what} did not come up within {seconds} s")


def set_up_tenants(base):
    plans = {
        "check-fast": {"lane": "fast", "rate_per_second": 1e6, "burst": 1000000, "daily_quota": 10**9, "max_in_flight": 64},
        "check-slow": {"lane": "slow", "rate_per_second": 1e6, "burst": 1000000, "daily_quota": 10**9, "max_in_flight": 16},
        "check-tight": {"lane": "fast", "rate_per_second": 2.0, "burst": 2, "daily_quota": 60, "max_in_flight": 4},
    }
    keys = {}
    for plan, body in plans.items():
        status, _ = request(base, "PUT", f"/v1/admin/plans/{plan}", ADMIN, body)
        assert status in (200, 201), f"plan {plan}: {status}"
        tenant = plan.replace("check-", "")
        status, _ = request(base, "POST", "/v1/admin/tenants", ADMIN, {"id": tenant, "name": tenant, "plan": plan})
        assert status == 201, f"tenant {tenant}: {status}"
        status, key = request(base, "POST", f"/v1/admin/tenants/{tenant}/keys", ADMIN)
        assert status == 201, f"key {tenant}: {status}"
        keys[tenant] = key["key"]
    return keys


def load(port, keys, seconds, counts):
    """One sender thread: about 40 sends a second on a kept-alive connection."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    tenants = ["fast", "fast", "slow", "slow", "tight"]
    priorities = ["high", "normal", "normal", "normal", "low"]
    end = time.time() + seconds
    n = 0
    while time.time() < end:
        n += 1
        tenant = random.choice(tenants)
        if random.random() < 0.5:
            body = {"channel": "sms", "to": f"+1555{random.randrange(10**7):07d}", "text": "Your code is 123456"}
        else:
            body = {"channel": "email", "to": f"user{n}@example.com", "subject": "Hello", "text": "Hi."}
        body["priority"] = random.choice(priorities)
        data = json.dumps(body)
        try:
            connection.request("POST", "/v1/messages", data, {
                "authorization": f"Bearer {keys[tenant]}", "content-type": "application/json"})
            response = connection.getresponse()
            response.read()
            with COUNTS_LOCK:
                counts[response.status] = counts.get(response.status, 0) + 1
        except (OSError, http.client.HTTPException):
            connection.close()
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        time.sleep(0.025)


def prometheus_query(prom, path, params):
    url = f"{prom}{path}?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as err:
        return json.loads(err.read() or b'{"status":"error","error":"HTTP error"}')


def concrete(expr):
    return expr.replace("$__rate_interval", RATE_INTERVAL).replace("$instance", ".*")


def evaluate(dashboard, prom, at, failures):
    """Evaluates every target at `at`; each must return a series with a number."""
    for panel in query_panels(dashboard):
        for target in panel["targets"]:
            expr = concrete(target["expr"])
            answer = prometheus_query(prom, "/api/v1/query", {"query": expr, "time": f"{at:.3f}"})
            label = f"{panel['title']!r} {target['refId']}"
            if answer.get("status") != "success":
                failures.add(f"{label}: {answer.get('error')} in {expr}")
                continue
            series = answer["data"]["result"]
            numbers = [float(s["value"][1]) for s in series if not math.isnan(float(s["value"][1]))]
            if not numbers:
                failures.add(f"{label}: no data ({len(series)} series, none a number) for {expr}")
            else:
                shown = ", ".join(
                    f"{','.join(f'{k}={v}' for k, v in s['metric'].items() if k != 'instance') or '-'}"
                    f"={float(s['value'][1]):.3g}" for s in series[:6])
                print(f"ok   {label}: {len(series)} series: {shown}{' …' if len(series) > 6 else ''}")


def evaluate_without_prometheus(dashboard, metrics_text, failures):
    documented = documented_metrics()
    for panel in query_panels(dashboard):
        for target in panel["targets"]:
            for metric in metrics_in(target["expr"], documented):
                if not re.search(rf"^{metric}(_bucket|_count|_sum)?[{{ ]", metrics_text, re.M):
                    failures.add(f"{panel['title']!r}: {metric} has no samples in /metrics")
    print("Prometheus is not installed: checked only that each metric has samples in /metrics, "
          "not that the PromQL evaluates.")


def render(dashboard, prom, start, end, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = dashboard["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    unit_w, unit_h = 0.75, 0.42
    fig = plt.figure(figsize=(24 * unit_w, rows * unit_h + 1.2))
    top = 1 - 1.0 / (rows * unit_h + 1.2)
    fig.text(0.01, 1 - 0.35 / (rows * unit_h + 1.2),
             f"{dashboard['title']}: rendered by deploy/grafana/check.py from Prometheus query results "
             f"under load (not a Grafana screenshot)", fontsize=13, weight="bold", va="center")
    step = 2
    for panel in panels:
        g = panel["gridPos"]
        left, width = g["x"] / 24, g["w"] / 24
        height = g["h"] / rows * top
        bottom = top - (g["y"] + g["h"]) / rows * top
        if panel["type"] == "row":
            fig.text(left + 0.005, bottom + height / 2, panel["title"], fontsize=12, weight="bold", va="center")
            continue
        ax = fig.add_axes([left + 0.03, bottom + 0.045 * (8 / g["h"]) * (rows * unit_h) / (rows * unit_h + 1.2),
                           width - 0.045, height * 0.68])
        ax.set_title(panel["title"], fontsize=9, loc="left")
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        if panel["type"] == "stat":
            values = []
            for target in panel["targets"]:
                answer = prometheus_query(prom, "/api/v1/query", {"query": concrete(target["expr"]), "time": f"{end:.3f}"})
                for s in answer.get("data", {}).get("result", []):
                    legend = re.sub(r"\{\{(\w+)\}\}", lambda m: s["metric"].get(m.group(1), ""), target.get("legendFormat", ""))
                    values.append((legend, float(s["value"][1])))
            ax.axis("off")
            for i, (legend, value) in enumerate(values):
                x = (i + 0.5) / max(len(values), 1)
                ax.text(x, 0.55, f"{value:.0f}", fontsize=28, ha="center", va="center",
                        color="tab:red" if value >= 1 else "tab:green", transform=ax.transAxes)
                ax.text(x, 0.1, legend, fontsize=10, ha="center", transform=ax.transAxes)
            continue
        for target in panel["targets"]:
            answer = prometheus_query(prom, "/api/v1/query_range", {
                "query": concrete(target["expr"]), "start": f"{start:.3f}", "end": f"{end:.3f}", "step": step})
            for s in answer.get("data", {}).get("result", []):
                xs = [float(t) - start for t, _ in s["values"]]
                ys = [float(v) for _, v in s["values"]]
                if all(math.isnan(y) or y == 0 for y in ys) and len(answer["data"]["result"]) > 8:
                    continue
                legend = re.sub(r"\{\{(\w+)\}\}", lambda m: s["metric"].get(m.group(1), ""), target.get("legendFormat", ""))
                ax.plot(xs, ys, linewidth=1, label=legend)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("seconds into the run", fontsize=7)
        ax.set_ylabel({"reqps": "per second", "s": "seconds"}.get(unit, ""), fontsize=7)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, ncol=3, loc="upper left")
    fig.savefig(png, dpi=70)
    print(f"wrote {png}")


def live(args, dashboard, failures):
    binary = Path(args.fairlane).resolve()
    if not binary.is_file():
        raise SystemExit(f"no fairlane binary at {binary}; build one (cargo build --release)")
    work = Path(tempfile.mkdtemp(prefix="fairlane-grafana-"))
    processes = []
    try:
        sms_port = free_port()
        provider = http.server.ThreadingHTTPServer(("127.0.0.1", sms_port), SmsProvider)
        threading.Thread(target=provider.serve_forever, daemon=True).start()

        port = free_port()
        base = f"http://127.0.0.1:{port}"
        config = work / "fairlane.toml"
        config.write_text(f"""
[server]
listen = "127.0.0.1:{port}"
admin_token = "{ADMIN}"
instance = "check"
[storage]
url = "sqlite://{work / 'fairlane.db'}"
[lanes.slow]
concurrency = 8
high_water_mark = 400
visibility_timeout_secs = 60
max_receive_count = 5
[retry]
max_attempts = 3
base_delay_ms = 200
max_delay_secs = 2
[providers.email]
kind = "log"
rate_per_second = 120.0
burst = 20
log_path = "{work / 'emails.jsonl'}"
[providers.sms]
kind = "http"
base_url = "http://127.0.0.1:{sms_port}"
account_sid = "AC1"
auth_token = "check-token"
from = "+15550001111"
rate_per_second = 40.0
burst = 10
""")
        env = {k: v for k, v in os.environ.items() if not k.startswith("FAIRLANE")}
        env["RUST_LOG"] = "warn"
        with open(work / "fairlane.log", "w") as log:
            processes.append(subprocess.Popen([str(binary), "serve", "--config", str(config)],
                                              env=env, stdout=subprocess.DEVNULL, stderr=log))
        wait_until("fairlane", lambda: urllib.request.urlopen(f"{base}/readyz", timeout=2).status == 200)

        first_scrape = urllib.request.urlopen(f"{base}/metrics").read().decode()
        promtool = shutil.which("promtool")
        if promtool:
            lint = subprocess.run([promtool, "check", "metrics"], input=first_scrape, capture_output=True, text=True)
            print(f"promtool check metrics (first scrape): {(lint.stdout + lint.stderr).strip() or 'no findings'}")

        prometheus = shutil.which(args.prometheus_binary)
        prom = None
        if prometheus:
            prom_port = free_port()
            prom = f"http://127.0.0.1:{prom_port}"
            (work / "prometheus.yml").write_text(
                "global:\n  scrape_interval: 2s\n  evaluation_interval: 2s\n"
                "scrape_configs:\n  - job_name: fairlane\n    static_configs:\n"
                f"      - targets: ['127.0.0.1:{port}']\n")
            with open(work / "prometheus.log", "w") as log:
                processes.append(subprocess.Popen([
                    prometheus, f"--config.file={work / 'prometheus.yml'}",
                    f"--storage.tsdb.path={work / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}",
                    "--log.level=warn"], stdout=subprocess.DEVNULL, stderr=log))
            wait_until("prometheus", lambda: urllib.request.urlopen(f"{prom}/-/ready", timeout=2).status == 200)

        keys = set_up_tenants(base)
        start = time.time()
        counts = {}
        senders = [threading.Thread(target=load, args=(port, keys, args.seconds, counts)) for _ in range(args.threads)]
        for sender in senders:
            sender.start()
        time.sleep(args.seconds / 2)
        status, body = request(base, "POST", "/v1/admin/dlq/redrive", ADMIN, {})
        print(f"redrive half-way: {status} {body}")
        for sender in senders:
            sender.join()
        end = time.time()
        print(f"load: {args.seconds} s, answers by status {dict(sorted(counts.items()))}")
        time.sleep(6)  # two more scrapes

        if prom:
            evaluate(dashboard, prom, end - 2, failures)
            if args.png:
                render(dashboard, prom, start - 10, end + 5, args.png)
        else:
            text = urllib.request.urlopen(f"{base}/metrics").read().decode()
            evaluate_without_prometheus(dashboard, text, failures)
            if args.png:
                print("no Prometheus: no picture rendered")
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        shutil.rmtree(work, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--live", action="store_true", help="run fairlane and Prometheus and evaluate every query")
    parser.add_argument("--fairlane", default=str(ROOT / "target" / "release" / "fairlane"))
    parser.add_argument("--prometheus-binary", default="prometheus")
    parser.add_argument("--seconds", type=int, default=60, help="length of the load")
    parser.add_argument("--threads", type=int, default=4, help="sender threads, about 40 sends/s each")
    parser.add_argument("--png", help="render the panels to this file (needs matplotlib)")
    args = parser.parse_args()

    dashboard = json.loads(DASHBOARD.read_text())
    failures = Failures()
    check_model(dashboard, failures)
    print(f"model: {len(query_panels(dashboard))} query panels, "
          f"{sum(len(p['targets']) for p in query_panels(dashboard))} targets, "
          f"{'ok' if not failures.items else 'FAILED'}")
    if args.live and not failures.items:
        live(args, dashboard, failures)
    if failures.items:
        print(f"{len(failures.items)} failed")
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
