-- fairlane schema for PostgreSQL: the same tables and columns as the SQLite
-- schema (migrations/sqlite), so the same SQL text runs on both. Times are
-- milliseconds since the Unix epoch (BIGINT); every integer is BIGINT so it
-- reads back as the i64 the SQLite side gives.
--
-- The embedded queue's table is not here: with a PostgreSQL store the lanes
-- are SQS queues (queue.backend = "sqs").

CREATE TABLE settings (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);

CREATE TABLE plans (
    name            TEXT PRIMARY KEY,
    lane            TEXT NOT NULL,
    rate_per_second DOUBLE PRECISION NOT NULL,
    burst           BIGINT NOT NULL,
    daily_quota     BIGINT NOT NULL,
    max_in_flight   BIGINT NOT NULL,
    -- 'config' rows are refreshed from the configuration at start-up;
    -- 'admin' rows were written through the API and are left alone.
    source          TEXT NOT NULL,
    updated_at      BIGINT NOT NULL
);

CREATE TABLE tenants (
    id         TEXT PRIMARY KEY,
    name       TEXT NOT NULL,
    plan       TEXT NOT NULL REFERENCES plans(name),
    status     TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL
);

CREATE TABLE api_keys (
    id          TEXT PRIMARY KEY,
    tenant_id   TEXT NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
    -- SHA-256 of the secret part, hex. The key itself is never stored.
    secret_hash TEXT NOT NULL,
    created_at  BIGINT NOT NULL,
    revoked_at  BIGINT
);
CREATE INDEX api_keys_tenant ON api_keys(tenant_id);

CREATE TABLE messages (
    id                  TEXT PRIMARY KEY,
    tenant_id           TEXT NOT NULL,
    channel             TEXT NOT NULL,
    status              TEXT NOT NULL,
    priority            TEXT NOT NULL,
    lane                TEXT NOT NULL,
    attempts            BIGINT NOT NULL DEFAULT 0,
    reference           TEXT,
    metadata            TEXT,
    created_at          BIGINT NOT NULL,
    updated_at          BIGINT NOT NULL,
    sent_at             BIGINT,
    last_error          TEXT,
    provider_message_id TEXT
);
CREATE INDEX messages_tenant_created ON messages(tenant_id, created_at);
-- The oldest pending message of a lane (SQS has no such attribute).
CREATE INDEX messages_pending ON messages(lane, created_at)
    WHERE status IN ('queued', 'sending', 'retrying');

CREATE TABLE idempotency_keys (
    tenant_id     TEXT NOT NULL,
    key           TEXT NOT NULL,
    -- SHA-256 of the canonical JSON request body.
    request_hash  TEXT NOT NULL,
    status_code   BIGINT NOT NULL,
    response_body TEXT NOT NULL,
    message_id    TEXT NOT NULL,
    created_at    BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, key)
);
CREATE INDEX idempotency_created ON idempotency_keys(created_at);

-- The outbox: a row is written in the same transaction as the message's
-- status row and removed once SQS has the message. With several instances,
-- a sweeper claims old rows with FOR UPDATE SKIP LOCKED, so two instances
-- never re-send the same row.
CREATE TABLE outbox (
    message_id TEXT PRIMARY KEY,
    lane       TEXT NOT NULL,
    tenant_id  TEXT NOT NULL,
    channel    TEXT NOT NULL,
    priority   TEXT NOT NULL,
    body       TEXT NOT NULL,
    created_at BIGINT NOT NULL
);
CREATE INDEX outbox_created ON outbox(created_at);
