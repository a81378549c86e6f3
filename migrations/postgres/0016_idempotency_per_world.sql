-- Idempotency keys per world (issue 45): a test key's remembered answer
-- must never answer a live send with the same key, so the key is the
-- tenant's in one world. Rows already stored take the world of the
-- message they name.
ALTER TABLE idempotency_keys ADD COLUMN test BOOLEAN NOT NULL DEFAULT FALSE;
UPDATE idempotency_keys k SET test = TRUE
    FROM messages m WHERE m.id = k.message_id AND m.test;
ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_pkey;
ALTER TABLE idempotency_keys ADD PRIMARY KEY (tenant_id, test, key);
