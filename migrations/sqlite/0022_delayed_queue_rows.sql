-- The embedded queue's delayed rows (scheduled sends, retries): the only
-- rows whose `visible_at` was set past their `enqueued_at`. A partial index,
-- so a message queued to go at once writes no entry in it; the console's
-- overview counts each tenant's delayed messages by it instead of reading
-- every queued row (issue 47: 158 ms a page beside a backlog of 1,000,000
-- messages without it).
CREATE INDEX queue_messages_delayed ON queue_messages(queue, visible_at)
    WHERE visible_at > enqueued_at;
