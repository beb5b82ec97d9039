//! The invariants (docs/architecture/invariants.md#invariants), checked from PostgreSQL's books
//! (`pg::books`) and Redis reads.
//! Used by `seckill-bench load`, the demo and the integration tests; a violation is a bug,
//! never noise.

use serde::Serialize;
use tokio_postgres::GenericClient;

use crate::pg::books;
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
    let b = books::sku_books(pg, activity_id, sku_id)
        .await?
        .ok_or_else(|| anyhow::anyhow!("activity {activity_id} SKU {sku_id} not in PostgreSQL"))?;
    Ok(SkuFigures {
        activity_id,
        sku_id,
        pg_total: b.total,
        pg_remaining: b.remaining,
        valid_orders: b.valid_orders,
        ledger_sum: b.ledger_sum,
        rejected: b.rejected,
        pending_compensations: b.pending_compensations,
        quarantined: books::quarantined(pg, consumer_group).await?,
        ..Default::default()
    })
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
    for (user_id, n) in books::buyers_with_several_orders(pg, f.activity_id, f.sku_id).await? {
        v.push(format!("buyer {user_id} holds {n} valid orders"));
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
    // 3. each order is the effect of exactly one message of the group, with one ledger debit.
    let wrong =
        books::orders_without_one_effect(pg, f.activity_id, f.sku_id, consumer_group).await?;
    for (order_id, effects, debits) in wrong {
        v.push(format!(
            "order {order_id}: {effects} creating messages, {debits} ledger debits (want 1 and 1)"
        ));
    }
    let stuck = books::inbox_processing(pg, consumer_group).await?;
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
    let paid_canceled = books::paid_and_canceled(pg, f.activity_id, f.sku_id).await?;
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
    // ... and per stock bucket (docs/architecture/redis.md#stock-buckets): each row's units taken
    // and given back are its own ledger entries, and each valid order's unit is its bucket's.
    for (bucket, total, remaining, ledger, orders) in
        books::bucket_books(pg, f.activity_id, f.sku_id).await?
    {
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
    let buckets = redis.moves().bucket_stock(activity_id, sku_id).await?;
    if buckets.buckets.is_empty() {
        v.push("Redis has no stock for this SKU".to_string());
    } else {
        f.redis_total = buckets.total();
        f.redis_remaining = buckets.remaining() + buckets.in_transit;
    }
    let census = redis
        .stock()
        .reservation_census(activity_id, sku_id)
        .await?;
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
    let recorded = if census.reserved_ids.is_empty() {
        0
    } else {
        books::recorded_count(pg, &census.reserved_ids).await?
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
