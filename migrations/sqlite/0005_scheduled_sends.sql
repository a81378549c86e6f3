-- Scheduled sends: when a message is due (ms; NULL = at once). On the SQS
-- backend a scheduled message waits in the outbox until due, so the outbox
-- row carries the due time too (NULL: send now, sweep after the sweep age).
ALTER TABLE messages ADD COLUMN send_at INTEGER;
ALTER TABLE outbox ADD COLUMN due_at INTEGER;
CREATE INDEX outbox_due ON outbox(due_at) WHERE due_at IS NOT NULL;
-- Cancel by reference reads a tenant's messages by reference.
CREATE INDEX messages_tenant_reference ON messages(tenant_id, reference) WHERE reference IS NOT NULL;
