-- Per-plan upload limits (issue 68.4). `uploads_per_minute`: files a
-- tenant may upload per minute in each of its worlds (a bucket of that
-- many, refilling over a minute). `upload_bytes_held`: bytes of files a
-- tenant may hold in the store in each world, used or not, until their
-- bytes are erased. The index serves the sum of a world's held bytes.
ALTER TABLE plans ADD COLUMN uploads_per_minute BIGINT NOT NULL DEFAULT 60;
ALTER TABLE plans ADD COLUMN upload_bytes_held BIGINT NOT NULL DEFAULT 1073741824;
CREATE INDEX attachments_tenant ON attachments(tenant_id, test);
