-- A tenant's templates (issue 48). A template keeps every version it has
-- had: editing one adds a version, and a message names the version it was
-- rendered from, so a send queued before an edit goes out as it was
-- accepted. `body` is the version's whole content as JSON (name, channel,
-- priority, lane, the default variant and the locale variants), read and
-- checked by `src/templates/`. A deleted template takes no new sends; its
-- versions stay for the messages still waiting to be rendered.
CREATE TABLE templates (
    id         TEXT PRIMARY KEY,
    tenant_id  TEXT NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
    channel    TEXT NOT NULL,
    name       TEXT NOT NULL,
    version    INTEGER NOT NULL,
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL,
    deleted_at BIGINT
);
CREATE INDEX templates_tenant ON templates(tenant_id, id);
-- A live template's name is unique within its tenant.
CREATE UNIQUE INDEX templates_name ON templates(tenant_id, name) WHERE deleted_at IS NULL;
CREATE TABLE template_versions (
    template_id TEXT NOT NULL REFERENCES templates(id) ON DELETE CASCADE,
    version     INTEGER NOT NULL,
    tenant_id   TEXT NOT NULL,
    body        TEXT NOT NULL,
    created_at  BIGINT NOT NULL,
    PRIMARY KEY (template_id, version)
);
-- Which template and version a message was sent with (its personalisation
-- travels in the queue's payload and is rendered at delivery).
ALTER TABLE messages ADD COLUMN template_id TEXT;
ALTER TABLE messages ADD COLUMN template_version BIGINT;
