-- Attachments a tenant can plan with (issue 68.4). A finished file serves
-- any number of sends of its tenant and world until `expires_at` (a day
-- after its upload): each send that carries it is a row of
-- `attachment_uses`, in place of the one exclusive claim
-- (`attachments.message_id`). The consumer reads a file's bytes by its use,
-- so a send accepted before the file expired or was deleted still goes out
-- with it. `deleted_at`: the tenant deleted the file while messages used it;
-- new sends refuse it, and its bytes go when the last use goes (retention
-- erasing that message).
CREATE TABLE attachment_uses (
    attachment_id TEXT NOT NULL REFERENCES attachments(id) ON DELETE CASCADE,
    message_id    TEXT NOT NULL,
    used_at       INTEGER NOT NULL,
    PRIMARY KEY (attachment_id, message_id)
);
CREATE INDEX attachment_uses_message ON attachment_uses(message_id);
INSERT INTO attachment_uses (attachment_id, message_id, used_at)
    SELECT id, message_id, COALESCE(claimed_at, created_at) FROM attachments
    WHERE message_id IS NOT NULL;
ALTER TABLE attachments ADD COLUMN expires_at INTEGER NOT NULL DEFAULT 0;
UPDATE attachments SET expires_at = created_at + 86400000;
ALTER TABLE attachments ADD COLUMN deleted_at INTEGER;
DROP INDEX attachments_message;
DROP INDEX attachments_unclaimed;
ALTER TABLE attachments DROP COLUMN message_id;
ALTER TABLE attachments DROP COLUMN claimed_at;
CREATE INDEX attachments_expiry ON attachments(expires_at);
