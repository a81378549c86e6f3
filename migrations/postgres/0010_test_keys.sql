-- Test keys (issue 28): a key is `live` or `test`; a test key's messages
-- go through everything but the provider (a simulated one answers) and
-- are marked, so quotas, listings and usage can leave them out.
ALTER TABLE api_keys ADD COLUMN kind TEXT NOT NULL DEFAULT 'live';
ALTER TABLE messages ADD COLUMN test BOOLEAN NOT NULL DEFAULT FALSE;
