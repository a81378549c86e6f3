-- The recipient beside a message's status (issue 47: the console finds a
-- tenant's messages by recipient), normalised as suppression lists are: an
-- email address in lower case, or an E.164 number. Retention erases it with
-- the message's other personal data. No index: a search reads a tenant's
-- newest messages within `limits.list_scan_rows`, as the list's other
-- filters do, so the accept path writes no more index entries.
ALTER TABLE messages ADD COLUMN recipient TEXT;
