-- An order's created_at is the wall clock when its row is written, not the start of its
-- transaction (now()): created_at - reserved_at, the pipeline latency the bench reports,
-- then includes the transaction's work up to the order insert, batching waits included.
-- The rest of the transaction (outcome rows, the stock decrement and the commit) is not in
-- it (docs/ARCHITECTURE.md#postgresql-schema).
ALTER TABLE orders ALTER COLUMN created_at SET DEFAULT clock_timestamp();
