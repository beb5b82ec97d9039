-- bench/limits/limits.sh, measurement 1: the project's order transaction for ONE message, as
-- src/pg/order_tx/mod.rs runs it for a batch of one (happy path: fresh message, fresh
-- reservation, stock left). The same statements in the same order and the same round trips
-- (tests/it/pgbench_scripts.rs records what the consumer sends and compares):
--   BEGIN; inbox insert (with the outcome it comes to); reservation insert; order insert (joined with the SKU row, FK check
--   = FOR KEY SHARE on the hot row); SAVEPOINT + unlocked stock read, pipelined; ledger,
--   outbox (ORDER_CREATED + delayed CANCEL_IF_UNPAID) and NOTIFY, pipelined;
--   the conditional hot-row decrement (its row lock is taken last, held for the commit only)
--   and the commit stamp (order_commits), pipelined; COMMIT.
-- Ids: k = per-client counter * 1000 + client_id: unique and rising, like the ULID-based
-- ids (evt_/rsv_/ord_ + 26 characters). Buyers: a permutation of k (unique, scattered).
-- Requires -D n=0 (the counter) and -M prepared or -M extended (pipeline).
-- NOTIFY uses a private channel so a running outbox relay is not woken.
\set n :n + 1
\set k :n * 1000 + :client_id
\set uid permute(:k, 10000000000000) + 1
-- id_at, the by-day tables' partition key, is now(): the consumer sends the time in each id's
-- ULID, minted moments before, so its rows land in today's partition as these do.
BEGIN;
INSERT INTO seckill_limits.consumer_inbox_by_day
    (consumer_group, message_id, topic, reservation_id, order_id, status, decision,
     delivery_attempt, activity_id, id_at)
VALUES ('seckill-limits-consumer', 'evt_' || lpad(:k::text, 26, '0'), 'seckill-order-create',
        'rsv_' || lpad(:k::text, 26, '0'), 'ord_' || lpad(:k::text, 26, '0'), 'SUCCEEDED',
        'CREATED', 0, 1, now())
ON CONFLICT DO NOTHING
RETURNING message_id;
INSERT INTO seckill_limits.reservations
    (reservation_id, message_id, request_id, order_id, activity_id, sku_id, user_id,
     status, reject_reason, reserved_at, valid_until)
VALUES ('rsv_' || lpad(:k::text, 26, '0'), 'evt_' || lpad(:k::text, 26, '0'),
        'req_' || lpad(:k::text, 26, '0'), 'ord_' || lpad(:k::text, 26, '0'), 1, 1, :uid,
        'ORDERED', NULL, now() - interval '20 milliseconds', now() + interval '15 minutes')
ON CONFLICT (activity_id, reservation_id) DO NOTHING
RETURNING reservation_id;
INSERT INTO seckill_limits.orders
    (order_id, reservation_id, activity_id, sku_id, user_id, status, amount_cents,
     expires_at, reserved_at, stock_bucket, channel)
SELECT 'ord_' || lpad(:k::text, 26, '0'), 'rsv_' || lpad(:k::text, 26, '0'), 1, 1, :uid,
       'CREATED', k.price_cents, now() + interval '15 minutes', now() - interval '20 milliseconds', 0,
       'app'
FROM seckill_limits.activity_skus k
WHERE k.activity_id = 1 AND k.sku_id = 1
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
VALUES (1, 1, 'ord_' || lpad(:k::text, 26, '0'), -1, 'ORDER_CREATED', 0);
INSERT INTO seckill_limits.event_outbox_by_day
    (event_id, topic, tag, message_key, aggregate_id, aggregate_version, payload, deliver_at,
     next_attempt_at, activity_id, id_at)
SELECT 'ord_' || lpad(:k::text, 26, '0') || '.v1.ORDER_CREATED', 'seckill-order-event',
       'ORDER_CREATED', 'ord_' || lpad(:k::text, 26, '0'), 'ord_' || lpad(:k::text, 26, '0'), 1,
       jsonb_build_object(
           'schema_version', 1, 'event_type', 'ORDER_CREATED',
           'event_id', 'ord_' || lpad(:k::text, 26, '0') || '.v1.ORDER_CREATED',
           'order_id', 'ord_' || lpad(:k::text, 26, '0'),
           'reservation_id', 'rsv_' || lpad(:k::text, 26, '0'),
           'activity_id', 1, 'sku_id', 1, 'user_id', :uid::bigint,
           'status', 'CREATED', 'aggregate_version', 1,
           'expires_at', now() + interval '15 minutes', 'occurred_at', now(),
           'traceparent', '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01'),
       NULL, now(), 1, now()
UNION ALL
SELECT 'ord_' || lpad(:k::text, 26, '0') || '.CANCEL_IF_UNPAID', 'seckill-order-timeout',
       'CANCEL_IF_UNPAID', 'ord_' || lpad(:k::text, 26, '0'), 'ord_' || lpad(:k::text, 26, '0'), NULL,
       jsonb_build_object(
           'schema_version', 1, 'event_type', 'CANCEL_ORDER_IF_UNPAID',
           'event_id', 'ord_' || lpad(:k::text, 26, '0') || '.CANCEL_IF_UNPAID',
           'order_id', 'ord_' || lpad(:k::text, 26, '0'), 'activity_id', 1, 'sku_id', 1,
           'expires_at', now() + interval '15 minutes',
           'traceparent', '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01'),
       now() + interval '15 minutes', now() + interval '15 minutes' - interval '60 seconds', 1,
       now()
ON CONFLICT (activity_id, event_id, id_at) DO NOTHING;
NOTIFY seckill_limits_outbox;
\endpipeline
\startpipeline
UPDATE seckill_limits.stock_buckets SET remaining_stock = remaining_stock - 1, updated_at = now()
 WHERE activity_id = 1 AND sku_id = 1 AND bucket = 0 AND remaining_stock >= 1
RETURNING remaining_stock;
INSERT INTO seckill_limits.order_commits (xact_id, orders) VALUES (pg_current_xact_id(), 1);
\endpipeline
COMMIT;
