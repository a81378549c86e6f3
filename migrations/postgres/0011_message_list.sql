-- The message list (issue 29): a tenant's live or test messages newest
-- first. The index also serves the daily quota's count at start-up
-- (tenant, live, created since). It replaces (tenant_id, created_at).
CREATE INDEX messages_tenant_list ON messages(tenant_id, test, created_at, id);
DROP INDEX messages_tenant_created;
