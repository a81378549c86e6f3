-- Console sessions kept on the server (issue 68.5): the cookie carries a
-- session's random id (signed), and a request is served only while its
-- row is here, so signing out ends the session on every instance, and a
-- rotated root token or a revoked admin takes its sessions with it.
-- Ended and expired rows are deleted.
CREATE TABLE console_sessions (
    id           TEXT PRIMARY KEY,
    token_sha256 TEXT NOT NULL,
    created_at   INTEGER NOT NULL,
    expires_at   INTEGER NOT NULL
);
CREATE INDEX console_sessions_token ON console_sessions(token_sha256);
CREATE INDEX console_sessions_expiry ON console_sessions(expires_at);
