-- Retention and usage (issue 29). Column for column the SQLite migration
-- 0014; see its comments. What differs is how usage is counted: several
-- instances write messages at once, and counters kept in place would make
-- their transactions queue on (and deadlock over) the same usage rows. So
-- each statement that changes messages appends its counts to
-- `usage_deltas` (no row is shared), and the usage roll-up (one instance at
-- a time) folds them into `usage`. Reads add both.
ALTER TABLE tenants ADD COLUMN retention_days BIGINT;

ALTER TABLE messages ADD COLUMN erased_at BIGINT;
CREATE INDEX messages_unerased ON messages(tenant_id, created_at) WHERE erased_at IS NULL;

CREATE FUNCTION fairlane_message_erasure_undone() RETURNS trigger AS $$
BEGIN
    NEW.erased_at := NULL;
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER message_erasure_undone BEFORE UPDATE OF last_error ON messages
    FOR EACH ROW
    WHEN (OLD.erased_at IS NOT NULL AND NEW.erased_at IS NOT NULL AND NEW.last_error IS NOT NULL)
    EXECUTE FUNCTION fairlane_message_erasure_undone();

CREATE FUNCTION fairlane_event_erasure_undone() RETURNS trigger AS $$
BEGIN
    UPDATE messages SET erased_at = NULL WHERE id = NEW.message_id AND erased_at IS NOT NULL;
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER message_event_erasure_undone AFTER INSERT ON message_events
    FOR EACH ROW WHEN (NEW.detail IS NOT NULL)
    EXECUTE FUNCTION fairlane_event_erasure_undone();

CREATE TABLE usage (
    tenant_id     TEXT NOT NULL,
    day           BIGINT NOT NULL,
    channel       TEXT NOT NULL,
    test          BOOLEAN NOT NULL,
    accepted      BIGINT NOT NULL DEFAULT 0,
    sent          BIGINT NOT NULL DEFAULT 0,
    delivered     BIGINT NOT NULL DEFAULT 0,
    bounced       BIGINT NOT NULL DEFAULT 0,
    complained    BIGINT NOT NULL DEFAULT 0,
    failed        BIGINT NOT NULL DEFAULT 0,
    dead_lettered BIGINT NOT NULL DEFAULT 0,
    suppressed    BIGINT NOT NULL DEFAULT 0,
    cancelled     BIGINT NOT NULL DEFAULT 0,
    rejected      BIGINT NOT NULL DEFAULT 0,
    fragments     BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant_id, day, channel, test)
);
CREATE INDEX usage_day ON usage(day);

CREATE TABLE usage_deltas (
    id            BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id     TEXT NOT NULL,
    day           BIGINT NOT NULL,
    channel       TEXT NOT NULL,
    test          BOOLEAN NOT NULL,
    accepted      BIGINT NOT NULL DEFAULT 0,
    sent          BIGINT NOT NULL DEFAULT 0,
    delivered     BIGINT NOT NULL DEFAULT 0,
    bounced       BIGINT NOT NULL DEFAULT 0,
    complained    BIGINT NOT NULL DEFAULT 0,
    failed        BIGINT NOT NULL DEFAULT 0,
    dead_lettered BIGINT NOT NULL DEFAULT 0,
    suppressed    BIGINT NOT NULL DEFAULT 0,
    cancelled     BIGINT NOT NULL DEFAULT 0,
    rejected      BIGINT NOT NULL DEFAULT 0,
    fragments     BIGINT NOT NULL DEFAULT 0
);

CREATE FUNCTION fairlane_usage_accepted() RETURNS trigger AS $$
BEGIN
    INSERT INTO usage_deltas (tenant_id, day, channel, test, accepted)
    SELECT tenant_id, created_at / 86400000, channel, test, count(*)
      FROM inserted
     GROUP BY 1, 2, 3, 4;
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER usage_accepted AFTER INSERT ON messages
    REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION fairlane_usage_accepted();

CREATE FUNCTION fairlane_usage_outcome() RETURNS trigger AS $$
BEGIN
    INSERT INTO usage_deltas (tenant_id, day, channel, test, sent, delivered, bounced,
                              complained, failed, dead_lettered, suppressed, cancelled,
                              rejected, fragments)
    SELECT n.tenant_id, n.updated_at / 86400000, n.channel, n.test,
           count(*) FILTER (WHERE n.status = 'sent'),
           count(*) FILTER (WHERE n.status = 'delivered'),
           count(*) FILTER (WHERE n.status = 'bounced'),
           count(*) FILTER (WHERE n.status = 'complained'),
           count(*) FILTER (WHERE n.status = 'failed'),
           count(*) FILTER (WHERE n.status = 'dead_lettered'),
           count(*) FILTER (WHERE n.status = 'suppressed'),
           count(*) FILTER (WHERE n.status = 'cancelled'),
           count(*) FILTER (WHERE n.status = 'rejected'),
           coalesce(sum(n.fragments) FILTER (WHERE n.status = 'sent'), 0)
      FROM after_rows AS n
      JOIN before_rows AS o ON o.id = n.id
     WHERE n.status <> o.status
       AND n.status IN ('sent', 'delivered', 'bounced', 'complained', 'failed',
                        'dead_lettered', 'suppressed', 'cancelled', 'rejected')
     GROUP BY 1, 2, 3, 4;
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER usage_outcome AFTER UPDATE ON messages
    REFERENCING OLD TABLE AS before_rows NEW TABLE AS after_rows
    FOR EACH STATEMENT EXECUTE FUNCTION fairlane_usage_outcome();
