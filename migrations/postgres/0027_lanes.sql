-- Lanes in PostgreSQL (issue 49, `queue.backend = "postgres"`): several
-- instances share their queues through the database they already share,
-- without SQS. Unused (empty) with the other queue backends.
--
-- A row is one message waiting in a queue: `queue` is a lane (`fast`,
-- `slow`) or its dead-letter queue (`fast-dlq`, `slow-dlq`); `class` the
-- priority's rank (0 high, 1 normal, 2 low). A receive sets `leased` and
-- moves `visible_at` to the end of its visibility timeout; `receives`
-- counts every hand-out (a receipt names the one it came from), and
-- `receive_count` those that count toward the dead-letter queue (a
-- deferral gives its receive back).
CREATE TABLE lane_messages (
    seq           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue         TEXT NOT NULL,
    class         SMALLINT NOT NULL,
    tenant_id     TEXT NOT NULL,
    message_id    TEXT NOT NULL,
    channel       TEXT NOT NULL,
    priority      TEXT NOT NULL,
    body          TEXT NOT NULL,
    enqueued_at   BIGINT NOT NULL,
    visible_at    BIGINT NOT NULL,
    leased        BOOLEAN NOT NULL DEFAULT false,
    receive_count INTEGER NOT NULL DEFAULT 0,
    receives      BIGINT NOT NULL DEFAULT 0
) WITH (
    -- A lane's head is deleted as fast as it is written: vacuum it often,
    -- so a receive does not walk dead index entries.
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_cost_delay = 0
);
-- A receive's look at one tenant: its visible messages in a class, oldest
-- visibility first.
CREATE INDEX lane_messages_ready ON lane_messages (queue, class, tenant_id, visible_at, seq);
CREATE INDEX lane_messages_message ON lane_messages (message_id);

-- Turns: one row per tenant with messages in a queue's class. A receive
-- serves the tenants with the oldest turns first and gives each tenant it
-- served a new turn from `lane_turn_seq`, behind everyone waiting; a new
-- tenant's first message takes the next turn, so it waits at most one
-- round whatever another tenant's backlog.
CREATE TABLE lane_turns (
    queue     TEXT NOT NULL,
    class     SMALLINT NOT NULL,
    tenant_id TEXT NOT NULL,
    turn      BIGINT NOT NULL,
    PRIMARY KEY (queue, class, tenant_id)
);
CREATE INDEX lane_turns_order ON lane_turns (queue, class, turn);
CREATE SEQUENCE lane_turn_seq;
