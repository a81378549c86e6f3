-- The status-event trigger's test moves into the trigger's WHEN clause,
-- which PostgreSQL evaluates without calling the PL/pgSQL function: a claim
-- (`sending`) and a receipt status then cost no function call at all. Only
-- the webhook test for `sent` (a subquery, which WHEN cannot hold) stays in
-- the function. Same rows as before (see migration 0003).
DROP TRIGGER message_status_event ON messages;

CREATE OR REPLACE FUNCTION fairlane_message_status_event() RETURNS trigger AS $$
BEGIN
    IF NEW.status <> 'sent' OR EXISTS (SELECT 1 FROM webhooks WHERE tenant_id = NEW.tenant_id) THEN
        INSERT INTO message_events (message_id, tenant_id, at, event, status, attempts, detail, provider_message_id)
        VALUES (NEW.id, NEW.tenant_id, NEW.updated_at, NEW.status, NEW.status, NEW.attempts,
                CASE WHEN NEW.status IN ('retrying', 'dead_lettered', 'suppressed', 'rejected') THEN NEW.last_error END,
                NEW.provider_message_id);
    END IF;
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER message_status_event AFTER UPDATE OF status ON messages
    FOR EACH ROW
    WHEN (NEW.status <> OLD.status
          AND NEW.status NOT IN ('sending', 'delivered', 'bounced', 'complained', 'failed'))
    EXECUTE FUNCTION fairlane_message_status_event();
