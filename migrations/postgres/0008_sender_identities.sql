-- A tenant's sender identities (issue 28): who its email comes from (an
-- address with a display name, reply-to addresses and an SES configuration
-- set) or who its SMS come from (a number or alphanumeric id, or a
-- messaging service). At most one default per tenant and channel.
CREATE TABLE sender_identities (
    id                    TEXT PRIMARY KEY,
    tenant_id             TEXT NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
    channel               TEXT NOT NULL,
    -- Email: the from address. SMS: the sender number or alphanumeric id
    -- (NULL when a messaging service sends).
    sender                TEXT,
    display_name          TEXT,
    -- Email: reply-to addresses as a JSON array, or NULL.
    reply_to              TEXT,
    configuration_set     TEXT,
    messaging_service_sid TEXT,
    is_default            BOOLEAN NOT NULL DEFAULT FALSE,
    created_at            BIGINT NOT NULL
);
CREATE INDEX sender_identities_tenant ON sender_identities(tenant_id);
CREATE UNIQUE INDEX sender_identities_default
    ON sender_identities(tenant_id, channel) WHERE is_default;
