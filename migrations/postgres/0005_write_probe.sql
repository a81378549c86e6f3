-- A table `/readyz` writes a row into (and removes in the same
-- transaction) while the store's writes fail, to learn whether they would
-- succeed again.
CREATE TABLE write_probe (id BIGSERIAL PRIMARY KEY, filler BYTEA NOT NULL);
