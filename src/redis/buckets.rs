//! Stock buckets in Redis (docs/architecture/redis.md#stock-buckets): what a split SKU holds bucket
//! by bucket, and the crash-safe move of leftovers between two buckets
//! (docs/architecture/redis.md#moving-leftovers). A move is three steps on two shards, each one
//! idempotent under the move's transfer id: debit the source and record the move as open
//! (`transfer_out.lua`), credit the target once (`transfer_in.lua`), close the move at the
//! source. A crash between two steps leaves the move open, and whoever resumes it repeats the
//! last two steps: the units are never credited twice, and never lost.

use deadpool_redis::redis::{self, AsyncCommands};

use super::{Moves, Shard, StoreError};

/// One bucket of a split SKU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BucketStock {
    pub bucket: u16,
    /// The bucket's share of the SKU's stock, as warmed.
    pub total: i64,
    pub remaining: i64,
    /// Units moved in and out by the rebalancer, ever.
    pub moved_in: i64,
    pub moved_out: i64,
    /// Buyers the bucket refused SOLD_OUT, ever, and as of its last credit.
    pub refused: i64,
    pub refused_seen: i64,
}

impl BucketStock {
    /// Out of stock and refusing buyers since its last credit: it wants leftovers.
    pub fn wants_units(&self) -> bool {
        self.remaining <= 0 && self.refused > self.refused_seen
    }
}

/// A SKU's stock over its buckets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SkuBuckets {
    pub buckets: Vec<BucketStock>,
    /// Units debited from a bucket and not yet credited to another (an open move).
    pub in_transit: i64,
}

impl SkuBuckets {
    pub fn total(&self) -> i64 {
        self.buckets.iter().map(|b| b.total).sum()
    }
    pub fn remaining(&self) -> i64 {
        self.buckets.iter().map(|b| b.remaining).sum()
    }
}

/// A move debited at its source and not yet closed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenTransfer {
    pub transfer_id: String,
    pub from: u16,
    pub to: u16,
    pub units: i64,
}

impl Moves<'_> {
    /// The SKUs warmed into an activity.
    pub async fn skus(&self, activity_id: i64) -> Result<Vec<i64>, StoreError> {
        let mut conn = self.pool.get().await?;
        let mut skus: Vec<i64> = conn.smembers(self.keys.skus(activity_id)).await?;
        skus.sort_unstable();
        Ok(skus)
    }

    /// One SKU's stock bucket by bucket, and the units debited from one bucket and not yet
    /// credited to another (docs/architecture/redis.md#moving-leftovers). Empty when not warmed.
    pub async fn bucket_stock(
        &self,
        activity_id: i64,
        sku_id: i64,
    ) -> Result<SkuBuckets, StoreError> {
        let shards = self.shards(activity_id).await?;
        let mut conn = self.pool.get().await?;
        let mut out = SkuBuckets::default();
        for shard in &shards {
            let v: Vec<Option<i64>> = redis::cmd("HMGET")
                .arg(self.keys.sku(*shard, sku_id))
                .arg(&[
                    "total",
                    "remaining",
                    "moved_in",
                    "moved_out",
                    "refused",
                    "refused_seen",
                ])
                .query_async(&mut *conn)
                .await?;
            let field = |i: usize| v.get(i).copied().flatten();
            let (Some(total), Some(remaining)) = (field(0), field(1)) else {
                continue;
            };
            out.buckets.push(BucketStock {
                bucket: shard.bucket,
                total,
                remaining,
                moved_in: field(2).unwrap_or(0),
                moved_out: field(3).unwrap_or(0),
                refused: field(4).unwrap_or(0),
                refused_seen: field(5).unwrap_or(0),
            });
        }
        if shards.len() > 1 {
            let k = shards.len() as u16;
            for t in self.open_transfers(activity_id, sku_id).await? {
                let credited: bool = conn
                    .hexists(
                        self.keys
                            .transfers_in(Shard::new(activity_id, t.to, k), sku_id),
                        &t.transfer_id,
                    )
                    .await?;
                if !credited {
                    out.in_transit += t.units;
                }
            }
        }
        Ok(out)
    }

    /// Step 1: debits up to `want` units of `sku_id` from `from` for bucket `to` under
    /// `transfer_id`; the units debited (the same on a repeat).
    pub async fn transfer_out(
        &self,
        from: Shard,
        sku_id: i64,
        transfer_id: &str,
        want: i64,
        to: u16,
        now_ms: i64,
    ) -> Result<i64, StoreError> {
        let k = &self.keys;
        let mut conn = self.pool.get().await?;
        Ok(self
            .scripts
            .transfer_out
            .call()
            .key("sku", k.sku(from, sku_id))
            .key("transfers_out", k.transfers_out(from, sku_id))
            .key("open", k.transfers_open(from, sku_id))
            .key("rebuilding", k.rebuilding(from))
            .arg("transfer_id", transfer_id)
            .arg("want", want)
            .arg("to", to)
            .arg("now_ms", now_ms)
            .invoke_async(&mut *conn)
            .await?)
    }

    /// Step 2: credits the transfer's units to its target once; `true` when credited now.
    pub async fn transfer_in(
        &self,
        activity_id: i64,
        sku_id: i64,
        t: &OpenTransfer,
        now_ms: i64,
    ) -> Result<bool, StoreError> {
        let k = &self.keys;
        let to = Shard::new(activity_id, t.to, self.buckets(activity_id).await?);
        let mut conn = self.pool.get().await?;
        let credited: i64 = self
            .scripts
            .transfer_in
            .call()
            .key("sku", k.sku(to, sku_id))
            .key("transfers_in", k.transfers_in(to, sku_id))
            .key("rebuilding", k.rebuilding(to))
            .arg("transfer_id", &t.transfer_id)
            .arg("units", t.units)
            .arg("from", t.from)
            .arg("now_ms", now_ms)
            .invoke_async(&mut *conn)
            .await?;
        if credited < 0 {
            // Left open: the next pass credits it, after the rebuild.
            return Err(StoreError::Held(format!(
                "transfer {} to bucket {}",
                t.transfer_id, t.to
            )));
        }
        Ok(credited == 1)
    }

    /// Step 3: the move is closed at its source (its trail entry stays).
    pub async fn close_transfer(
        &self,
        activity_id: i64,
        sku_id: i64,
        t: &OpenTransfer,
    ) -> Result<(), StoreError> {
        let mut conn = self.pool.get().await?;
        let from = Shard::new(activity_id, t.from, self.buckets(activity_id).await?);
        let _: i64 = conn
            .zrem(self.keys.transfers_open(from, sku_id), &t.transfer_id)
            .await?;
        Ok(())
    }

    /// Every open move of a SKU, over its buckets, oldest first per bucket.
    pub async fn open_transfers(
        &self,
        activity_id: i64,
        sku_id: i64,
    ) -> Result<Vec<OpenTransfer>, StoreError> {
        let mut conn = self.pool.get().await?;
        let mut out = Vec::new();
        for shard in self.shards(activity_id).await? {
            let ids: Vec<String> = conn
                .zrange(self.keys.transfers_open(shard, sku_id), 0, -1)
                .await?;
            if ids.is_empty() {
                continue;
            }
            let records: Vec<Option<String>> = redis::cmd("HMGET")
                .arg(self.keys.transfers_out(shard, sku_id))
                .arg(&ids)
                .query_async(&mut *conn)
                .await?;
            for (id, record) in ids.into_iter().zip(records) {
                // "<to> <units> <ms>", as transfer_out.lua writes it.
                let parsed = record.as_deref().and_then(|r| {
                    let mut f = r.split(' ');
                    Some((f.next()?.parse().ok()?, f.next()?.parse().ok()?))
                });
                match parsed {
                    Some((to, units)) => out.push(OpenTransfer {
                        transfer_id: id,
                        from: shard.bucket,
                        to,
                        units,
                    }),
                    None => {
                        return Err(StoreError::unexpected(format!(
                            "activity {activity_id} bucket {} SKU {sku_id}: open transfer {id} has no readable trail ({record:?})",
                            shard.bucket
                        )))
                    }
                }
            }
        }
        Ok(out)
    }

    /// One rebalancer at a time per SKU: `true` when `owner` holds the lease for `ms` (taken
    /// now, or already its own and extended).
    pub async fn rebalance_lease(
        &self,
        activity_id: i64,
        sku_id: i64,
        owner: &str,
        ms: u64,
    ) -> Result<bool, StoreError> {
        let key = self.keys.rebalance_lease(activity_id, sku_id);
        let mut conn = self.pool.get().await?;
        let set: Option<String> = redis::cmd("SET")
            .arg(&key)
            .arg(owner)
            .arg("NX")
            .arg("PX")
            .arg(ms)
            .query_async(&mut *conn)
            .await?;
        if set.is_some() {
            return Ok(true);
        }
        // Already ours: extended. (Should it expire in between and another take it, both
        // rebalance once: a move only ever debits what is there, so that is harmless.)
        let held: Option<String> = conn.get(&key).await?;
        if held.as_deref() != Some(owner) {
            return Ok(false);
        }
        let _: bool = conn.pexpire(&key, ms as i64).await?;
        Ok(true)
    }
}
