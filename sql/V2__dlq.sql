-- Dead letters (§17, 002 §8.7): every message that exhausted its redeliveries is recorded
-- here by the DLQ intake, with its raw payload, until an operator replays or discards it.
CREATE TABLE dlq_messages (
    dlq_id            BIGSERIAL PRIMARY KEY,
    consumer_group    TEXT        NOT NULL,
    topic             TEXT        NOT NULL,
    message_id        TEXT,
    reservation_id    TEXT,
    order_id          TEXT,
    broker_msg_id     TEXT,
    -- position of the copy in the group's %DLQ% topic: a redelivered copy is recorded once
    dlq_queue_id      INTEGER     NOT NULL,
    dlq_queue_offset  BIGINT      NOT NULL,
    attempts          INTEGER     NOT NULL,
    error_class       TEXT,
    last_error        TEXT,
    payload           BYTEA       NOT NULL,
    properties        JSONB       NOT NULL DEFAULT '{}'::jsonb,
    status            TEXT        NOT NULL DEFAULT 'OPEN' CHECK (status IN ('OPEN', 'REPLAYED', 'DISCARDED')),
    first_seen        TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at        TIMESTAMPTZ NOT NULL DEFAULT now(),
    UNIQUE (consumer_group, dlq_queue_id, dlq_queue_offset)
);
CREATE INDEX dlq_messages_open ON dlq_messages (first_seen) WHERE status = 'OPEN';

-- The last failure of a message per group, written outside the rolled-back transaction, so
-- a dead letter arrives with the reason it died.
CREATE TABLE consumer_failures (
    consumer_group  TEXT        NOT NULL,
    message_id      TEXT        NOT NULL,
    failures        INTEGER     NOT NULL DEFAULT 1,
    error_class     TEXT        NOT NULL,
    last_error      TEXT        NOT NULL,
    updated_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, message_id)
);

-- Every operator action on a dead letter: who, when, why, what came of it.
CREATE TABLE dlq_audit (
    audit_id    BIGSERIAL PRIMARY KEY,
    dlq_id      BIGINT      NOT NULL REFERENCES dlq_messages (dlq_id),
    action      TEXT        NOT NULL CHECK (action IN ('REPLAY', 'DISCARD')),
    actor       TEXT        NOT NULL,
    reason      TEXT        NOT NULL,
    outcome     TEXT        NOT NULL,
    replay_id   TEXT,
    at          TIMESTAMPTZ NOT NULL DEFAULT now()
);
