-- Retention and usage (issue 29).
--
-- A tenant's retention in days; NULL follows the configuration's
-- `retention.default_days`.
ALTER TABLE tenants ADD COLUMN retention_days INTEGER;

-- When the retention job erased the message's personal data (reference,
-- metadata, errors, event details, queued bodies). The partial index holds
-- the messages it has still to look at, oldest first per tenant.
ALTER TABLE messages ADD COLUMN erased_at INTEGER;
CREATE INDEX messages_unerased ON messages(tenant_id, created_at) WHERE erased_at IS NULL;

-- Something personal written about an erased message (a late receipt's
-- error, an event's detail) makes it unerased again: the next run erases
-- it too.
CREATE TRIGGER message_erasure_undone AFTER UPDATE OF last_error ON messages
WHEN OLD.erased_at IS NOT NULL AND NEW.erased_at IS NOT NULL AND NEW.last_error IS NOT NULL
BEGIN
    UPDATE messages SET erased_at = NULL WHERE id = NEW.id;
END;

CREATE TRIGGER message_event_erasure_undone AFTER INSERT ON message_events
WHEN NEW.detail IS NOT NULL
BEGIN
    UPDATE messages SET erased_at = NULL WHERE id = NEW.message_id AND erased_at IS NOT NULL;
END;

-- Usage per tenant, UTC day (days since 1970-01-01), channel and key kind.
-- Each counter counts the messages that reached that state on that day;
-- `fragments` are the SMS fragments of the messages counted in `sent`.
-- These rows are kept apart from the messages so retention never changes
-- them; deleting the tenant removes them.
CREATE TABLE usage (
    tenant_id     TEXT NOT NULL,
    day           INTEGER NOT NULL,
    channel       TEXT NOT NULL,
    test          INTEGER NOT NULL,
    accepted      INTEGER NOT NULL DEFAULT 0,
    sent          INTEGER NOT NULL DEFAULT 0,
    delivered     INTEGER NOT NULL DEFAULT 0,
    bounced       INTEGER NOT NULL DEFAULT 0,
    complained    INTEGER NOT NULL DEFAULT 0,
    failed        INTEGER NOT NULL DEFAULT 0,
    dead_lettered INTEGER NOT NULL DEFAULT 0,
    suppressed    INTEGER NOT NULL DEFAULT 0,
    cancelled     INTEGER NOT NULL DEFAULT 0,
    rejected      INTEGER NOT NULL DEFAULT 0,
    fragments     INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant_id, day, channel, test)
) WITHOUT ROWID;
CREATE INDEX usage_day ON usage(day);

-- One writer holds the file, so the counts are kept in place.
CREATE TRIGGER usage_accepted AFTER INSERT ON messages
BEGIN
    INSERT INTO usage (tenant_id, day, channel, test, accepted)
    VALUES (NEW.tenant_id, NEW.created_at / 86400000, NEW.channel, NEW.test, 1)
    ON CONFLICT (tenant_id, day, channel, test) DO UPDATE SET accepted = accepted + 1;
END;

CREATE TRIGGER usage_outcome AFTER UPDATE OF status ON messages
WHEN NEW.status <> OLD.status
 AND NEW.status IN ('sent', 'delivered', 'bounced', 'complained', 'failed', 'dead_lettered',
                    'suppressed', 'cancelled', 'rejected')
BEGIN
    INSERT INTO usage (tenant_id, day, channel, test, sent, delivered, bounced, complained,
                       failed, dead_lettered, suppressed, cancelled, rejected, fragments)
    VALUES (NEW.tenant_id, NEW.updated_at / 86400000, NEW.channel, NEW.test,
            NEW.status = 'sent', NEW.status = 'delivered', NEW.status = 'bounced',
            NEW.status = 'complained', NEW.status = 'failed', NEW.status = 'dead_lettered',
            NEW.status = 'suppressed', NEW.status = 'cancelled', NEW.status = 'rejected',
            CASE WHEN NEW.status = 'sent' THEN coalesce(NEW.fragments, 0) ELSE 0 END)
    ON CONFLICT (tenant_id, day, channel, test) DO UPDATE SET
        sent = sent + excluded.sent,
        delivered = delivered + excluded.delivered,
        bounced = bounced + excluded.bounced,
        complained = complained + excluded.complained,
        failed = failed + excluded.failed,
        dead_lettered = dead_lettered + excluded.dead_lettered,
        suppressed = suppressed + excluded.suppressed,
        cancelled = cancelled + excluded.cancelled,
        rejected = rejected + excluded.rejected,
        fragments = fragments + excluded.fragments;
END;
