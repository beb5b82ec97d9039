-- When an order was committed, not only when its row was written (docs/ARCHITECTURE.md#postgresql-schema).
--
-- The order transaction writes one order_commits row as its last statement before COMMIT,
-- after the hot stock row's decrement: its committed_at is clock_timestamp() at the end of the
-- transaction, with every lock wait in it. Each order carries the id of the transaction that
-- wrote it (xact_id), so an order's reservation-to-commit latency is
-- order_commits.committed_at - orders.reserved_at, joined on xact_id. One row per transaction
-- (a batch of up to consumer.batch_size orders), so it costs one small insert per batch, sent
-- in the same round trip as the decrement.
--
-- Orders written before this migration have no xact_id (NULL): their created_at stays their
-- only clock. order_commits rows are as long-lived as the orders they stamp (no retention).
CREATE TABLE order_commits (
    xact_id       xid8        PRIMARY KEY,
    orders        INTEGER     NOT NULL CHECK (orders > 0),
    committed_at  TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()
);
-- Added without a default first, so the orders already there keep NULL (a default on ADD
-- COLUMN would be evaluated once, stamping every old order with this migration's id).
ALTER TABLE orders ADD COLUMN xact_id xid8;
ALTER TABLE orders ALTER COLUMN xact_id SET DEFAULT pg_current_xact_id();
