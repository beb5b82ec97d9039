-- Stock buckets (docs/ARCHITECTURE.md#stock-buckets): a hot SKU's final stock can be split into
-- several rows, so that order transactions of one SKU decrement different rows side by side
-- instead of queueing on one row lock. Every SKU has at least one bucket (bucket 0); an
-- activity created with stock_buckets = K has K per SKU, each with its share of the stock
-- (an even split, the first total % K one more: the same split as Redis's buckets).
--
-- The final stock moves here from activity_skus.remaining_stock, which is dropped: the view
-- sku_stock gives a SKU's total and remaining over its buckets.
ALTER TABLE activities ADD COLUMN stock_buckets SMALLINT NOT NULL DEFAULT 1
    CHECK (stock_buckets BETWEEN 1 AND 64);

CREATE TABLE stock_buckets (
    activity_id      BIGINT   NOT NULL,
    sku_id           BIGINT   NOT NULL,
    bucket           SMALLINT NOT NULL CHECK (bucket >= 0 AND bucket < 64),
    total_stock      INTEGER  NOT NULL CHECK (total_stock >= 0),
    -- the row an order decrements conditionally: its own bucket's, or another with stock left
    remaining_stock  INTEGER  NOT NULL CHECK (remaining_stock >= 0),
    updated_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (activity_id, sku_id, bucket),
    FOREIGN KEY (activity_id, sku_id) REFERENCES activity_skus (activity_id, sku_id),
    CHECK (remaining_stock <= total_stock)
);
INSERT INTO stock_buckets (activity_id, sku_id, bucket, total_stock, remaining_stock, updated_at)
    SELECT activity_id, sku_id, 0, total_stock, remaining_stock, updated_at FROM activity_skus;
ALTER TABLE activity_skus DROP COLUMN remaining_stock;

-- The bucket row an order took its unit from: a cancel gives it back there.
ALTER TABLE orders ADD COLUMN stock_bucket SMALLINT NOT NULL DEFAULT 0;
ALTER TABLE stock_ledger ADD COLUMN bucket SMALLINT NOT NULL DEFAULT 0;

CREATE VIEW sku_stock AS
    SELECT activity_id, sku_id, sum(total_stock)::int8 AS total_stock,
           sum(remaining_stock)::int8 AS remaining_stock, count(*)::int4 AS buckets
    FROM stock_buckets GROUP BY activity_id, sku_id;
