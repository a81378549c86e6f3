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

-- One writer holds the file, so the counts are kept in place. The two
-- counts every message makes, `accepted` (the insert) and `sent` (with its
-- fragments), are summed by the store writer over each group and written
-- once per tenant, day, channel and kind before the group commits
-- (`crate::store::usage::Pending`): a trigger would cost each message an
-- upsert.
--
-- The rarer outcomes are counted by a trigger that the two writes every
-- message makes (`sending`, `sent`) do not fire: SQLite runs a trigger's
-- sub-program for every row a statement names its columns for, even when
-- its WHEN is false, which cost each message several microseconds of the
-- one writer. Every other write of a status on SQLite (failures, dead
-- letters, suppressions, cancels, receipts) also sets `erased_at = NULL`:
-- the trigger fires on that column, and a message changed after its
-- erasure is looked at again by the next retention run (a late receipt may
-- bring an address back).
CREATE TRIGGER usage_outcome AFTER UPDATE OF erased_at ON messages
WHEN NEW.status <> OLD.status
 AND NEW.status IN ('delivered', 'bounced', 'complained', 'failed', 'dead_lettered',
                    'suppressed', 'cancelled', 'rejected')
BEGIN
    INSERT INTO usage (tenant_id, day, channel, test, delivered, bounced, complained,
                       failed, dead_lettered, suppressed, cancelled, rejected)
    VALUES (NEW.tenant_id, NEW.updated_at / 86400000, NEW.channel, NEW.test,
            NEW.status = 'delivered', NEW.status = 'bounced', NEW.status = 'complained',
            NEW.status = 'failed', NEW.status = 'dead_lettered', NEW.status = 'suppressed',
            NEW.status = 'cancelled', NEW.status = 'rejected')
    ON CONFLICT (tenant_id, day, channel, test) DO UPDATE SET
        delivered = delivered + excluded.delivered,
        bounced = bounced + excluded.bounced,
        complained = complained + excluded.complained,
        failed = failed + excluded.failed,
        dead_lettered = dead_lettered + excluded.dead_lettered,
        suppressed = suppressed + excluded.suppressed,
        cancelled = cancelled + excluded.cancelled,
        rejected = rejected + excluded.rejected;
END;

-- A new event: one trigger makes its webhook call (as
-- `message_event_webhook` did, migration 0006) and, when the event carries
-- a detail (a receipt that changes no status may still quote an address),
-- unerases its message.
DROP TRIGGER message_event_webhook;
CREATE TRIGGER message_event_added AFTER INSERT ON message_events
BEGIN
    INSERT INTO webhook_deliveries (event_id, tenant_id, message_id, type, created_at, next_attempt_at, attempts, state)
    SELECT NEW.id, NEW.tenant_id, NEW.message_id, 'message.' || NEW.event, NEW.at, NEW.at, 0,
           CASE WHEN w.disabled_at IS NULL THEN 'pending' ELSE 'failed' END
      FROM webhooks AS w
     WHERE w.tenant_id = NEW.tenant_id AND instr(w.events, ' message.' || NEW.event || ' ') > 0;

    UPDATE messages SET erased_at = NULL
     WHERE id = NEW.message_id AND NEW.detail IS NOT NULL AND erased_at IS NOT NULL;
END;
