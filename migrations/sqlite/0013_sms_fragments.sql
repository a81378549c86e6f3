-- SMS fragments (issue 29): the billed segments of an SMS, counted at
-- accept (GSM-7 160/153, UCS-2 70/67); NULL for email.
ALTER TABLE messages ADD COLUMN fragments INTEGER;
