-- fairlane schema. Times are milliseconds since the Unix epoch.

CREATE TABLE settings (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);

CREATE TABLE plans (
    name            TEXT PRIMARY KEY,
    lane            TEXT NOT NULL,
    rate_per_second REAL NOT NULL,
    burst           INTEGER NOT NULL,
    daily_quota     INTEGER NOT NULL,
    max_in_flight   INTEGER NOT NULL,
    -- 'config' rows are refreshed from the configuration at start-up;
    -- 'admin' rows were written through the API and are left alone.
    source          TEXT NOT NULL,
    updated_at      INTEGER NOT NULL
);

CREATE TABLE tenants (
    id         TEXT PRIMARY KEY,
    name       TEXT NOT NULL,
    plan       TEXT NOT NULL REFERENCES plans(name),
    status     TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL
);

CREATE TABLE api_keys (
    id          TEXT PRIMARY KEY,
    tenant_id   TEXT NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
    -- SHA-256 of the secret part, hex. The key itself is never stored.
    secret_hash TEXT NOT NULL,
    created_at  INTEGER NOT NULL,
    revoked_at  INTEGER
);
CREATE INDEX api_keys_tenant ON api_keys(tenant_id);

CREATE TABLE messages (
    id                  TEXT PRIMARY KEY,
    tenant_id           TEXT NOT NULL,
    channel             TEXT NOT NULL,
    status              TEXT NOT NULL,
    priority            TEXT NOT NULL,
    lane                TEXT NOT NULL,
    attempts            INTEGER NOT NULL DEFAULT 0,
    reference           TEXT,
    metadata            TEXT,
    created_at          INTEGER NOT NULL,
    updated_at          INTEGER NOT NULL,
    sent_at             INTEGER,
    last_error          TEXT,
    provider_message_id TEXT
) WITHOUT ROWID; -- ids are UUIDv7 (time-ordered): the key is the clustering order
CREATE INDEX messages_tenant_created ON messages(tenant_id, created_at);

CREATE TABLE idempotency_keys (
    tenant_id     TEXT NOT NULL,
    key           TEXT NOT NULL,
    -- SHA-256 of the canonical JSON request body.
    request_hash  TEXT NOT NULL,
    status_code   INTEGER NOT NULL,
    response_body TEXT NOT NULL,
    message_id    TEXT NOT NULL,
    created_at    INTEGER NOT NULL,
    PRIMARY KEY (tenant_id, key)
);
CREATE INDEX idempotency_created ON idempotency_keys(created_at);

-- The embedded queue: one row per queued copy of a message.
CREATE TABLE queue_messages (
    seq           INTEGER PRIMARY KEY AUTOINCREMENT,
    queue         TEXT NOT NULL,
    message_id    TEXT NOT NULL,
    tenant_id     TEXT NOT NULL,
    channel       TEXT NOT NULL,
    priority      TEXT NOT NULL,
    body          TEXT NOT NULL,
    -- Virtual finish time for fair dequeue across tenants (smaller first).
    fair_key      INTEGER NOT NULL,
    -- Not receivable before this instant (delay or visibility timeout).
    visible_at    INTEGER NOT NULL,
    receive_count INTEGER NOT NULL DEFAULT 0,
    enqueued_at   INTEGER NOT NULL,
    last_error    TEXT
);
CREATE INDEX queue_messages_fair ON queue_messages(queue, fair_key);
CREATE INDEX queue_messages_visible ON queue_messages(queue, visible_at);
