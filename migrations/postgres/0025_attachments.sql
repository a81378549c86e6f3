-- Email attachments (issue 48). A file is uploaded on its own, streamed
-- into `attachment_chunks` (at most 256 KiB a row), and finished with its
-- size and SHA-256; until then `sha256` is NULL and no send may name it.
-- A send claims its files (`message_id`): each file goes out with one
-- message, travels in no queue message (the queue carries its id), and is
-- erased with that message's personal data by retention. Files no send
-- claimed are erased a day after their upload.
CREATE TABLE attachments (
    id           TEXT PRIMARY KEY,
    tenant_id    TEXT NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
    test         BOOLEAN NOT NULL,
    filename     TEXT NOT NULL,
    content_type TEXT NOT NULL,
    size         BIGINT NOT NULL DEFAULT 0,
    sha256       TEXT,
    message_id   TEXT,
    created_at   BIGINT NOT NULL,
    claimed_at   BIGINT
);
CREATE INDEX attachments_message ON attachments(message_id) WHERE message_id IS NOT NULL;
CREATE INDEX attachments_unclaimed ON attachments(created_at) WHERE message_id IS NULL;
CREATE TABLE attachment_chunks (
    attachment_id TEXT NOT NULL REFERENCES attachments(id) ON DELETE CASCADE,
    seq           INTEGER NOT NULL,
    data          BYTEA NOT NULL,
    PRIMARY KEY (attachment_id, seq)
);
-- The bytes of the files a message carries, counted in usage with its
-- accept.
ALTER TABLE messages ADD COLUMN attachment_bytes BIGINT;
ALTER TABLE usage ADD COLUMN attachment_bytes BIGINT NOT NULL DEFAULT 0;
ALTER TABLE usage_deltas ADD COLUMN attachment_bytes BIGINT NOT NULL DEFAULT 0;
