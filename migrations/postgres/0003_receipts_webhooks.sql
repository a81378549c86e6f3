-- Receipts, a status history per message, tenant webhooks and suppression
-- lists (issue 12). Table for table the SQLite migration 0006; see its
-- comments. The triggers do the same work in PL/pgSQL.
CREATE TABLE message_events (
    id                  BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id          TEXT NOT NULL,
    tenant_id           TEXT NOT NULL,
    at                  BIGINT NOT NULL,
    event               TEXT NOT NULL,
    status              TEXT NOT NULL,
    attempts            BIGINT NOT NULL,
    detail              TEXT,
    provider_message_id TEXT
);
CREATE INDEX message_events_message ON message_events(message_id, id);

CREATE FUNCTION fairlane_message_status_event() RETURNS trigger AS $$
BEGIN
    IF NEW.status <> OLD.status
       AND NEW.status NOT IN ('sending', 'delivered', 'bounced', 'complained', 'failed')
       AND (NEW.status <> 'sent' OR EXISTS (SELECT 1 FROM webhooks WHERE tenant_id = NEW.tenant_id)) THEN
        INSERT INTO message_events (message_id, tenant_id, at, event, status, attempts, detail, provider_message_id)
        VALUES (NEW.id, NEW.tenant_id, NEW.updated_at, NEW.status, NEW.status, NEW.attempts,
                CASE WHEN NEW.status IN ('retrying', 'dead_lettered', 'suppressed', 'rejected') THEN NEW.last_error END,
                NEW.provider_message_id);
    END IF;
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER message_status_event AFTER UPDATE OF status ON messages
    FOR EACH ROW EXECUTE FUNCTION fairlane_message_status_event();

CREATE INDEX messages_provider_id ON messages(provider_message_id) WHERE provider_message_id IS NOT NULL;

CREATE TABLE webhooks (
    tenant_id       TEXT PRIMARY KEY REFERENCES tenants(id) ON DELETE CASCADE,
    url             TEXT NOT NULL,
    events          TEXT NOT NULL,
    secret          TEXT NOT NULL,
    previous_secret TEXT,
    previous_until  BIGINT,
    failing_since   BIGINT,
    last_error      TEXT,
    disabled_at     BIGINT,
    created_at      BIGINT NOT NULL,
    updated_at      BIGINT NOT NULL
);

CREATE TABLE webhook_deliveries (
    event_id        BIGINT PRIMARY KEY,
    tenant_id       TEXT NOT NULL,
    message_id      TEXT NOT NULL,
    type            TEXT NOT NULL,
    created_at      BIGINT NOT NULL,
    next_attempt_at BIGINT NOT NULL,
    attempts        BIGINT NOT NULL DEFAULT 0,
    state           TEXT NOT NULL,
    last_error      TEXT
);
CREATE INDEX webhook_deliveries_due ON webhook_deliveries(tenant_id, next_attempt_at) WHERE state = 'pending';
CREATE INDEX webhook_deliveries_message ON webhook_deliveries(message_id, event_id);

CREATE FUNCTION fairlane_message_event_webhook() RETURNS trigger AS $$
BEGIN
    INSERT INTO webhook_deliveries (event_id, tenant_id, message_id, type, created_at, next_attempt_at, attempts, state)
    SELECT NEW.id, NEW.tenant_id, NEW.message_id, 'message.' || NEW.event, NEW.at, NEW.at, 0,
           CASE WHEN w.disabled_at IS NULL THEN 'pending' ELSE 'failed' END
      FROM webhooks AS w
     WHERE w.tenant_id = NEW.tenant_id AND position(' message.' || NEW.event || ' ' IN w.events) > 0;
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER message_event_webhook AFTER INSERT ON message_events
    FOR EACH ROW EXECUTE FUNCTION fairlane_message_event_webhook();

CREATE TABLE suppressions (
    tenant_id  TEXT NOT NULL,
    address    TEXT NOT NULL,
    channel    TEXT NOT NULL,
    reason     TEXT NOT NULL,
    detail     TEXT,
    message_id TEXT,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, address)
);

CREATE TABLE pending_receipts (
    id                  BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    provider            TEXT NOT NULL,
    provider_message_id TEXT NOT NULL,
    receipt             TEXT NOT NULL,
    received_at         BIGINT NOT NULL,
    next_try_at         BIGINT NOT NULL,
    tries               BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX pending_receipts_due ON pending_receipts(next_try_at);
