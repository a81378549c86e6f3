-- Named admins with roles (issue 47): each holds a bearer token, stored as
-- its SHA-256 only. The token of `server.admin_token` (or the generated
-- one) stays the root admin, outside this table. A revoked admin keeps its
-- row, so the audit log's names keep meaning something; its name may be
-- given again.
CREATE TABLE admins (
    id           TEXT PRIMARY KEY,
    name         TEXT NOT NULL,
    role         TEXT NOT NULL,
    token_sha256 TEXT NOT NULL UNIQUE,
    created_at   BIGINT NOT NULL,
    revoked_at   BIGINT
);
CREATE UNIQUE INDEX admins_active_name ON admins(name) WHERE revoked_at IS NULL;

-- Every admin change that succeeded: who, what, on which target, the
-- state before (where the handler knows it) and after, secrets removed.
CREATE TABLE audit_log (
    id         BIGSERIAL PRIMARY KEY,
    at         BIGINT NOT NULL,
    actor_id   TEXT NOT NULL,
    actor_name TEXT NOT NULL,
    actor_role TEXT NOT NULL,
    action     TEXT NOT NULL,
    target     TEXT NOT NULL,
    status     INTEGER NOT NULL,
    state_before TEXT,
    state_after  TEXT
);
CREATE INDEX audit_log_at ON audit_log(at);
