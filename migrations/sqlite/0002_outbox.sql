-- SQS mode: the outbox. A row is written in the same transaction as the
-- message's status row and removed once SQS has the message (or the send
-- failed and the message was marked 'rejected'). A row left behind means the
-- process died between the two; the sweeper sends it again.
CREATE TABLE outbox (
    message_id TEXT PRIMARY KEY,
    lane       TEXT NOT NULL,
    tenant_id  TEXT NOT NULL,
    channel    TEXT NOT NULL,
    priority   TEXT NOT NULL,
    body       TEXT NOT NULL,
    created_at INTEGER NOT NULL
);
