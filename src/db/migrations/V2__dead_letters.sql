-- Messages the DLQ consumer can never insert are parked here, never discarded.
CREATE TABLE IF NOT EXISTS dead_letters (
    seq          bigserial   PRIMARY KEY,
    message_id   text,
    body         bytea       NOT NULL,
    headers      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    error_kind   text        NOT NULL,
    error_reason text        NOT NULL,
    parked_at    timestamptz NOT NULL DEFAULT now(),
    replayed_at  timestamptz
);
CREATE INDEX IF NOT EXISTS dead_letters_unreplayed ON dead_letters (seq) WHERE replayed_at IS NULL;
