-- Tickets of the groups of failures (docs/RUNBOOK.md#dead-letter-tickets): one row per
-- fingerprint ever seen open, made by the first consume instance that sees it, then POSTed to
-- dlq.ticket_webhook until the hook answers 2xx (attempts, next_attempt_at: backed off; a
-- crash between the POST and delivered_at sends it again with the same idempotency key). An
-- expand step: nothing older reads it.
CREATE TABLE dlq_tickets (
    fingerprint     TEXT PRIMARY KEY,
    consumer_group  TEXT NOT NULL,
    source          TEXT NOT NULL,
    owner           TEXT NOT NULL,
    -- The group's error with its ids and numbers normalised away, and its size when opened.
    message         TEXT NOT NULL,
    failures        INTEGER NOT NULL,
    opened_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    delivered_at    TIMESTAMPTZ,
    last_error      TEXT
);
CREATE INDEX dlq_tickets_due ON dlq_tickets (next_attempt_at) WHERE delivered_at IS NULL;
