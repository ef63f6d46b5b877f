-- Parking knows the pipeline: each configured pipeline parks into the same table, and a replay
-- sends a message back to its own pipeline. Every row parked before pipelines existed is the
-- users pipeline's. One row per message of a pipeline: the fingerprint is unique per pipeline
-- (the same bytes in two pipelines are two messages).
ALTER TABLE dead_letters ADD COLUMN IF NOT EXISTS pipeline text NOT NULL DEFAULT 'users';
DROP INDEX IF EXISTS dead_letters_fingerprint;
CREATE UNIQUE INDEX IF NOT EXISTS dead_letters_pipeline_fingerprint
    ON dead_letters (pipeline, fingerprint);
DROP INDEX IF EXISTS dead_letters_open_message_id;
CREATE INDEX IF NOT EXISTS dead_letters_open_message_id
    ON dead_letters (pipeline, message_id) WHERE replayed_at IS NULL;
