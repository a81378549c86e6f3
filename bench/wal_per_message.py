#!/usr/bin/env python3
"""Write-ahead log bytes per message for the store's row layouts (issue 45, item 6).

A simulation on SQLite itself (Python's sqlite3, the same engine fairlane links),
not of fairlane: it replays the row writes one email makes on the embedded
default, in commits of GROUP messages (as the store writer groups them), with a
backlog of LAG messages between accept and delivery, and reports the log's bytes
per message (WAL mode, no automatic checkpoints, so the log holds every frame).

  python3 bench/wal_per_message.py [messages] [group] [lag]

Layouts:
- separate: the tables before issue 69.5: the status row (WITHOUT ROWID, UUIDv7 ids) with its
  list, retention and provider-id indexes, and the queue row with its two
  indexes; accept inserts both, delivery claims, records `sent` and deletes the
  queue row.
- merged: the queue's columns (queue, fair key, due time, receive count, body)
  on the status row, with the queue's two indexes as partial indexes on it;
  delivery clears them instead of deleting a row.
- separate, provider-id index of receipts without our id: today's since issue
  69.5: a `sent` marks the row `receipt_by_id` and the provider-id index is
  partial on rows without the mark (the messages sent before), so a `sent`
  no longer writes to it.
- separate without one index at a time, to see what each index costs.

Times are printed too but include Python's own cost per statement; compare the
bytes.
"""
import json
import os
import sqlite3
import sys
import tempfile
import time
import uuid

MESSAGES = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
GROUP = int(sys.argv[2]) if len(sys.argv) > 2 else 5
LAG = int(sys.argv[3]) if len(sys.argv) > 3 else 300
BODY = json.dumps({"to": "someone@example.com", "from": "noreply@example.com", "subject": "Your code",
                   "text": "Your sign-in code is 123456. It expires in ten minutes. " * 3})
QUEUE_COLUMNS = ", queue TEXT, fair_key INTEGER, visible_at INTEGER, receive_count INTEGER, body TEXT, enqueued_at INTEGER"


def open_store(path, merged, without, by_id=False):
    db = sqlite3.connect(path, isolation_level=None)
    for pragma in ("journal_mode=wal", "wal_autocheckpoint=0", "synchronous=normal", "secure_delete=on"):
        db.execute(f"PRAGMA {pragma}")
    db.execute("CREATE TABLE messages (id TEXT PRIMARY KEY, tenant_id TEXT NOT NULL, channel TEXT, status TEXT NOT NULL, "
               "priority TEXT, lane TEXT, attempts INTEGER, reference TEXT, metadata TEXT, created_at INTEGER, "
               "updated_at INTEGER, sent_at INTEGER, last_error TEXT, provider_message_id TEXT, send_at INTEGER, "
               "test INTEGER, recipient TEXT, erased_at INTEGER, provider TEXT, gate_wait_ms INTEGER, "
               "receipt_by_id INTEGER"
               f"{QUEUE_COLUMNS if merged else ''}) WITHOUT ROWID")
    indexes = {
        "list": "CREATE INDEX list ON messages(tenant_id, test, created_at, id)",
        "unerased": "CREATE INDEX unerased ON messages(tenant_id, created_at) WHERE erased_at IS NULL",
        "provider_id": "CREATE INDEX provider_id ON messages(provider_message_id) WHERE provider_message_id IS NOT NULL"
                       + (" AND receipt_by_id IS NULL" if by_id else ""),
    }
    if merged:
        indexes["queue_class"] = "CREATE INDEX queue_class ON messages(queue, priority, fair_key) WHERE queue IS NOT NULL"
        indexes["queue"] = "CREATE INDEX queue ON messages(queue, enqueued_at) WHERE queue IS NOT NULL"
    else:
        db.execute("CREATE TABLE queue_messages (seq INTEGER PRIMARY KEY, queue TEXT, message_id TEXT, tenant_id TEXT, "
                   "channel TEXT, priority TEXT, body TEXT, fair_key INTEGER, visible_at INTEGER, receive_count INTEGER, "
                   "enqueued_at INTEGER, last_error TEXT)")
        indexes["queue_class"] = "CREATE INDEX queue_class ON queue_messages(queue, priority, fair_key)"
        indexes["queue"] = "CREATE INDEX queue ON queue_messages(queue)"
    for name, sql in indexes.items():
        if name not in without:
            db.execute(sql)
    return db


def run(merged, without=(), by_id=False):
    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, "store.db")
        db = open_store(path, merged, set(without), by_id)
        ids, key = [], 0
        started = time.perf_counter()
        for _ in range(0, MESSAGES, GROUP):
            db.execute("BEGIN")
            for _ in range(GROUP):
                key += 1
                mid = f"{time.time_ns() + key:016x}{uuid.uuid4().hex[:16]}"
                ids.append(mid)
                row = (mid, "tenant-a", "email", "queued", "normal", "fast", 0, '{"a":1}', 1, 1, 0, "someone@example.com")
                if merged:
                    db.execute("INSERT INTO messages (id, tenant_id, channel, status, priority, lane, attempts, metadata, "
                               "created_at, updated_at, test, recipient, queue, fair_key, visible_at, receive_count, body, "
                               "enqueued_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                               row + ("fast", key, 1, 0, BODY, 1))
                else:
                    db.execute("INSERT INTO messages (id, tenant_id, channel, status, priority, lane, attempts, metadata, "
                               "created_at, updated_at, test, recipient) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", row)
                    db.execute("INSERT INTO queue_messages (queue, message_id, tenant_id, channel, priority, body, "
                               "fair_key, visible_at, receive_count, enqueued_at) VALUES (?,?,?,?,?,?,?,?,0,?)",
                               ("fast", mid, "tenant-a", "email", "normal", BODY, key, 1, 1))
            if len(ids) > LAG:
                for mid in ids[len(ids) - LAG - GROUP:len(ids) - LAG]:
                    db.execute("UPDATE messages SET status = 'sending', updated_at = 2 WHERE id = ? "
                               "AND status IN ('queued', 'retrying', 'scheduled')", (mid,))
                    db.execute("UPDATE messages SET status = 'sent', updated_at = 3, attempts = attempts + 1, sent_at = 3, "
                               "provider_message_id = ?, provider = 'log', gate_wait_ms = 0, "
                               f"receipt_by_id = {1 if by_id else 'NULL'} WHERE id = ?",
                               (f"log-{uuid.uuid4()}", mid))
                    if merged:
                        db.execute("UPDATE messages SET queue = NULL, body = NULL, fair_key = NULL, visible_at = NULL, "
                                   "receive_count = NULL, enqueued_at = NULL WHERE id = ?", (mid,))
                    else:
                        db.execute("DELETE FROM queue_messages WHERE seq = "
                                   "(SELECT seq FROM queue_messages WHERE queue = 'fast' ORDER BY seq LIMIT 1)")
            db.execute("COMMIT")
        elapsed = time.perf_counter() - started
        log_bytes = os.path.getsize(path + "-wal")
        db.close()
        return log_bytes / MESSAGES, elapsed / MESSAGES * 1e6


print(f"{MESSAGES} messages, {GROUP} per commit, {LAG} between accept and delivery")
for label, merged, without, by_id in [
        ("separate", False, (), False), ("merged", True, (), False),
        ("separate, provider-id index of receipts without our id", False, (), True),
        ("separate without the provider-id index", False, ("provider_id",), False),
        ("separate without the list index", False, ("list",), False),
        ("separate without the retention index", False, ("unerased",), False),
        ("separate without the queue's (queue) index", False, ("queue",), False)]:
    per_message, micros = run(merged, without, by_id)
    print(f"{label:56s} {per_message:8.0f} log bytes per message ({micros:.0f} µs per message with Python's own)")
