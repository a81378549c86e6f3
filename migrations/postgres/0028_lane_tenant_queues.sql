-- Dedicated tenant queues in the lanes in PostgreSQL (issue 49,
-- `queue.backend = "postgres"`). A dedicated tenant's messages wait in
-- `lane_messages` under a queue of its own (`fast:t:acme`, its dead
-- letters in `fast:t:acme:dlq`), and each write to it leaves an entry for
-- the tenant in the lane's attention queue (`fast:attention`), which the
-- attention workers receive like any queue. At most one entry per tenant
-- and lane waits there, in flight or not:
CREATE UNIQUE INDEX lane_messages_attention ON lane_messages (queue, tenant_id)
    WHERE queue LIKE '%:attention';

-- The lanes in which a tenant has had a queue of its own, as the admin API
-- lists them (an emptied queue stays listed until the tenant is deleted).
CREATE TABLE lane_tenant_queues (
    tenant_id TEXT NOT NULL,
    lane      TEXT NOT NULL,
    PRIMARY KEY (tenant_id, lane)
);
