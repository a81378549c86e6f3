-- One-click unsubscribe (issue 28): whether a tenant's email asks for it
-- unless a send says otherwise, and the mailto: address its
-- List-Unsubscribe header offers beside the https link.
ALTER TABLE tenants ADD COLUMN unsubscribe_default BOOLEAN NOT NULL DEFAULT FALSE;
ALTER TABLE tenants ADD COLUMN unsubscribe_mailto TEXT;
