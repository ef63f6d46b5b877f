-- Parking is idempotent: one row per message (its message id and body), however often the DLQ
-- consumer parks it (an ack lost after the park commit parks it again). A message parked again
-- after a replay re-opens its row (replayed_at back to NULL, park_count + 1).
ALTER TABLE dead_letters ADD COLUMN IF NOT EXISTS fingerprint bytea;
ALTER TABLE dead_letters ADD COLUMN IF NOT EXISTS park_count integer NOT NULL DEFAULT 1;
UPDATE dead_letters
   SET fingerprint = sha256(convert_to(coalesce(message_id, ''), 'UTF8') || '\x00'::bytea || body)
 WHERE fingerprint IS NULL;
-- Rows parked twice before this migration: the first row of each message stays, counts the
-- others, and stays open for replay if any copy was never replayed.
UPDATE dead_letters d
   SET park_count = (SELECT count(*) FROM dead_letters e WHERE e.fingerprint = d.fingerprint),
       replayed_at = CASE
           WHEN EXISTS (SELECT 1 FROM dead_letters e
                         WHERE e.fingerprint = d.fingerprint AND e.replayed_at IS NULL) THEN NULL
           ELSE d.replayed_at END
 WHERE NOT EXISTS (SELECT 1 FROM dead_letters e WHERE e.fingerprint = d.fingerprint AND e.seq < d.seq)
   AND EXISTS (SELECT 1 FROM dead_letters e WHERE e.fingerprint = d.fingerprint AND e.seq > d.seq);
DELETE FROM dead_letters d USING dead_letters e
 WHERE d.fingerprint = e.fingerprint AND d.seq > e.seq;
ALTER TABLE dead_letters ALTER COLUMN fingerprint SET NOT NULL;
CREATE UNIQUE INDEX IF NOT EXISTS dead_letters_fingerprint ON dead_letters (fingerprint);
-- Rows written by anything else than warren's park statement (an operator, a script) get their
-- fingerprint too.
CREATE OR REPLACE FUNCTION dead_letters_fingerprint() RETURNS trigger LANGUAGE plpgsql AS $f$
BEGIN
    IF NEW.fingerprint IS NULL THEN
        NEW.fingerprint := sha256(convert_to(coalesce(NEW.message_id, ''), 'UTF8') || '\x00'::bytea || NEW.body);
    END IF;
    RETURN NEW;
END $f$;
DROP TRIGGER IF EXISTS dead_letters_fingerprint ON dead_letters;
CREATE TRIGGER dead_letters_fingerprint BEFORE INSERT ON dead_letters
    FOR EACH ROW EXECUTE FUNCTION dead_letters_fingerprint();
-- The API answers the fate of a parked id (GET /api/v1/users/{id}) by message id.
CREATE INDEX IF NOT EXISTS dead_letters_open_message_id ON dead_letters (message_id) WHERE replayed_at IS NULL;
