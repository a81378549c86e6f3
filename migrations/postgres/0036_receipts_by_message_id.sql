-- Receipts find their message by fairlane's own id, which both providers
-- carry back (SES's `message_id` message tag; the `message_id` in a
-- Twilio status callback's URL) (issue 69.5). A message sent from now on
-- is marked `receipt_by_id` and stays out of the index on the provider's
-- id, whose random keys (Twilio SIDs, `log-<uuid>`) dirtied a page of
-- the index with every `sent`. The index keeps the messages sent before,
-- whose receipts name the provider's id alone.
ALTER TABLE messages ADD COLUMN receipt_by_id BOOLEAN;
DROP INDEX messages_provider_id;
CREATE INDEX messages_provider_id ON messages(provider_message_id)
    WHERE provider_message_id IS NOT NULL AND receipt_by_id IS NULL;
