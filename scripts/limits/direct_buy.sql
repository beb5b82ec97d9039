-- scripts/limits.sh, measurement 4: the naive baseline, buying straight from PostgreSQL.
-- One transaction per request: decrement the stock row if any is left and, when a row came
-- back, insert the order. With stock 0 every request is a "sold out" answer from the UPDATE
-- finding no row (no row lock, no write).
-- \aset sets no variable when no row comes back, hence the -1 preset.
\set uid random(1, 1000000000)
\set remaining -1
BEGIN;
UPDATE seckill_limits.stock SET remaining = remaining - 1
 WHERE id = 1 AND remaining > 0
RETURNING remaining \aset
\if :remaining >= 0
INSERT INTO seckill_limits.direct_orders (stock_id, user_id) VALUES (1, :uid);
\endif
COMMIT;
