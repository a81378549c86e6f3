-- Receive leases are kept in memory, not written: `visible_at` now changes
-- only for delivery delays and deferrals, so its index no longer earns its
-- upkeep on every insert and delete. Statistics read a lane's oldest row
-- from an index on `queue` alone (its entries are ordered by `seq`, which
-- follows enqueue order): one probe, no scan.
DROP INDEX queue_messages_visible;
CREATE INDEX queue_messages_queue ON queue_messages(queue);
