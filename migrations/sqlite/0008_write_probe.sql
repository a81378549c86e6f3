-- A table `/readyz` writes a row into (and removes in the same
-- transaction) while the store's writes fail, to learn whether they would
-- succeed again (a full disk that has room again, say).
CREATE TABLE write_probe (id INTEGER PRIMARY KEY, filler BLOB NOT NULL);
