-- How long a sent message's last attempt waited for its provider's token
-- (issue 47: a message's timeline in the console answers "why did this
-- take 9 s?"), in ms; written with `sent`, in the statement that writes it.
ALTER TABLE messages ADD COLUMN gate_wait_ms INTEGER;
