-- Receipts, a status history per message, tenant webhooks and suppression
-- lists (issue 12).
--
-- Every status change of a message is an event. The delivery path's
-- changes (sent, retrying, dead_lettered, cancelled, suppressed, queued
-- again by a redrive, …) are recorded by the trigger below, so no writer of
-- either store can change a status without its event. Receipts (delivered,
-- bounced, complained, failed, and provider updates that change no status)
-- insert their own events, with the provider's detail. `sending` is a
-- moment, not an event: it is not recorded. The accept itself is not
-- recorded either: the message row's `created_at` is that event.
-- The id is the rowid (no AUTOINCREMENT, whose bookkeeping row would be
-- written with every event on the delivery path): it only grows while the
-- table's last row stays, and events are deleted only with their tenant.
CREATE TABLE message_events (
    id                  INTEGER PRIMARY KEY,
    message_id          TEXT NOT NULL,
    tenant_id           TEXT NOT NULL,
    at                  INTEGER NOT NULL,
    -- The status word for a status change, or a provider update's name
    -- (`provider_sent`, `transient_bounce`, `delivery_delayed`, …).
    event               TEXT NOT NULL,
    -- The message's status after the event, and its attempts then.
    status              TEXT NOT NULL,
    attempts            INTEGER NOT NULL,
    detail              TEXT,
    provider_message_id TEXT
);
CREATE INDEX message_events_message ON message_events(message_id, id);

-- `sent` happens to every delivered message once, and the message row keeps
-- its time and provider id: it is written as an event only for a tenant with
-- a webhook (whose call needs the event row), and otherwise read from the
-- message row when the history is listed. That keeps one insert per message
-- off the delivery path.
CREATE TRIGGER message_status_event AFTER UPDATE OF status ON messages
WHEN NEW.status <> OLD.status
 AND NEW.status NOT IN ('sending', 'delivered', 'bounced', 'complained', 'failed')
 AND (NEW.status <> 'sent' OR EXISTS (SELECT 1 FROM webhooks WHERE tenant_id = NEW.tenant_id))
BEGIN
    INSERT INTO message_events (message_id, tenant_id, at, event, status, attempts, detail, provider_message_id)
    VALUES (NEW.id, NEW.tenant_id, NEW.updated_at, NEW.status, NEW.status, NEW.attempts,
            CASE WHEN NEW.status IN ('retrying', 'dead_lettered', 'suppressed', 'rejected') THEN NEW.last_error END,
            NEW.provider_message_id);
END;

-- Receipts find their message by the provider's id.
CREATE INDEX messages_provider_id ON messages(provider_message_id) WHERE provider_message_id IS NOT NULL;

-- A tenant's webhook endpoint. The secret signs (it cannot be hashed);
-- `events` is the subscribed types, space-separated with a space at each
-- end (' message.sent message.delivered '), so one `instr` finds a type.
CREATE TABLE webhooks (
    tenant_id       TEXT PRIMARY KEY REFERENCES tenants(id) ON DELETE CASCADE,
    url             TEXT NOT NULL,
    events          TEXT NOT NULL,
    secret          TEXT NOT NULL,
    -- After a rotation the old secret signs too, until `previous_until`.
    previous_secret TEXT,
    previous_until  INTEGER,
    -- First failure of the current run of failures; NULL after a success.
    failing_since   INTEGER,
    last_error      TEXT,
    -- Set when the endpoint failed for `webhooks.disable_after_secs`: its
    -- events are kept as `failed` until an admin redrives them.
    disabled_at     INTEGER,
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL
);

-- Webhook calls to make: one per event of a subscribed type, written in the
-- event's transaction (so none is lost), deleted once the endpoint took it.
CREATE TABLE webhook_deliveries (
    -- The event's id; `webhook-id` is `evt_{event_id}` on every attempt.
    event_id        INTEGER PRIMARY KEY,
    tenant_id       TEXT NOT NULL,
    message_id      TEXT NOT NULL,
    type            TEXT NOT NULL,
    created_at      INTEGER NOT NULL,
    next_attempt_at INTEGER NOT NULL,
    attempts        INTEGER NOT NULL DEFAULT 0,
    -- 'pending' (to be sent) or 'failed' (given up, or the endpoint is disabled).
    state           TEXT NOT NULL,
    last_error      TEXT
);
CREATE INDEX webhook_deliveries_due ON webhook_deliveries(tenant_id, next_attempt_at) WHERE state = 'pending';
CREATE INDEX webhook_deliveries_message ON webhook_deliveries(message_id, event_id);

CREATE TRIGGER message_event_webhook AFTER INSERT ON message_events
BEGIN
    INSERT INTO webhook_deliveries (event_id, tenant_id, message_id, type, created_at, next_attempt_at, attempts, state)
    SELECT NEW.id, NEW.tenant_id, NEW.message_id, 'message.' || NEW.event, NEW.at, NEW.at, 0,
           CASE WHEN w.disabled_at IS NULL THEN 'pending' ELSE 'failed' END
      FROM webhooks AS w
     WHERE w.tenant_id = NEW.tenant_id AND instr(w.events, ' message.' || NEW.event || ' ') > 0;
END;

-- Addresses a tenant must not send to: hard bounces, complaints, and what
-- the tenant or an admin added. Addresses are stored normalised (emails in
-- lower case, numbers in E.164).
CREATE TABLE suppressions (
    tenant_id  TEXT NOT NULL,
    address    TEXT NOT NULL,
    channel    TEXT NOT NULL,
    -- 'bounce', 'complaint' or 'manual'.
    reason     TEXT NOT NULL,
    detail     TEXT,
    message_id TEXT,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (tenant_id, address)
);

-- Receipts whose message was not found yet (the provider's answer can beat
-- fairlane's record of its id): matched again until `receipts.match_for_secs`.
CREATE TABLE pending_receipts (
    id                  INTEGER PRIMARY KEY,
    provider            TEXT NOT NULL,
    provider_message_id TEXT NOT NULL,
    receipt             TEXT NOT NULL,
    received_at         INTEGER NOT NULL,
    next_try_at         INTEGER NOT NULL,
    tries               INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX pending_receipts_due ON pending_receipts(next_try_at);
