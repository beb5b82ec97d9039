//! The reads the invariants relate (src/invariants.rs, docs/architecture/invariants.md#invariants):
//! the figures of one activity SKU as PostgreSQL has them, and the rows that break a rule. Each is
//! one statement; none writes.

use tokio_postgres::{Error, GenericClient};

/// One activity SKU's stock, orders, ledger and rejections.
#[derive(Debug, Clone, Copy, Default)]
pub struct SkuBooks {
    pub total: i64,
    pub remaining: i64,
    pub valid_orders: i64,
    pub ledger_sum: i64,
    pub rejected: i64,
    pub pending_compensations: i64,
}

/// The SKU's books; `None` when PostgreSQL does not know the SKU.
pub async fn sku_books(
    pg: &impl GenericClient,
    activity_id: i64,
    sku_id: i64,
) -> Result<Option<SkuBooks>, Error> {
    let Some(stock) = pg
        .query_opt(
            "SELECT total_stock, remaining_stock FROM sku_stock
             WHERE activity_id = $1 AND sku_id = $2",
            &[&activity_id, &sku_id],
        )
        .await?
    else {
        return Ok(None);
    };
    let row = pg
        .query_one(
            "SELECT
               (SELECT count(*) FROM orders WHERE activity_id = $1 AND sku_id = $2 AND status <> 'CANCELED'),
               (SELECT coalesce(sum(delta), 0)::int8 FROM stock_ledger WHERE activity_id = $1 AND sku_id = $2),
               (SELECT count(*) FROM reservations WHERE activity_id = $1 AND sku_id = $2 AND status = 'REJECTED'),
               (SELECT count(*) FROM compensation_tasks WHERE activity_id = $1 AND sku_id = $2 AND status = 'PENDING')",
            &[&activity_id, &sku_id],
        )
        .await?;
    Ok(Some(SkuBooks {
        total: stock.get(0),
        remaining: stock.get(1),
        valid_orders: row.get(0),
        ledger_sum: row.get(1),
        rejected: row.get(2),
        pending_compensations: row.get(3),
    }))
}

/// Messages of the group quarantined and not yet replayed or discarded.
pub async fn quarantined(pg: &impl GenericClient, consumer_group: &str) -> Result<i64, Error> {
    Ok(pg
        .query_one(
            "SELECT count(*) FROM quarantined_messages WHERE consumer_group = $1 AND status = 'QUARANTINED'",
            &[&consumer_group],
        )
        .await?
        .get(0))
}

/// Buyers holding more than one valid order of the SKU: (user_id, orders), at most 20.
pub async fn buyers_with_several_orders(
    pg: &impl GenericClient,
    activity_id: i64,
    sku_id: i64,
) -> Result<Vec<(i64, i64)>, Error> {
    Ok(pg
        .query(
            "SELECT user_id, count(*) FROM orders
             WHERE activity_id = $1 AND sku_id = $2 AND status <> 'CANCELED'
             GROUP BY user_id HAVING count(*) > 1 LIMIT 20",
            &[&activity_id, &sku_id],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect())
}

/// Orders of the SKU that are not the effect of exactly one message of the group with one
/// ledger debit: (order_id, creating messages, debits), at most 50.
///
/// One aggregate over a union, no join: its cost stays linear whatever the planner believes
/// about the tables' sizes (with stale statistics a join of aggregates became a nested loop
/// re-sorting the ledger once per order: minutes for 30,000 orders). An order older than the
/// inbox's retention mark (plus a minute: its inbox row was written a moment before it) may
/// have lost its inbox row to retention: none is then fine, two never are.
pub async fn orders_without_one_effect(
    pg: &impl GenericClient,
    activity_id: i64,
    sku_id: i64,
    consumer_group: &str,
) -> Result<Vec<(String, i64, i64)>, Error> {
    Ok(pg
        .query(
            "SELECT order_id, sum(effect)::int8, sum(debit)::int8 FROM (
               SELECT order_id, 1 AS is_order, 0 AS effect, 0 AS debit, created_at FROM orders
               WHERE activity_id = $1 AND sku_id = $2
               UNION ALL
               SELECT order_id, 0, 1, 0, NULL FROM consumer_inbox_by_day
               WHERE consumer_group = $3 AND decision = 'CREATED'
               UNION ALL
               SELECT order_id, 0, 0, 1, NULL FROM stock_ledger
               WHERE activity_id = $1 AND sku_id = $2 AND reason = 'ORDER_CREATED'
             ) u
             GROUP BY order_id
             HAVING max(is_order) = 1
                AND (sum(effect) > 1 OR sum(debit) <> 1
                     OR (sum(effect) = 0 AND max(created_at) >= coalesce(
                           (SELECT max(purged_before) + interval '1 minute' FROM retention_marks
                            WHERE table_name IN ('consumer_inbox', 'consumer_inbox_by_day')),
                           '-infinity')))
             LIMIT 50",
            &[&activity_id, &sku_id, &consumer_group],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect())
}

/// Inbox rows of the group left PROCESSING (a committed transaction never leaves one).
pub async fn inbox_processing(pg: &impl GenericClient, consumer_group: &str) -> Result<i64, Error> {
    Ok(pg
        .query_one(
            "SELECT count(*) FROM consumer_inbox_by_day WHERE consumer_group = $1 AND status = 'PROCESSING'",
            &[&consumer_group],
        )
        .await?
        .get(0))
}

/// Paid orders of the SKU that were cancelled, or whose unit was given back.
pub async fn paid_and_canceled(
    pg: &impl GenericClient,
    activity_id: i64,
    sku_id: i64,
) -> Result<i64, Error> {
    Ok(pg
        .query_one(
            "SELECT count(*) FROM orders o
             WHERE o.activity_id = $1 AND o.sku_id = $2 AND o.paid_at IS NOT NULL
               AND (o.status = 'CANCELED' OR EXISTS (SELECT 1 FROM stock_ledger l
                      WHERE l.order_id = o.order_id AND l.reason = 'ORDER_CANCELED'))",
            &[&activity_id, &sku_id],
        )
        .await?
        .get(0))
}

/// One stock bucket's books: (bucket, total, remaining, ledger sum, valid orders).
pub type BucketBooks = (i16, i64, i64, i64, i64);

/// Each stock bucket's own books (docs/architecture/redis.md#stock-buckets), in bucket order.
pub async fn bucket_books(
    pg: &impl GenericClient,
    activity_id: i64,
    sku_id: i64,
) -> Result<Vec<BucketBooks>, Error> {
    Ok(pg
        .query(
            "SELECT b.bucket, b.total_stock::int8, b.remaining_stock::int8,
                    (SELECT coalesce(sum(delta), 0)::int8 FROM stock_ledger l
                     WHERE l.activity_id = b.activity_id AND l.sku_id = b.sku_id
                       AND l.bucket = b.bucket),
                    (SELECT count(*) FROM orders o
                     WHERE o.activity_id = b.activity_id AND o.sku_id = b.sku_id
                       AND o.stock_bucket = b.bucket AND o.status <> 'CANCELED')
             FROM stock_buckets b WHERE b.activity_id = $1 AND b.sku_id = $2
             ORDER BY b.bucket",
            &[&activity_id, &sku_id],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
        .collect())
}

/// How many of `reservation_ids` PostgreSQL recorded a decision for (ordered or rejected).
pub async fn recorded_count(
    pg: &impl GenericClient,
    reservation_ids: &[String],
) -> Result<i64, Error> {
    Ok(pg
        .query_one(
            "SELECT count(*) FROM reservations WHERE reservation_id = ANY($1::text[])",
            &[&reservation_ids],
        )
        .await?
        .get(0))
}
