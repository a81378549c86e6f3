-- Several events per webhook call (issue 45, item 4): an endpoint may ask
-- for up to `max_events_per_call` events in one POST. 1, the default,
-- keeps the one-event body every endpoint had before.
ALTER TABLE webhooks ADD COLUMN max_events_per_call BIGINT NOT NULL DEFAULT 1;
