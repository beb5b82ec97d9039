//! Steps 5 and 7 of the order transaction: take each order's unit from its stock row
//! (optimistically, else under the row lock, falling back to the SKU's other buckets) and
//! stamp the commit. The hot row is locked as late as possible. `steps()` (the parent) orders
//! them around step 6 on each path.

use std::collections::{BTreeMap, HashMap};

use tokio_postgres::types::{ToSql, Type};

use super::rows::home_bucket;
use super::{Batch, Tx};
use crate::domain::RejectReason;
use crate::pg::rows::Returned;
use crate::pg::statements::{exec_unless_empty, Sql};

/// One stock row: activity, SKU, bucket (docs/architecture/redis.md#stock-buckets).
type StockKey = (i64, i64, i16);

/// A SKU's orders by their home bucket.
type BucketGroups<'a> = Vec<(i16, &'a [usize])>;

/// The inserted orders by stock row (activity, SKU, the reservation's bucket), in key order
/// (the order stock rows are locked in).
pub(super) fn group_by_sku(
    b: &Batch<'_>,
    eligible: &[usize],
    inserted: &Returned,
) -> BTreeMap<StockKey, Vec<usize>> {
    let mut per_row: BTreeMap<StockKey, Vec<usize>> = BTreeMap::new();
    for &i in eligible {
        let e = b.ev(i);
        if inserted.contains(&e.order_id) {
            per_row
                .entry((e.activity_id, e.sku_id, home_bucket(e)))
                .or_default()
                .push(i);
        }
    }
    per_row
}

/// Step 5, optimistic, its first half: whether an unlocked read shows enough stock in every
/// stock row of the batch (each order's home bucket), with a savepoint taken beside the read.
/// `Some(every order)` when it does: step 6 then writes every outcome as if all were granted,
/// and [`take_and_stamp`] decrements. The hot row's lock is what serialises the sale, so it is
/// taken last and held for the decrement and the commit only; with stock buckets, K such rows
/// let K transactions of one SKU commit side by side. `None`: the locked path decides.
pub(super) async fn enough_unlocked(
    tx: &Tx<'_>,
    per_row: &BTreeMap<StockKey, Vec<usize>>,
) -> Result<Option<Vec<usize>>, tokio_postgres::Error> {
    if per_row.is_empty() {
        return Ok(None);
    }
    let a: Vec<i64> = per_row.keys().map(|k| k.0).collect();
    let s: Vec<i64> = per_row.keys().map(|k| k.1).collect();
    let k: Vec<i16> = per_row.keys().map(|k| k.2).collect();
    let peek = tx
        .prepare_cached(
            "SELECT k.activity_id, k.sku_id, k.bucket, k.remaining_stock::int8
             FROM unnest($1::int8[], $2::int8[], $3::int2[]) AS t(a, s, b)
             JOIN stock_buckets k ON k.activity_id = t.a AND k.sku_id = t.s AND k.bucket = t.b",
        )
        .await?;
    let peek_params: [&(dyn ToSql + Sync); 3] = [&a, &s, &k];
    let (sp, rows) = futures::join!(
        tx.batch_execute("SAVEPOINT stock"),
        tx.query(&peek, &peek_params)
    );
    sp?;
    let left: HashMap<StockKey, i64> = rows?
        .into_iter()
        .map(|r| ((r.get(0), r.get(1), r.get(2)), r.get(3)))
        .collect();
    let enough = per_row
        .iter()
        .all(|(k, idxs)| left.get(k).copied().unwrap_or(0) >= idxs.len() as i64);
    if !enough {
        return Ok(None);
    }
    // Fault-injection point: another transaction may take the stock between the read above
    // and the decrement (tests/isolated/stock_fallback.rs takes it here), so the decrement
    // misses and the savepoint fallback decides.
    fail::fail_point!("order-tx-after-stock-peek");
    Ok(Some(per_row.values().flatten().copied().collect()))
}

/// Step 5, optimistic, its second half, with step 7: decrements each stock row conditionally
/// (`remaining_stock >= wanted`, re-checked by PostgreSQL on the latest row version), in key
/// order, and stamps the commit of `orders` orders. Whether every row had its units; if one
/// fell short meanwhile, everything since the savepoint is rolled back (step 6's rows too) and
/// the locked path decides.
pub(super) async fn take_and_stamp(
    tx: &Tx<'_>,
    per_row: &BTreeMap<StockKey, Vec<usize>>,
    orders: usize,
) -> Result<bool, tokio_postgres::Error> {
    let take = tx
        .prepare_cached(
            "UPDATE stock_buckets SET remaining_stock = remaining_stock - $4, updated_at = now()
             WHERE activity_id = $1 AND sku_id = $2 AND bucket = $3 AND remaining_stock >= $4
             RETURNING remaining_stock",
        )
        .await?;
    // One statement per stock row, pipelined: PostgreSQL runs them in key order (so two
    // batches never lock the same rows in opposite orders), in one round trip.
    let wants: Vec<i32> = per_row.values().map(|idxs| idxs.len() as i32).collect();
    let params: Vec<[&(dyn ToSql + Sync); 4]> = per_row
        .keys()
        .zip(&wants)
        .map(|((activity_id, sku_id, bucket), want)| {
            [activity_id as &(dyn ToSql + Sync), sku_id, bucket, want]
        })
        .collect();
    let takes = params.iter().map(|p| tx.query_opt(&take, p));
    // The commit stamp follows the decrements in the same round trip; if one misses, the
    // rollback to the savepoint takes the stamp with it and the locked path writes its own.
    let (takes, stamped) =
        futures::join!(futures::future::join_all(takes), stamp_commit(tx, orders));
    let mut granted_all = true;
    for taken in takes {
        granted_all &= taken?.is_some();
    }
    stamped?;
    if granted_all {
        return Ok(true);
    }
    metrics::counter!("order_tx_stock_fallback_total").increment(1);
    tx.batch_execute("ROLLBACK TO SAVEPOINT stock").await?;
    Ok(false)
}

/// Where the locked path takes each order's unit: its home bucket, else any bucket with
/// units left; orders left without one are surplus (rejected, their rows deleted).
#[derive(Default)]
struct Allocation {
    created: Vec<usize>,
    surplus: Vec<String>,
    /// Orders whose unit came from another bucket than their home one.
    moved: HashMap<usize, i16>,
}

impl Allocation {
    /// Grants one SKU's orders from `left` (units per bucket); returns (wanted, granted).
    fn grant(
        &mut self,
        b: &Batch<'_>,
        groups: &BucketGroups<'_>,
        left: &mut BTreeMap<i16, i32>,
        rejected: &mut Vec<(usize, RejectReason)>,
    ) -> (usize, usize) {
        let (mut want_total, mut granted_total) = (0usize, 0usize);
        for (home, idxs) in groups {
            want_total += idxs.len();
            for &i in idxs.iter() {
                let from = if left.get(home).is_some_and(|&n| n > 0) {
                    Some(*home)
                } else {
                    left.iter().find(|(_, &n)| n > 0).map(|(&k, _)| k)
                };
                match from {
                    Some(k) => {
                        *left.get_mut(&k).expect("a locked row") -= 1;
                        if k != *home {
                            self.moved.insert(i, k);
                        }
                        self.created.push(i);
                        granted_total += 1;
                    }
                    None => {
                        self.surplus.push(b.ev(i).order_id.clone());
                        rejected.push((i, RejectReason::NoStock));
                    }
                }
            }
        }
        (want_total, granted_total)
    }

    /// The surplus orders deleted, the moved ones pointed at the bucket their unit came from.
    async fn fix_orders(&self, tx: &Tx<'_>, b: &Batch<'_>) -> Result<(), tokio_postgres::Error> {
        // Not every batch's: planned for these ids (pg::Sql::PerRun).
        exec_unless_empty(
            tx,
            self.surplus.is_empty(),
            Sql::PerRun(
                "DELETE FROM orders WHERE order_id = ANY($1::text[])",
                &[Type::TEXT_ARRAY],
            ),
            [&self.surplus],
        )
        .await?;
        let moved_ids: Vec<&str> = self
            .moved
            .keys()
            .map(|&i| b.ev(i).order_id.as_str())
            .collect();
        let moved_buckets: Vec<i16> = self.moved.values().copied().collect();
        // Found with `= ANY` (an index scan even without statistics, where a join with
        // `unnest` may scan every partition), each one's bucket from the same position.
        exec_unless_empty(
            tx,
            self.moved.is_empty(),
            Sql::PerRun(
                "UPDATE orders SET stock_bucket = ($2::int2[])[array_position($1::text[], order_id)]
                 WHERE order_id = ANY($1::text[])",
                &[Type::TEXT_ARRAY, Type::INT2_ARRAY],
            ),
            [&moved_ids as &(dyn ToSql + Sync), &moved_buckets],
        )
        .await?;
        Ok(())
    }
}

/// Step 5, locked: per SKU, in key order (no deadlocks between batches), every stock row of
/// the SKU is locked in bucket order; each order takes its unit from its home bucket first,
/// then from the other buckets in bucket order (a bucket Redis moved leftovers into may sell
/// more units than its own row holds: docs/architecture/redis.md#moving-leftovers), granting at
/// most what is left. Surplus orders are removed and rejected NO_STOCK. The row lock is FOR NO
/// KEY UPDATE, like the decrement's (the orders' foreign-key checks hold FOR KEY SHARE on
/// the SKU's row). Returns the created indexes, and those whose unit came from another bucket
/// than their home one.
pub(super) async fn take_stock_locked(
    tx: &Tx<'_>,
    b: &Batch<'_>,
    per_row: &BTreeMap<StockKey, Vec<usize>>,
    rejected: &mut Vec<(usize, RejectReason)>,
) -> Result<(Vec<usize>, HashMap<usize, i16>), tokio_postgres::Error> {
    let mut per_sku: BTreeMap<(i64, i64), BucketGroups<'_>> = BTreeMap::new();
    for ((activity_id, sku_id, bucket), idxs) in per_row {
        per_sku
            .entry((*activity_id, *sku_id))
            .or_default()
            .push((*bucket, idxs.as_slice()));
    }
    let lock = tx
        .prepare_cached(
            "SELECT bucket, remaining_stock FROM stock_buckets
             WHERE activity_id = $1 AND sku_id = $2 ORDER BY bucket FOR NO KEY UPDATE",
        )
        .await?;
    let take = tx
        .prepare_cached(
            "UPDATE stock_buckets SET remaining_stock = remaining_stock - $4, updated_at = now()
             WHERE activity_id = $1 AND sku_id = $2 AND bucket = $3",
        )
        .await?;
    let mut a = Allocation::default();
    for ((activity_id, sku_id), groups) in &per_sku {
        let mut left: BTreeMap<i16, i32> = tx
            .query(&lock, &[activity_id, sku_id])
            .await?
            .into_iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        let before = left.clone();
        let (want_total, granted_total) = a.grant(b, groups, &mut left, rejected);
        if granted_total < want_total {
            metrics::counter!("inventory_condition_update_miss_total")
                .increment((want_total - granted_total) as u64);
        }
        let takes: Vec<(i16, i32)> = left
            .iter()
            .filter_map(|(k, n)| {
                let was = before[k];
                (was != *n).then_some((*k, was - n))
            })
            .collect();
        let params: Vec<[&(dyn ToSql + Sync); 4]> = takes
            .iter()
            .map(|(k, n)| [activity_id as &(dyn ToSql + Sync), sku_id, k, n])
            .collect();
        for r in futures::future::join_all(params.iter().map(|p| tx.execute(&take, p))).await {
            r?;
        }
    }
    a.fix_orders(tx, b).await?;
    let Allocation { created, moved, .. } = a;
    Ok((created, moved))
}

/// Step 7, the commit stamp: the transaction's last statement, after the hot row's decrement,
/// writes one `order_commits` row whose `committed_at` is `clock_timestamp()` at the end of the
/// transaction; each order it created carries the same `xact_id` (a column default), so
/// reservation-to-commit latency is a join (sql/V6__commit_stamp.sql). Only when orders were
/// created.
pub(super) async fn stamp_commit(tx: &Tx<'_>, orders: usize) -> Result<(), tokio_postgres::Error> {
    let stmt = tx
        .prepare_cached(
            "INSERT INTO order_commits (xact_id, orders) VALUES (pg_current_xact_id(), $1)",
        )
        .await?;
    tx.execute(&stmt, &[&(orders as i32)]).await?;
    Ok(())
}
