-- Webhook calls come from the event log (issue 45, item 4). Each endpoint
-- keeps a position in its tenant's events: every subscribed event up to it
-- has been delivered or has a row in `webhook_deliveries`, which now holds
-- only the calls that failed (their retries), the later events of their
-- messages (held behind them, so each message's events arrive in order) and
-- the calls given up. `read_*` is how far the instance holding the stream
-- (`stream_owner`, until `stream_until`) has read: the events between the
-- position and it are in flight. Another instance takes the stream once the
-- lease has ended and reads again from the position.
--
-- An event's id is taken when it is inserted, not when it commits, so a
-- position by id alone could pass an event still to commit. Each event
-- therefore carries its transaction's id (`xid`), and a stream reads in
-- (xid, id) order only the events of transactions older than every one
-- still running (the snapshot's xmin): none can commit behind the position.
ALTER TABLE message_events ADD COLUMN xid BIGINT NOT NULL DEFAULT 0;
ALTER TABLE message_events ALTER COLUMN xid SET DEFAULT (pg_current_xact_id()::text::bigint);
ALTER TABLE webhooks ADD COLUMN position_xid BIGINT NOT NULL DEFAULT 0;
ALTER TABLE webhooks ADD COLUMN position_id BIGINT NOT NULL DEFAULT 0;
ALTER TABLE webhooks ADD COLUMN read_xid BIGINT NOT NULL DEFAULT 0;
ALTER TABLE webhooks ADD COLUMN read_id BIGINT NOT NULL DEFAULT 0;
ALTER TABLE webhooks ADD COLUMN stream_owner TEXT;
ALTER TABLE webhooks ADD COLUMN stream_until BIGINT;
-- What existed before this migration is in `webhook_deliveries` already.
UPDATE webhooks SET position_id = (SELECT COALESCE(MAX(id), 0) FROM message_events),
                    read_id = (SELECT COALESCE(MAX(id), 0) FROM message_events);
-- A tenant's events in stream order.
CREATE INDEX message_events_tenant ON message_events(tenant_id, xid, id);
