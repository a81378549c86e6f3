-- Idempotency keys per world (issue 45): a test key's remembered answer
-- must never answer a live send with the same key, so the key is the
-- tenant's in one world. Rows already stored take the world of the
-- message they name.
CREATE TABLE idempotency_keys_by_world (
    tenant_id     TEXT NOT NULL,
    test          INTEGER NOT NULL DEFAULT 0,
    key           TEXT NOT NULL,
    -- SHA-256 of the canonical JSON request body.
    request_hash  TEXT NOT NULL,
    status_code   INTEGER NOT NULL,
    response_body TEXT NOT NULL,
    message_id    TEXT NOT NULL,
    created_at    INTEGER NOT NULL,
    PRIMARY KEY (tenant_id, test, key)
);
INSERT INTO idempotency_keys_by_world
    (tenant_id, test, key, request_hash, status_code, response_body, message_id, created_at)
SELECT k.tenant_id,
       COALESCE((SELECT m.test FROM messages m WHERE m.id = k.message_id), 0),
       k.key, k.request_hash, k.status_code, k.response_body, k.message_id, k.created_at
FROM idempotency_keys k;
DROP TABLE idempotency_keys;
ALTER TABLE idempotency_keys_by_world RENAME TO idempotency_keys;
CREATE INDEX idempotency_created ON idempotency_keys(created_at);
