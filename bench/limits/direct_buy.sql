-- bench/limits/limits.sh, measurement 4: the naive baseline, buying straight from PostgreSQL, in
-- its best naive form: ONE autocommit statement per request (no BEGIN/COMMIT round trips,
-- the row lock held for that statement and its commit only). It decrements the stock row if
-- any is left and inserts the order from the row that came back; with stock 0 the UPDATE finds
-- no row (no lock, no write) and the statement is the "sold out" answer. bench/src/baseline.rs
-- serves the same statement over HTTP.
\set uid random(1, 1000000000)
WITH take AS (
    UPDATE seckill_limits.stock SET remaining = remaining - 1
     WHERE id = 1 AND remaining > 0
    RETURNING id)
INSERT INTO seckill_limits.direct_orders (stock_id, user_id)
SELECT id, :uid FROM take;
