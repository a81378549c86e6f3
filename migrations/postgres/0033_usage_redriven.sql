-- Messages moved back from the dead-letter queue, per usage row and delta:
-- a period's dead_lettered minus redriven is what it left in the DLQ
-- (issue 68.6: the console's overview counted a redriven message as failed
-- and sent).
ALTER TABLE usage ADD COLUMN redriven BIGINT NOT NULL DEFAULT 0;
ALTER TABLE usage_deltas ADD COLUMN redriven BIGINT NOT NULL DEFAULT 0;
