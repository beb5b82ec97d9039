-- bench/limits/limits.sh: private schema for the naive-limit measurements. Dropped and recreated
-- at the start of every run and dropped at its end; it never touches the project's schemas.
--
-- The order-path tables are the project's own, created by its migrations (sql/V*.sql) in this
-- schema: columns, checks, unique and partial indexes, and the orders -> activity_skus foreign
-- key (FOR KEY SHARE checks) beside the stock update's FOR NO KEY UPDATE on the hot stock row, so
-- that order_single.sql and order_batch.sql cost what src/pg/order_tx/mod.rs costs.
\set ON_ERROR_STOP on
SET client_min_messages = warning;
DROP SCHEMA IF EXISTS seckill_limits CASCADE;
CREATE SCHEMA seckill_limits;
SET search_path = seckill_limits;

-- The project's own schema, from its migrations (never a copy that could drift; every
-- sql/V*.sql is listed here, tests/it/pgbench_scripts.rs checks).
\ir ../../sql/V1__pipeline.sql
\ir ../../sql/V2__dlq.sql
\ir ../../sql/V3__retention.sql
\ir ../../sql/V4__trust.sql
\ir ../../sql/V5__order_clock.sql
\ir ../../sql/V6__commit_stamp.sql
\ir ../../sql/V7__retention_marks.sql
\ir ../../sql/V8__dlq_effects.sql
\ir ../../sql/V9__stock_buckets.sql
\ir ../../sql/V10__distribution_keys.sql
\ir ../../sql/V11__pending_compensations.sql
\ir ../../sql/V12__transaction_delivery.sql
\ir ../../sql/V13__order_channel.sql
\ir ../../sql/V14__quarantine_replay.sql
\ir ../../sql/V15__redis_fences.sql
\ir ../../sql/V16__refund_obligations.sql
\ir ../../sql/V17__replay_batches.sql
\ir ../../sql/V18__source_replay.sql
\ir ../../sql/V19__fair_start.sql
\ir ../../sql/V20__sale_passes.sql
\ir ../../sql/V21__audit_events.sql
\ir ../../sql/V22__replay_batches.sql
\ir ../../sql/V23__dlq_tickets.sql

-- The hot row: remaining_stock is INTEGER as in the project, so "huge" is the INTEGER
-- maximum (2,147,483,647): far more than any run can sell.
INSERT INTO activities (activity_id, name, starts_at, ends_at, reservation_valid_secs)
VALUES (1, 'limits', now() - interval '1 hour', now() + interval '1 day', 900);
INSERT INTO activity_skus (activity_id, sku_id, total_stock, price_cents)
VALUES (1, 1, 2147483647, 9900);
INSERT INTO stock_buckets (activity_id, sku_id, bucket, total_stock, remaining_stock)
VALUES (1, 1, 0, 2147483647, 2147483647);

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
\ir ../../sql/V24__archive_segments.sql
-- V25 locks the tables it copies: in a transaction, as `seckill migrate` runs it; then its
-- contract step, as `seckill migrate` leaves a schema it creates (src/pg/contract.rs).
BEGIN;
\ir ../../sql/V25__inbox_outbox_by_day.sql
COMMIT;
\ir ../../src/pg/contract.sql
