-- Statuses per recipient (issue 48): an email to several addresses has one
-- message id and one status, the furthest any of its recipients reached;
-- SES reports deliveries, bounces, complaints and delays per address, and
-- each address's latest word is kept here. The address is personal data:
-- retention deletes a message's rows with its other personal data, and
-- deleting a tenant deletes its rows.
CREATE TABLE recipient_statuses (
    message_id TEXT NOT NULL,
    address    TEXT NOT NULL,
    tenant_id  TEXT NOT NULL,
    status     TEXT NOT NULL,
    detail     TEXT,
    updated_at BIGINT NOT NULL,
    PRIMARY KEY (message_id, address)
);
CREATE INDEX recipient_statuses_tenant ON recipient_statuses(tenant_id);
