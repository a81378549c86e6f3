-- Webhook calls come from the event log (issue 45, item 4). Each endpoint
-- keeps a position in its tenant's events: every subscribed event up to it
-- has been delivered or has a row in `webhook_deliveries`, which now holds
-- only the calls that failed (their retries), the later events of their
-- messages (held behind them, so each message's events arrive in order) and
-- the calls given up. `read_id` is how far the instance holding the
-- stream (`stream_owner`, until `stream_until`) has read: the events
-- between the position and it are in flight. Another instance takes the
-- stream once the lease has ended and reads again from the position.
--
-- Positions are (xid, id) as on PostgreSQL, where an event's transaction
-- id orders what ids alone cannot; here one writer commits events in id
-- order, so every xid is 0 and the id alone orders the stream.
ALTER TABLE message_events ADD COLUMN xid INTEGER NOT NULL DEFAULT 0;
ALTER TABLE webhooks ADD COLUMN position_xid INTEGER NOT NULL DEFAULT 0;
ALTER TABLE webhooks ADD COLUMN position_id INTEGER NOT NULL DEFAULT 0;
ALTER TABLE webhooks ADD COLUMN read_xid INTEGER NOT NULL DEFAULT 0;
ALTER TABLE webhooks ADD COLUMN read_id INTEGER NOT NULL DEFAULT 0;
ALTER TABLE webhooks ADD COLUMN stream_owner TEXT;
ALTER TABLE webhooks ADD COLUMN stream_until INTEGER;
-- What existed before this migration is in `webhook_deliveries` already.
UPDATE webhooks SET position_id = (SELECT COALESCE(MAX(id), 0) FROM message_events),
                    read_id = (SELECT COALESCE(MAX(id), 0) FROM message_events);
-- A tenant's events in order, for its endpoint's stream.
CREATE INDEX message_events_tenant ON message_events(tenant_id, xid, id);
