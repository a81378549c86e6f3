-- A message's life has one owner (issue 45): every status change is made
-- by the store's lifecycle (src/store/lifecycle.rs for the rules,
-- src/store/postgres/lifecycle.rs for this backend's statements), whose
-- statements write, in the same statement as the status, what these
-- triggers wrote: the status events, the usage deltas of accepts and
-- outcomes, the webhook calls of subscribed events and the unmarking of
-- an erased message. The history written so far stays as it is.
DROP TRIGGER IF EXISTS message_status_events ON messages;
DROP FUNCTION IF EXISTS fairlane_message_status_events();
DROP TRIGGER IF EXISTS message_events_added ON message_events;
DROP FUNCTION IF EXISTS fairlane_message_events_added();
DROP TRIGGER IF EXISTS usage_accepted ON messages;
DROP FUNCTION IF EXISTS fairlane_usage_accepted();
DROP TRIGGER IF EXISTS usage_outcome ON messages;
DROP FUNCTION IF EXISTS fairlane_usage_outcome();
DROP TRIGGER IF EXISTS message_erasure_undone ON messages;
DROP FUNCTION IF EXISTS fairlane_message_erasure_undone();
