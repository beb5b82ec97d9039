//! The invariants (docs/ARCHITECTURE.md#invariants), checked with plain SQL and Redis reads.
//! Used by `seckill-bench load`, the demo and the integration tests; a violation is a bug,
//! never noise.

use serde::Serialize;
use tokio_postgres::GenericClient;

use crate::redis::RedisStore;

/// The figures of one activity SKU that the invariants relate.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SkuFigures {
    pub activity_id: i64,
    pub sku_id: i64,
    pub pg_total: i64,
    pub pg_remaining: i64,
    pub valid_orders: i64,
    pub ledger_sum: i64,
    pub rejected: i64,
    pub pending_compensations: i64,
    pub redis_total: i64,
    pub redis_remaining: i64,
    /// Redis reservations still holding stock.
    pub redis_reserved: i64,
    /// Of those, the ones PostgreSQL has not recorded yet (in flight; 0 once drained).
    pub unrecorded: i64,
    pub quarantined: i64,
}

impl SkuFigures {
    /// Adds another SKU's figures (for a report over several SKUs; ids stay the first's).
    pub fn add(&mut self, o: &SkuFigures) {
        self.pg_total += o.pg_total;
        self.pg_remaining += o.pg_remaining;
        self.valid_orders += o.valid_orders;
        self.ledger_sum += o.ledger_sum;
        self.rejected += o.rejected;
        self.pending_compensations += o.pending_compensations;
        self.redis_total += o.redis_total;
        self.redis_remaining += o.redis_remaining;
        self.redis_reserved += o.redis_reserved;
        self.unrecorded += o.unrecorded;
        // Quarantine is counted per consumer group, not per SKU: the same figure each time.
        self.quarantined = self.quarantined.max(o.quarantined);
    }
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    pub figures: SkuFigures,
    pub violations: Vec<String>,
}

impl Report {
    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }
}

/// Checks invariants 1, 2, 3, 5 and 6 for one activity SKU (4, one compensation per
/// reservation, is the unique key of `compensation_tasks` plus the Redis conservation below).
pub async fn check(
    pg: &impl GenericClient,
    redis: &RedisStore,
    consumer_group: &str,
    activity_id: i64,
    sku_id: i64,
) -> anyhow::Result<Report> {
    let mut v: Vec<String> = Vec::new();
    let mut f = pg_figures(pg, consumer_group, activity_id, sku_id).await?;
    check_postgresql(pg, &f, consumer_group, &mut v).await?;
    check_redis(pg, redis, &mut f, &mut v).await?;
    Ok(Report {
        figures: f,
        violations: v,
    })
}

/// The SKU's figures as PostgreSQL has them.
async fn pg_figures(
    pg: &impl GenericClient,
    consumer_group: &str,
    activity_id: i64,
    sku_id: i64,
) -> anyhow::Result<SkuFigures> {
    let mut f = SkuFigures {
        activity_id,
        sku_id,
        ..Default::default()
    };
    let row = pg
        .query_opt(
            "SELECT total_stock, remaining_stock FROM sku_stock
             WHERE activity_id = $1 AND sku_id = $2",
            &[&activity_id, &sku_id],
        )
        .await?
        .ok_or_else(|| anyhow::anyhow!("activity {activity_id} SKU {sku_id} not in PostgreSQL"))?;
    f.pg_total = row.get(0);
    f.pg_remaining = row.get(1);
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
    f.valid_orders = row.get(0);
    f.ledger_sum = row.get(1);
    f.rejected = row.get(2);
    f.pending_compensations = row.get(3);
    f.quarantined = pg
        .query_one(
            "SELECT count(*) FROM quarantined_messages WHERE consumer_group = $1 AND status = 'QUARANTINED'",
            &[&consumer_group],
        )
        .await?
        .get(0);

    Ok(f)
}

/// Invariants 1, 2, 3 and 5, and conservation within PostgreSQL.
async fn check_postgresql(
    pg: &impl GenericClient,
    f: &SkuFigures,
    consumer_group: &str,
    v: &mut Vec<String>,
) -> anyhow::Result<()> {
    stock_figures(f, v);
    one_valid_order_per_buyer(pg, f, v).await?;
    one_effect_per_order(pg, f, consumer_group, v).await?;
    paid_never_canceled(pg, f, v).await?;
    conserved_per_bucket(pg, f, v).await
}

/// Invariants 1 and 6 from the SKU's figures: not oversold; total = remaining + valid orders,
/// and the ledger sums to remaining - total.
fn stock_figures(f: &SkuFigures, v: &mut Vec<String>) {
    // 1. valid orders <= initial final stock.
    if f.valid_orders > f.pg_total {
        v.push(format!(
            "oversold: {} valid orders for a stock of {}",
            f.valid_orders, f.pg_total
        ));
    }
    // 6. conservation, within PostgreSQL ...
    if f.pg_total != f.pg_remaining + f.valid_orders {
        v.push(format!(
            "PostgreSQL: total {} != remaining {} + valid orders {}",
            f.pg_total, f.pg_remaining, f.valid_orders
        ));
    }
    if f.ledger_sum != f.pg_remaining - f.pg_total {
        v.push(format!(
            "ledger sums to {} but remaining - total = {}",
            f.ledger_sum,
            f.pg_remaining - f.pg_total
        ));
    }
}

/// Invariant 2: at most one valid order per buyer.
async fn one_valid_order_per_buyer(
    pg: &impl GenericClient,
    f: &SkuFigures,
    v: &mut Vec<String>,
) -> anyhow::Result<()> {
    let (activity_id, sku_id) = (f.activity_id, f.sku_id);
    for row in pg
        .query(
            "SELECT user_id, count(*) FROM orders
             WHERE activity_id = $1 AND sku_id = $2 AND status <> 'CANCELED'
             GROUP BY user_id HAVING count(*) > 1 LIMIT 20",
            &[&activity_id, &sku_id],
        )
        .await?
    {
        v.push(format!(
            "buyer {} holds {} valid orders",
            row.get::<_, i64>(0),
            row.get::<_, i64>(1)
        ));
    }
    Ok(())
}

/// Invariant 3: each order is the effect of exactly one message of the group, with one ledger
/// debit; no inbox row left PROCESSING.
async fn one_effect_per_order(
    pg: &impl GenericClient,
    f: &SkuFigures,
    consumer_group: &str,
    v: &mut Vec<String>,
) -> anyhow::Result<()> {
    let (activity_id, sku_id) = (f.activity_id, f.sku_id);
    // 3. each order is the effect of exactly one message of the group, with one ledger debit.
    //    One aggregate over a union, no join: its cost stays linear whatever the planner
    //    believes about the tables' sizes (with stale statistics a join of aggregates became
    //    a nested loop re-sorting the ledger once per order: minutes for 30,000 orders).
    //    An order older than the inbox's retention mark (plus a minute: its inbox row was
    //    written a moment before it) may have lost its inbox row to retention: none is then
    //    fine, two never are.
    for row in pg
        .query(
            "SELECT order_id, sum(effect)::int8, sum(debit)::int8 FROM (
               SELECT order_id, 1 AS is_order, 0 AS effect, 0 AS debit, created_at FROM orders
               WHERE activity_id = $1 AND sku_id = $2
               UNION ALL
               SELECT order_id, 0, 1, 0, NULL FROM consumer_inbox
               WHERE consumer_group = $3 AND decision = 'CREATED'
               UNION ALL
               SELECT order_id, 0, 0, 1, NULL FROM stock_ledger
               WHERE activity_id = $1 AND sku_id = $2 AND reason = 'ORDER_CREATED'
             ) u
             GROUP BY order_id
             HAVING max(is_order) = 1
                AND (sum(effect) > 1 OR sum(debit) <> 1
                     OR (sum(effect) = 0 AND max(created_at) >= coalesce(
                           (SELECT purged_before + interval '1 minute' FROM retention_marks
                            WHERE table_name = 'consumer_inbox'), '-infinity')))
             LIMIT 50",
            &[&activity_id, &sku_id, &consumer_group],
        )
        .await?
    {
        let (order_id, effects, debits): (String, i64, i64) = (row.get(0), row.get(1), row.get(2));
        v.push(format!(
            "order {order_id}: {effects} creating messages, {debits} ledger debits (want 1 and 1)"
        ));
    }
    let stuck: i64 = pg
        .query_one(
            "SELECT count(*) FROM consumer_inbox WHERE consumer_group = $1 AND status = 'PROCESSING'",
            &[&consumer_group],
        )
        .await?
        .get(0);
    if stuck > 0 {
        v.push(format!("{stuck} inbox rows left PROCESSING after commit"));
    }
    Ok(())
}

/// Invariant 5: a paid order is never cancelled (nor its unit given back).
async fn paid_never_canceled(
    pg: &impl GenericClient,
    f: &SkuFigures,
    v: &mut Vec<String>,
) -> anyhow::Result<()> {
    let (activity_id, sku_id) = (f.activity_id, f.sku_id);
    let paid_canceled: i64 = pg
        .query_one(
            "SELECT count(*) FROM orders o
             WHERE o.activity_id = $1 AND o.sku_id = $2 AND o.paid_at IS NOT NULL
               AND (o.status = 'CANCELED' OR EXISTS (SELECT 1 FROM stock_ledger l
                      WHERE l.order_id = o.order_id AND l.reason = 'ORDER_CANCELED'))",
            &[&activity_id, &sku_id],
        )
        .await?
        .get(0);
    if paid_canceled > 0 {
        v.push(format!("{paid_canceled} paid orders were cancelled"));
    }
    Ok(())
}

/// Invariant 6 per stock bucket.
async fn conserved_per_bucket(
    pg: &impl GenericClient,
    f: &SkuFigures,
    v: &mut Vec<String>,
) -> anyhow::Result<()> {
    let (activity_id, sku_id) = (f.activity_id, f.sku_id);
    // ... and per stock bucket (docs/ARCHITECTURE.md#stock-buckets): each row's units taken and
    // given back are its own ledger entries, and each valid order's unit is its bucket's.
    for row in pg
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
    {
        let (bucket, total, remaining, ledger, orders): (i16, i64, i64, i64, i64) =
            (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
        if ledger != remaining - total || total != remaining + orders {
            v.push(format!(
                "bucket {bucket}: total {total}, remaining {remaining}, ledger {ledger}, valid orders {orders}"
            ));
        }
    }
    Ok(())
}

/// Conservation within Redis, and between Redis and PostgreSQL.
async fn check_redis(
    pg: &impl GenericClient,
    redis: &RedisStore,
    f: &mut SkuFigures,
    v: &mut Vec<String>,
) -> anyhow::Result<()> {
    let (activity_id, sku_id) = (f.activity_id, f.sku_id);
    // ... within Redis ...
    // One read of the SKU's buckets serves the whole-SKU figures and the per-bucket check.
    let buckets = redis.bucket_stock(activity_id, sku_id).await?;
    if buckets.buckets.is_empty() {
        v.push("Redis has no stock for this SKU".to_string());
    } else {
        f.redis_total = buckets.total();
        f.redis_remaining = buckets.remaining() + buckets.in_transit;
    }
    let census = redis.reservation_census(activity_id, sku_id).await?;
    f.redis_reserved = census.reserved_ids.len() as i64;
    if f.redis_total != f.pg_total {
        v.push(format!(
            "Redis total {} != PostgreSQL total {}",
            f.redis_total, f.pg_total
        ));
    }
    if f.redis_remaining < 0 {
        v.push(format!(
            "Redis remaining is negative: {}",
            f.redis_remaining
        ));
    }
    if f.redis_total != f.redis_remaining + f.redis_reserved {
        v.push(format!(
            "Redis: total {} != remaining {} + live reservations {}",
            f.redis_total, f.redis_remaining, f.redis_reserved
        ));
    }
    // Per bucket: its share, plus what moved in, minus what moved out, is what it holds.
    if buckets.buckets.len() > 1 {
        let mut held: std::collections::HashMap<u16, i64> = Default::default();
        for rid in &census.reserved_ids {
            *held
                .entry(crate::domain::ids::reservation_bucket(rid))
                .or_default() += 1;
        }
        for b in &buckets.buckets {
            let holds = b.remaining + held.get(&b.bucket).copied().unwrap_or(0);
            if b.total + b.moved_in - b.moved_out != holds {
                v.push(format!(
                    "Redis bucket {}: share {} + moved in {} - moved out {} != remaining {} + live reservations {}",
                    b.bucket,
                    b.total,
                    b.moved_in,
                    b.moved_out,
                    b.remaining,
                    holds - b.remaining
                ));
            }
        }
    }
    // ... and between the two: every live Redis reservation is either still in flight, an
    // order, or a rejection whose compensation has not run yet.
    let recorded: i64 = if census.reserved_ids.is_empty() {
        0
    } else {
        pg.query_one(
            "SELECT count(*) FROM reservations WHERE reservation_id = ANY($1::text[])",
            &[&census.reserved_ids],
        )
        .await?
        .get(0)
    };
    f.unrecorded = f.redis_reserved - recorded;
    if recorded != f.valid_orders + f.pending_compensations {
        v.push(format!(
            "Redis holds {recorded} recorded reservations but PostgreSQL has {} valid orders + {} pending compensations",
            f.valid_orders, f.pending_compensations
        ));
    }
    Ok(())
}
