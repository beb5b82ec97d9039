-- The pipeline's source of truth. Constraints do the real work: whatever the code does,
-- the database refuses an oversell, a second valid order per buyer, or a double effect.

CREATE TABLE activities (
    activity_id             BIGINT PRIMARY KEY CHECK (activity_id > 0),
    name                    TEXT        NOT NULL,
    starts_at               TIMESTAMPTZ NOT NULL,
    ends_at                 TIMESTAMPTZ NOT NULL,
    -- how long a reservation may wait for its order (copied into every message)
    reservation_valid_secs  INTEGER     NOT NULL CHECK (reservation_valid_secs > 0),
    created_at              TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at              TIMESTAMPTZ NOT NULL DEFAULT now(),
    CHECK (ends_at > starts_at)
);

CREATE TABLE activity_skus (
    activity_id      BIGINT  NOT NULL REFERENCES activities (activity_id),
    sku_id           BIGINT  NOT NULL CHECK (sku_id > 0),
    total_stock      INTEGER NOT NULL CHECK (total_stock >= 0),
    -- final stock: the hot row every order decrements conditionally
    remaining_stock  INTEGER NOT NULL CHECK (remaining_stock >= 0),
    price_cents      BIGINT  NOT NULL DEFAULT 0 CHECK (price_cents >= 0),
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (activity_id, sku_id),
    CHECK (remaining_stock <= total_stock)
);

-- One row per reservation that reached the consumer: the decision taken for it.
CREATE TABLE reservations (
    reservation_id   TEXT PRIMARY KEY,
    message_id       TEXT        NOT NULL,
    request_id       TEXT        NOT NULL,
    order_id         TEXT        NOT NULL,
    activity_id      BIGINT      NOT NULL,
    sku_id           BIGINT      NOT NULL,
    user_id          BIGINT      NOT NULL,
    status           TEXT        NOT NULL CHECK (status IN ('ORDERED', 'REJECTED')),
    reject_reason    TEXT,
    reserved_at      TIMESTAMPTZ NOT NULL,
    valid_until      TIMESTAMPTZ NOT NULL,
    recorded_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    CHECK ((status = 'REJECTED') = (reject_reason IS NOT NULL))
);
CREATE INDEX reservations_activity_sku ON reservations (activity_id, sku_id);

CREATE TABLE orders (
    order_id          TEXT PRIMARY KEY,
    reservation_id    TEXT        NOT NULL UNIQUE,
    activity_id       BIGINT      NOT NULL,
    sku_id            BIGINT      NOT NULL,
    user_id           BIGINT      NOT NULL,
    quantity          INTEGER     NOT NULL DEFAULT 1 CHECK (quantity = 1),
    amount_cents      BIGINT      NOT NULL DEFAULT 0,
    status            TEXT        NOT NULL CHECK (status IN ('CREATED', 'PAYING', 'PAID', 'CANCELED')),
    -- aggregate version: every state change bumps it; events carry it (§18)
    version           INTEGER     NOT NULL DEFAULT 1,
    expires_at        TIMESTAMPTZ NOT NULL,
    payment_id        TEXT,
    paid_at           TIMESTAMPTZ,
    canceled_at       TIMESTAMPTZ,
    cancel_reason     TEXT,
    -- when Redis accepted the reservation: created_at - reserved_at is the pipeline latency
    reserved_at       TIMESTAMPTZ NOT NULL,
    created_at        TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at        TIMESTAMPTZ NOT NULL DEFAULT now(),
    FOREIGN KEY (activity_id, sku_id) REFERENCES activity_skus (activity_id, sku_id)
);
-- At most one valid order per buyer per activity SKU (invariant 2).
CREATE UNIQUE INDEX orders_one_valid_per_buyer
    ON orders (activity_id, sku_id, user_id) WHERE status <> 'CANCELED';
CREATE INDEX orders_activity_sku_status ON orders (activity_id, sku_id, status);
CREATE INDEX orders_unpaid_expiry ON orders (expires_at) WHERE status IN ('CREATED', 'PAYING');

CREATE TABLE stock_ledger (
    ledger_id    BIGSERIAL PRIMARY KEY,
    activity_id  BIGINT      NOT NULL,
    sku_id       BIGINT      NOT NULL,
    order_id     TEXT        NOT NULL,
    delta        INTEGER     NOT NULL CHECK (delta IN (-1, 1)),
    reason       TEXT        NOT NULL CHECK (reason IN ('ORDER_CREATED', 'ORDER_CANCELED')),
    created_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- an order takes stock once and gives it back at most once
    UNIQUE (order_id, reason)
);
CREATE INDEX stock_ledger_activity_sku ON stock_ledger (activity_id, sku_id);

CREATE TABLE consumer_inbox (
    consumer_group    TEXT        NOT NULL,
    message_id        TEXT        NOT NULL,
    topic             TEXT        NOT NULL,
    reservation_id    TEXT,
    order_id          TEXT,
    status            TEXT        NOT NULL CHECK (status IN ('PROCESSING', 'SUCCEEDED', 'REJECTED')),
    -- what the message came to: CREATED, DUPLICATE_RESERVATION, EXPIRED, NO_STOCK, ...
    decision          TEXT,
    delivery_attempt  INTEGER     NOT NULL DEFAULT 0,
    received_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at        TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, message_id)
);
CREATE INDEX consumer_inbox_received ON consumer_inbox (received_at);

CREATE TABLE event_outbox (
    event_id           TEXT PRIMARY KEY,
    topic              TEXT        NOT NULL,
    tag                TEXT        NOT NULL,
    message_key        TEXT        NOT NULL,
    aggregate_id       TEXT,
    aggregate_version  INTEGER,
    payload            JSONB       NOT NULL,
    -- delayed messages (CANCEL_ORDER_IF_UNPAID) are delivered at this time
    deliver_at         TIMESTAMPTZ,
    status             TEXT        NOT NULL DEFAULT 'PENDING' CHECK (status IN ('PENDING', 'SENT', 'DEAD')),
    attempts           INTEGER     NOT NULL DEFAULT 0,
    next_attempt_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    broker_msg_id      TEXT,
    last_error         TEXT,
    created_at         TIMESTAMPTZ NOT NULL DEFAULT now(),
    sent_at            TIMESTAMPTZ
);
CREATE INDEX event_outbox_pending ON event_outbox (next_attempt_at) WHERE status = 'PENDING';

-- A reservation is compensated (its Redis stock released) at most once (invariant 4).
CREATE TABLE compensation_tasks (
    task_id         TEXT PRIMARY KEY,
    reservation_id  TEXT        NOT NULL UNIQUE,
    activity_id     BIGINT      NOT NULL,
    sku_id          BIGINT      NOT NULL,
    user_id         BIGINT      NOT NULL,
    reason          TEXT        NOT NULL,
    status          TEXT        NOT NULL DEFAULT 'PENDING' CHECK (status IN ('PENDING', 'DONE')),
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    done_at         TIMESTAMPTZ
);

-- Messages that can never be processed, kept with their raw body for an operator.
CREATE TABLE quarantined_messages (
    quarantine_id   BIGSERIAL PRIMARY KEY,
    consumer_group  TEXT        NOT NULL,
    topic           TEXT        NOT NULL,
    message_id      TEXT,
    broker_msg_id   TEXT,
    reason          TEXT        NOT NULL,
    error           TEXT        NOT NULL,
    raw_body        BYTEA       NOT NULL,
    properties      JSONB       NOT NULL DEFAULT '{}'::jsonb,
    delivery_attempt INTEGER    NOT NULL DEFAULT 0,
    received_at     TIMESTAMPTZ NOT NULL DEFAULT now()
);
