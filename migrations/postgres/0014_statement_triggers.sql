-- Status events and webhook calls written once per statement instead of
-- once per row (issue 27, item 2). The row triggers of migrations 0003,
-- 0006 and 0013 called a PL/pgSQL function for each changed message and
-- each event, and each call ran its own INSERT; the writers change
-- messages a group at a time (`UPDATE … FROM UNNEST`), so one statement
-- trigger now writes a whole group's events, and one the group's webhook
-- calls, from the statement's transition tables. Same rows as before.

-- A status change becomes an event (not `sending`, a moment; not the
-- receipt statuses, whose events the receipts write with their detail;
-- `sent` only for a tenant with a webhook, see migration 0003).
DROP TRIGGER message_status_event ON messages;
DROP FUNCTION fairlane_message_status_event();

CREATE FUNCTION fairlane_message_status_events() RETURNS trigger AS $$
BEGIN
    INSERT INTO message_events (message_id, tenant_id, at, event, status, attempts, detail, provider_message_id)
    SELECT n.id, n.tenant_id, n.updated_at, n.status, n.status, n.attempts,
           CASE WHEN n.status IN ('retrying', 'dead_lettered', 'suppressed', 'rejected') THEN n.last_error END,
           n.provider_message_id
      FROM status_after AS n
      JOIN status_before AS o ON o.id = n.id
     WHERE n.status <> o.status
       AND n.status NOT IN ('sending', 'delivered', 'bounced', 'complained', 'failed')
       AND (n.status <> 'sent' OR EXISTS (SELECT 1 FROM webhooks AS w WHERE w.tenant_id = n.tenant_id));
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;

-- PostgreSQL allows transition tables only on triggers without a column
-- list, so this fires for every update of messages; a statement that
-- changes no status (a claim, an erasure) inserts nothing.
CREATE TRIGGER message_status_events AFTER UPDATE ON messages
    REFERENCING OLD TABLE AS status_before NEW TABLE AS status_after
    FOR EACH STATEMENT EXECUTE FUNCTION fairlane_message_status_events();

-- A new event: its webhook call for a subscribed tenant, and a detail (a
-- provider's diagnostic may quote an address) unmarks an erased message.
DROP TRIGGER message_event_webhook ON message_events;
DROP FUNCTION fairlane_message_event_webhook();
DROP TRIGGER message_event_erasure_undone ON message_events;
DROP FUNCTION fairlane_event_erasure_undone();

CREATE FUNCTION fairlane_message_events_added() RETURNS trigger AS $$
BEGIN
    INSERT INTO webhook_deliveries (event_id, tenant_id, message_id, type, created_at, next_attempt_at, attempts, state)
    SELECT a.id, a.tenant_id, a.message_id, 'message.' || a.event, a.at, a.at, 0,
           CASE WHEN w.disabled_at IS NULL THEN 'pending' ELSE 'failed' END
      FROM events_added AS a
      JOIN webhooks AS w ON w.tenant_id = a.tenant_id
     WHERE position(' message.' || a.event || ' ' IN w.events) > 0;
    -- Only when there is a detail: an update of messages, even of no row,
    -- would run the statement triggers on messages.
    IF EXISTS (SELECT 1 FROM events_added WHERE detail IS NOT NULL) THEN
        UPDATE messages AS m SET erased_at = NULL
          FROM events_added AS a
         WHERE a.detail IS NOT NULL AND m.id = a.message_id AND m.erased_at IS NOT NULL;
    END IF;
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER message_events_added AFTER INSERT ON message_events
    REFERENCING NEW TABLE AS events_added
    FOR EACH STATEMENT EXECUTE FUNCTION fairlane_message_events_added();
