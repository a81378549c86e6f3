-- Priority-aware dequeue: receives read the head of each priority class of a
-- queue in fair-key order, so the index leads with the class.
CREATE INDEX queue_messages_class ON queue_messages(queue, priority, fair_key);
DROP INDEX queue_messages_fair;
