-- A schema ready for a distributed PostgreSQL (docs/ARCHITECTURE.md#a-distributed-postgresql).
-- PostgreSQL stays the one source of truth; what changes is that every primary and unique key
-- of the sale's tables carries the distribution column, activity_id, so that a sale's rows
-- (its orders, their reservations, ledger, compensations, and the inbox and outbox rows that
-- guard them) can live together on one node of a sharded cluster, and that orders are
-- declaratively partitioned by activity on this one node already.
--
-- A uniqueness that must hold across activities cannot be a unique key of a table distributed
-- by activity: a payment id settling at most one order moves to its own table,
-- order_payments, keyed by the payment id.
--
-- Rows from before this migration keep their activity: orders, reservations, ledger and
-- compensations always had it; inbox and outbox rows get the activity of the order or
-- reservation they name (0 when they name none, e.g. a row of an activity already purged).

-- orders: partitioned by hash of activity_id -------------------------------------------------
CREATE TABLE orders_by_activity (LIKE orders INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
    PARTITION BY HASH (activity_id);
DO $$
BEGIN
    FOR r IN 0..7 LOOP
        EXECUTE format(
            'CREATE TABLE orders_p%s PARTITION OF orders_by_activity FOR VALUES WITH (MODULUS 8, REMAINDER %s)',
            r, r);
    END LOOP;
END $$;
INSERT INTO orders_by_activity SELECT * FROM orders;

CREATE TABLE order_payments (
    payment_id   TEXT        PRIMARY KEY,
    activity_id  BIGINT      NOT NULL,
    order_id     TEXT        NOT NULL,
    paid_at      TIMESTAMPTZ NOT NULL DEFAULT now()
);
INSERT INTO order_payments (payment_id, activity_id, order_id, paid_at)
    SELECT payment_id, activity_id, order_id, coalesce(paid_at, updated_at)
    FROM orders WHERE payment_id IS NOT NULL;

DROP TABLE orders;
ALTER TABLE orders_by_activity RENAME TO orders;
ALTER TABLE orders ADD CONSTRAINT orders_pkey PRIMARY KEY (activity_id, order_id);
ALTER TABLE orders ADD CONSTRAINT orders_reservation_key UNIQUE (activity_id, reservation_id);
ALTER TABLE orders ADD CONSTRAINT orders_activity_sku_fkey
    FOREIGN KEY (activity_id, sku_id) REFERENCES activity_skus (activity_id, sku_id);
-- At most one valid order per buyer per activity SKU (invariant 2), as before.
CREATE UNIQUE INDEX orders_one_valid_per_buyer
    ON orders (activity_id, sku_id, user_id) WHERE status <> 'CANCELED';
CREATE UNIQUE INDEX orders_payment_id
    ON orders (activity_id, payment_id) WHERE payment_id IS NOT NULL;
CREATE INDEX orders_activity_sku_status ON orders (activity_id, sku_id, status);
CREATE INDEX orders_unpaid_expiry ON orders (expires_at) WHERE status IN ('CREATED', 'PAYING');
-- Lookups by an id alone (a buyer's order, a payment notification, a timer) probe each
-- partition's index; with the activity known they are pruned to one.
CREATE INDEX orders_order_id ON orders (order_id);
CREATE INDEX orders_by_reservation ON orders (reservation_id);
CREATE INDEX orders_by_payment ON orders (payment_id) WHERE payment_id IS NOT NULL;

-- reservations, stock_ledger, compensation_tasks: keys with the activity ------------------
ALTER TABLE reservations DROP CONSTRAINT reservations_pkey;
ALTER TABLE reservations ADD PRIMARY KEY (activity_id, reservation_id);
CREATE INDEX reservations_by_id ON reservations (reservation_id);

ALTER TABLE stock_ledger DROP CONSTRAINT stock_ledger_pkey;
ALTER TABLE stock_ledger ADD PRIMARY KEY (activity_id, ledger_id);
ALTER TABLE stock_ledger DROP CONSTRAINT stock_ledger_order_id_reason_key;
ALTER TABLE stock_ledger ADD CONSTRAINT stock_ledger_order_reason_key
    UNIQUE (activity_id, order_id, reason);
CREATE INDEX stock_ledger_by_order ON stock_ledger (order_id);

ALTER TABLE compensation_tasks DROP CONSTRAINT compensation_tasks_pkey;
ALTER TABLE compensation_tasks ADD PRIMARY KEY (activity_id, task_id);
ALTER TABLE compensation_tasks DROP CONSTRAINT compensation_tasks_reservation_id_key;
ALTER TABLE compensation_tasks ADD CONSTRAINT compensation_tasks_reservation_key
    UNIQUE (activity_id, reservation_id);
CREATE INDEX compensation_tasks_by_reservation ON compensation_tasks (reservation_id);

-- consumer_inbox and event_outbox: co-located with the orders they guard -----------------
ALTER TABLE consumer_inbox ADD COLUMN activity_id BIGINT NOT NULL DEFAULT 0;
UPDATE consumer_inbox i SET activity_id = o.activity_id
    FROM orders o WHERE o.order_id = i.order_id;
UPDATE consumer_inbox i SET activity_id = r.activity_id
    FROM reservations r WHERE i.activity_id = 0 AND r.reservation_id = i.reservation_id;
ALTER TABLE consumer_inbox DROP CONSTRAINT consumer_inbox_pkey;
ALTER TABLE consumer_inbox ADD PRIMARY KEY (activity_id, consumer_group, message_id);
CREATE INDEX consumer_inbox_by_message ON consumer_inbox (consumer_group, message_id);

ALTER TABLE event_outbox ADD COLUMN activity_id BIGINT NOT NULL DEFAULT 0;
UPDATE event_outbox e SET activity_id = o.activity_id
    FROM orders o WHERE o.order_id = e.aggregate_id;
UPDATE event_outbox e SET activity_id = (e.payload ->> 'activity_id')::bigint
    WHERE e.activity_id = 0 AND e.payload ? 'activity_id'
      AND (e.payload ->> 'activity_id') ~ '^[0-9]{1,18}$';
ALTER TABLE event_outbox DROP CONSTRAINT event_outbox_pkey;
ALTER TABLE event_outbox ADD PRIMARY KEY (activity_id, event_id);
CREATE INDEX event_outbox_by_event ON event_outbox (event_id);
