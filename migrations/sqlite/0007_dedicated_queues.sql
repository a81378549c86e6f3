-- Dedicated tenant queues (issue 13): where a tenant's messages wait, and
-- how many attention workers may consume its own queue at once.
ALTER TABLE tenants ADD COLUMN isolation TEXT NOT NULL DEFAULT 'shared';
ALTER TABLE tenants ADD COLUMN max_concurrent_consumers INTEGER NOT NULL DEFAULT 2;
