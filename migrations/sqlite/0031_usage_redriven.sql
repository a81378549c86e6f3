-- Messages moved back from the dead-letter queue, per usage row: a
-- period's dead_lettered minus redriven is what it left in the DLQ (issue
-- 68.6: the console's overview counted a redriven message as failed and
-- sent).
ALTER TABLE usage ADD COLUMN redriven INTEGER NOT NULL DEFAULT 0;
