-- Several providers per channel (issue 30): the name of the provider last
-- called for the message (the one that sent it, once sent), and whether
-- its next attempt must go to that same provider (the last call timed out,
-- so the message may have arrived) rather than to another one.
ALTER TABLE messages ADD COLUMN provider TEXT;
ALTER TABLE messages ADD COLUMN provider_pinned INTEGER NOT NULL DEFAULT 0;
