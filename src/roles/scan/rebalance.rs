//! Moving leftovers between stock buckets (docs/architecture/redis.md#moving-leftovers). A split
//! SKU's buyers each reserve in their home bucket only, so one bucket can sell out while
//! another still holds units nobody mapped to it asks for. Each scanner pass, for every split
//! SKU: first every open move is finished (a crash between its steps is resumed here, by
//! whichever scanner gets there), then, under a short lease so two scanners do not both
//! move, each bucket that is out of stock and has refused buyers since its last credit gets
//! half of the fullest bucket's remainder (at least one unit). Every move is a transfer id
//! with a trail on both sides; nothing is oversold, since a unit is only ever in one
//! bucket's `remaining`, or in transit.

use anyhow::Context as _;
use chrono::Utc;
use tracing::{info, warn};

use crate::redis::{OpenTransfer, RedisStore, Shard};

/// What one pass moved.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Moved {
    /// Moves made in this pass.
    pub moves: usize,
    pub units: i64,
    /// Open moves (left by a crash, or by a pass that failed midway) finished in this pass.
    pub resumed: usize,
}

/// How long one scanner holds a SKU's rebalance lease.
const LEASE_MS: u64 = 2_000;

/// One rebalance pass over the split SKUs of `activity_id`.
pub async fn rebalance(redis: &RedisStore, activity_id: i64, owner: &str) -> anyhow::Result<Moved> {
    let mut moved = Moved::default();
    let k = redis.buckets(activity_id).await?;
    if k <= 1 {
        return Ok(moved);
    }
    for sku_id in redis.moves().skus(activity_id).await? {
        for t in redis.moves().open_transfers(activity_id, sku_id).await? {
            finish(redis, activity_id, sku_id, &t).await?;
            moved.resumed += 1;
            metrics::counter!("stock_bucket_moves_resumed_total").increment(1);
            info!(activity_id, sku_id, transfer_id = %t.transfer_id, from = t.from, to = t.to,
                  units = t.units, "open leftover move finished");
        }
        let stock = redis.moves().bucket_stock(activity_id, sku_id).await?;
        if !stock.buckets.iter().any(|b| b.wants_units())
            || !stock.buckets.iter().any(|b| b.remaining > 0)
            || !redis
                .moves()
                .rebalance_lease(activity_id, sku_id, owner, LEASE_MS)
                .await?
        {
            continue;
        }
        let mut buckets = stock.buckets.clone();
        for needy in 0..buckets.len() {
            if !buckets[needy].wants_units() {
                continue;
            }
            let Some(donor) = (0..buckets.len())
                .filter(|&d| d != needy && buckets[d].remaining > 0)
                .max_by_key(|&d| buckets[d].remaining)
            else {
                break;
            };
            let want = (buckets[donor].remaining + 1) / 2;
            let transfer_id = format!("xfr_{}", ulid::Ulid::new());
            let from = Shard::new(activity_id, buckets[donor].bucket, k);
            let to = buckets[needy].bucket;
            let units = redis
                .moves()
                .transfer_out(
                    from,
                    sku_id,
                    &transfer_id,
                    want,
                    to,
                    Utc::now().timestamp_millis(),
                )
                .await?;
            if units <= 0 {
                continue;
            }
            // Fault-injection point: the scanner dies between the debit and the credit; the
            // move stays open and the next pass (this scanner's or another's) finishes it.
            fail::fail_point!("rebalance-after-debit", |_| Err(anyhow::anyhow!(
                "failpoint rebalance-after-debit: transfer {transfer_id} left open"
            )));
            let t = OpenTransfer {
                transfer_id,
                from: from.bucket,
                to,
                units,
            };
            finish(redis, activity_id, sku_id, &t).await?;
            buckets[donor].remaining -= units;
            buckets[needy].remaining += units;
            buckets[needy].refused_seen = buckets[needy].refused;
            moved.moves += 1;
            moved.units += units;
            metrics::counter!("stock_bucket_moves_total").increment(1);
            metrics::counter!("stock_bucket_moved_units_total").increment(units as u64);
            info!(activity_id, sku_id, transfer_id = %t.transfer_id, from = t.from, to = t.to,
                  units, "leftovers moved to a bucket that refused buyers");
        }
    }
    Ok(moved)
}

/// Steps 2 and 3 of a move: credit the target (once), close at the source.
async fn finish(
    redis: &RedisStore,
    activity_id: i64,
    sku_id: i64,
    t: &OpenTransfer,
) -> anyhow::Result<()> {
    let credited = redis
        .moves()
        .transfer_in(activity_id, sku_id, t, Utc::now().timestamp_millis())
        .await
        .with_context(|| format!("crediting transfer {}", t.transfer_id))?;
    if !credited {
        warn!(activity_id, sku_id, transfer_id = %t.transfer_id,
              "transfer already credited: closing it only");
    }
    Ok(redis.moves().close_transfer(activity_id, sku_id, t).await?)
}
