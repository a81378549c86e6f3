-- A message's life has one owner (issue 45): every status change is made
-- by the store's lifecycle (src/store/lifecycle.rs for the rules,
-- src/store/sqlite/lifecycle.rs for this backend's statements), which
-- writes in the same transaction what these triggers wrote: the status
-- event, the usage counter of an outcome, the webhook call of a
-- subscribed event and the unmarking of an erased message. The history
-- written so far stays as it is.
DROP TRIGGER IF EXISTS message_status_event;
DROP TRIGGER IF EXISTS usage_outcome;
DROP TRIGGER IF EXISTS message_event_added;
DROP TRIGGER IF EXISTS message_event_webhook;
