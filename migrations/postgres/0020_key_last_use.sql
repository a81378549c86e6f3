-- When each API key last authenticated a request (issue 47: the console
-- lists keys with their last use). Instances note uses in memory and write
-- them here about once a minute, never moving the time backwards.
ALTER TABLE api_keys ADD COLUMN last_used_at BIGINT;
