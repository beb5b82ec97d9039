-- bench/limits/limits.sh, measurement 2: the same order transaction as order_single.sql for a
-- batch of :batch messages (-D batch=32, the consumer's consumer.batch_size), set-based like
-- src/pg/order_tx/mod.rs: one multi-row statement per step, SAVEPOINT + unlocked stock read
-- pipelined, the ledger/outbox/inbox/NOTIFY step pipelined, then one conditional decrement of
-- the hot row for the whole batch (its lock taken last) and the commit stamp, pipelined, COMMIT. tests/it/pgbench_scripts.rs
-- compares the statements with what the consumer sends.
-- The inbox rows are claimed with the outcome every order of this script comes to (SUCCEEDED,
-- CREATED), as the consumer claims them; it corrects only the rows that came to something else.
-- Ids: (per-client counter * 1000 + client_id) * 100 + g, g = 1..batch (batch <= 99).
-- Requires -D n=0 -D batch=<size> and -M prepared or -M extended (pipeline).
\set n :n + 1
\set k :n * 1000 + :client_id
\set ub (permute(:k, 10000000000000) + 1) * 100
-- id_at, the by-day tables' partition key, is now(): the consumer sends the time in each id's
-- ULID, minted moments before, so its rows land in today's partition as these do.
BEGIN;
INSERT INTO seckill_limits.consumer_inbox_by_day
    (consumer_group, message_id, topic, reservation_id, order_id, status, decision,
     delivery_attempt, activity_id, id_at)
SELECT 'seckill-limits-consumer', 'evt_' || lpad((:k::bigint * 100 + g)::text, 26, '0'),
       'seckill-order-create', 'rsv_' || lpad((:k::bigint * 100 + g)::text, 26, '0'),
       'ord_' || lpad((:k::bigint * 100 + g)::text, 26, '0'), 'SUCCEEDED', 'CREATED', 0, 1,
       now()
FROM generate_series(1, :batch::int) AS g
ON CONFLICT DO NOTHING
RETURNING message_id;
INSERT INTO seckill_limits.reservations
    (reservation_id, message_id, request_id, order_id, activity_id, sku_id, user_id,
     status, reject_reason, reserved_at, valid_until)
SELECT 'rsv_' || lpad((:k::bigint * 100 + g)::text, 26, '0'),
       'evt_' || lpad((:k::bigint * 100 + g)::text, 26, '0'),
       'req_' || lpad((:k::bigint * 100 + g)::text, 26, '0'),
       'ord_' || lpad((:k::bigint * 100 + g)::text, 26, '0'), 1, 1, :ub::bigint + g,
       'ORDERED', NULL, now() - interval '20 milliseconds', now() + interval '15 minutes'
FROM generate_series(1, :batch::int) AS g
ON CONFLICT (activity_id, reservation_id) DO NOTHING
RETURNING reservation_id;
INSERT INTO seckill_limits.orders
    (order_id, reservation_id, activity_id, sku_id, user_id, status, amount_cents,
     expires_at, reserved_at, stock_bucket, channel)
SELECT 'ord_' || lpad((:k::bigint * 100 + g)::text, 26, '0'),
       'rsv_' || lpad((:k::bigint * 100 + g)::text, 26, '0'), 1, 1, :ub::bigint + g,
       'CREATED', k.price_cents, now() + interval '15 minutes', now() - interval '20 milliseconds', 0,
       'app'
FROM generate_series(1, :batch::int) AS g
JOIN seckill_limits.activity_skus k ON k.activity_id = 1 AND k.sku_id = 1
ON CONFLICT DO NOTHING
RETURNING order_id;
\startpipeline
SAVEPOINT stock;
SELECT k.activity_id, k.sku_id, k.bucket, k.remaining_stock::int8
FROM seckill_limits.stock_buckets k
WHERE k.activity_id = 1 AND k.sku_id = 1 AND k.bucket = 0;
\endpipeline
\startpipeline
INSERT INTO seckill_limits.stock_ledger (activity_id, sku_id, order_id, delta, reason, bucket)
SELECT 1, 1, 'ord_' || lpad((:k::bigint * 100 + g)::text, 26, '0'), -1, 'ORDER_CREATED', 0
FROM generate_series(1, :batch::int) AS g;
INSERT INTO seckill_limits.event_outbox_by_day
    (event_id, topic, tag, message_key, aggregate_id, aggregate_version, payload, deliver_at,
     next_attempt_at, activity_id, id_at)
SELECT o || '.v1.ORDER_CREATED', 'seckill-order-event', 'ORDER_CREATED', o, o, 1,
       jsonb_build_object(
           'schema_version', 1, 'event_type', 'ORDER_CREATED',
           'event_id', o || '.v1.ORDER_CREATED', 'order_id', o, 'reservation_id', r,
           'activity_id', 1, 'sku_id', 1, 'user_id', u,
           'status', 'CREATED', 'aggregate_version', 1,
           'expires_at', now() + interval '15 minutes', 'occurred_at', now(),
           'traceparent', '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01'),
       NULL, now(), 1, now()
FROM (SELECT 'ord_' || lpad((:k::bigint * 100 + g)::text, 26, '0') AS o,
             'rsv_' || lpad((:k::bigint * 100 + g)::text, 26, '0') AS r,
             :ub::bigint + g AS u
      FROM generate_series(1, :batch::int) AS g) AS t
UNION ALL
SELECT o || '.CANCEL_IF_UNPAID', 'seckill-order-timeout', 'CANCEL_IF_UNPAID', o, o, NULL,
       jsonb_build_object(
           'schema_version', 1, 'event_type', 'CANCEL_ORDER_IF_UNPAID',
           'event_id', o || '.CANCEL_IF_UNPAID', 'order_id', o, 'activity_id', 1, 'sku_id', 1,
           'expires_at', now() + interval '15 minutes',
           'traceparent', '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01'),
       now() + interval '15 minutes', now() + interval '15 minutes' - interval '60 seconds', 1,
       now()
FROM (SELECT 'ord_' || lpad((:k::bigint * 100 + g)::text, 26, '0') AS o
      FROM generate_series(1, :batch::int) AS g) AS t
ON CONFLICT (activity_id, event_id, id_at) DO NOTHING;
NOTIFY seckill_limits_outbox;
\endpipeline
\startpipeline
UPDATE seckill_limits.stock_buckets
   SET remaining_stock = remaining_stock - :batch::int, updated_at = now()
 WHERE activity_id = 1 AND sku_id = 1 AND bucket = 0 AND remaining_stock >= :batch::int
RETURNING remaining_stock;
INSERT INTO seckill_limits.order_commits (xact_id, orders) VALUES (pg_current_xact_id(), :batch::int);
\endpipeline
COMMIT;
