-- scripts/limits.sh: private schema for the naive-limit measurements. Dropped and recreated
-- at the start of every run and dropped at its end; it never touches the project's schemas.
--
-- The order-path tables mirror sql/V1__pipeline.sql (columns, types, checks, unique and
-- partial indexes, the orders -> activity_skus foreign key whose FOR KEY SHARE checks meet
-- the stock update's FOR NO KEY UPDATE on the hot row), so that order_single.sql and
-- order_batch.sql cost what src/pg/order_tx.rs costs. Tables the happy path never writes
-- (compensation_tasks, quarantined_messages, dlq_*) are left out.
\set ON_ERROR_STOP on
SET client_min_messages = warning;
DROP SCHEMA IF EXISTS seckill_limits CASCADE;
CREATE SCHEMA seckill_limits;
SET search_path = seckill_limits;

CREATE TABLE activities (
    activity_id             BIGINT PRIMARY KEY CHECK (activity_id > 0),
    name                    TEXT        NOT NULL,
    starts_at               TIMESTAMPTZ NOT NULL,
    ends_at                 TIMESTAMPTZ NOT NULL,
    reservation_valid_secs  INTEGER     NOT NULL CHECK (reservation_valid_secs > 0),
    created_at              TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at              TIMESTAMPTZ NOT NULL DEFAULT now(),
    CHECK (ends_at > starts_at)
);

CREATE TABLE activity_skus (
    activity_id      BIGINT  NOT NULL REFERENCES activities (activity_id),
    sku_id           BIGINT  NOT NULL CHECK (sku_id > 0),
    total_stock      INTEGER NOT NULL CHECK (total_stock >= 0),
    remaining_stock  INTEGER NOT NULL CHECK (remaining_stock >= 0),
    price_cents      BIGINT  NOT NULL DEFAULT 0 CHECK (price_cents >= 0),
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (activity_id, sku_id),
    CHECK (remaining_stock <= total_stock)
);

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
    version           INTEGER     NOT NULL DEFAULT 1,
    expires_at        TIMESTAMPTZ NOT NULL,
    payment_id        TEXT,
    paid_at           TIMESTAMPTZ,
    canceled_at       TIMESTAMPTZ,
    cancel_reason     TEXT,
    reserved_at       TIMESTAMPTZ NOT NULL,
    created_at        TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at        TIMESTAMPTZ NOT NULL DEFAULT now(),
    FOREIGN KEY (activity_id, sku_id) REFERENCES activity_skus (activity_id, sku_id)
);
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

-- The hot row: remaining_stock is INTEGER as in the project, so "huge" is the INTEGER
-- maximum (2,147,483,647): far more than any run can sell.
INSERT INTO activities (activity_id, name, starts_at, ends_at, reservation_valid_secs)
VALUES (1, 'limits', now() - interval '1 hour', now() + interval '1 day', 900);
INSERT INTO activity_skus (activity_id, sku_id, total_stock, remaining_stock, price_cents)
VALUES (1, 1, 2147483647, 2147483647, 9900);

-- The naive baseline (direct_buy.sql): one stock row, one orders table, nothing else.
CREATE TABLE stock (
    id         INTEGER PRIMARY KEY,
    remaining  BIGINT  NOT NULL
);
CREATE TABLE direct_orders (
    order_id    BIGSERIAL   PRIMARY KEY,
    stock_id    INTEGER     NOT NULL,
    user_id     BIGINT      NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);
INSERT INTO stock (id, remaining) VALUES (1, 0);
