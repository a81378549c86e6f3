-- The dispatcher takes a tenant's due calls in (next_attempt_at, event_id)
-- order, a few at a time. With event_id in the index that order is the
-- index's own, so a LIMIT stops after the calls it takes. Without it
-- PostgreSQL read every due row and sorted them when its statistics said
-- the table was small (a table that had just filled up): 39 ms for 32 calls
-- out of 18,000, on every pass. (SQLite's index ends with the rowid, which
-- is event_id, so it already had this order.)
CREATE INDEX webhook_deliveries_due_order
    ON webhook_deliveries (tenant_id, next_attempt_at, event_id) WHERE state = 'pending';
DROP INDEX webhook_deliveries_due;
