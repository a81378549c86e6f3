#!/usr/bin/env python3
"""Fills a tenant's messages through the batch API, for bench/message_list.sh.

    python3 bench/fill_list.py BASE_URL KEY COUNT

Sends COUNT messages in batches of 1,000 (POST /v1/messages/batch) on two
connections (a tenant's `server.max_batches_per_tenant`): one in three an
email, the rest SMS, reference `ref-<n mod 1000>` (so each of the thousand
references has COUNT/1000 messages). Prints one line: the number accepted,
the seconds taken, and the creation time (ms since the epoch) of the
middle batch, which the script uses for its cursor and its time window.
Exits non-zero at the first batch with a refused message.
"""

import http.client
import json
import sys
import threading
import time
import urllib.parse

BATCH = 1000


def main():
    base, key, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    url = urllib.parse.urlparse(base)
    batches = list(range(0, count, BATCH))
    middle = batches[len(batches) // 2]
    marks = {}
    failures = []
    lock = threading.Lock()
    cursor = iter(batches)

    def worker():
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        while not failures:
            with lock:
                start = next(cursor, None)
            if start is None:
                return
            messages = []
            for n in range(start, min(start + BATCH, count)):
                if n % 3 == 0:
                    body = {"channel": "email", "to": f"user{n}@example.com",
                            "subject": "Your receipt", "text": f"Receipt {n}"}
                else:
                    body = {"channel": "sms", "to": "+15551234567", "text": f"Code {n}"}
                body["reference"] = f"ref-{n % 1000}"
                messages.append(body)
            if start == middle:
                marks["middle"] = int(time.time() * 1000)
            conn.request("POST", "/v1/messages/batch", json.dumps({"messages": messages}),
                         {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
            answer = conn.getresponse()
            text = answer.read()
            refused = json.loads(text).get("refused") if answer.status == 200 else None
            if refused != 0:
                failures.append(f"batch at {start}: {answer.status} {text[:300]!r}")
                return

    started = time.time()
    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        sys.exit(failures[0])
    print(count, round(time.time() - started, 1), marks["middle"])


if __name__ == "__main__":
    main()
