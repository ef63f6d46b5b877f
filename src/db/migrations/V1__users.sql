-- The users table the main pipeline writes to. `id` makes every insert idempotent.
CREATE TABLE IF NOT EXISTS users (
    id          uuid        PRIMARY KEY,
    name        text        NOT NULL,
    email       text        NOT NULL UNIQUE,
    inserted_at timestamptz NOT NULL DEFAULT now()
);
