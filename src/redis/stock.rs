//! Stock and the sale's switches: warming an activity, the sold-out view the API keeps in
//! memory, pause and resume, and the census the invariants read.

use crate::domain::status::HoldStatus;
use std::collections::HashMap;

use deadpool_redis::redis::{self, AsyncCommands};

use super::{Shard, Stock, StoreError};

/// Reservation hashes of one SKU by status.
#[derive(Debug, Clone, Default)]
pub struct Census {
    pub by_status: HashMap<String, i64>,
    /// Reservations still holding a unit of Redis stock.
    pub reserved_ids: Vec<String>,
}

/// Outcome of a warm call for one SKU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WarmResult {
    Created,
    Unchanged,
    Updated,
    StockInUse,
    /// The activity was warmed with another number of stock buckets: it cannot change.
    BucketsFixed {
        warmed: u16,
    },
}

/// One SKU as an API instance answering SOLD_OUT from memory sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SoldOutView {
    pub remaining: i64,
    /// Reservations ever made of the SKU (never decremented).
    pub taken: i64,
    /// The buyers holding a reservation, when `taken` was not the one asked with.
    pub winners: Option<Vec<i64>>,
}

impl WarmResult {
    /// What the warm script answered for one bucket.
    fn of_code(code: &str) -> Result<Self, StoreError> {
        Ok(match code {
            "CREATED" => WarmResult::Created,
            "UNCHANGED" => WarmResult::Unchanged,
            "UPDATED" => WarmResult::Updated,
            "STOCK_IN_USE" => WarmResult::StockInUse,
            other => {
                return Err(StoreError::unexpected(format!(
                    "warm script returned an unknown code {other:?}"
                )))
            }
        })
    }

    /// The SKU's result from its buckets': in use if one is, created or unchanged if all are.
    fn of_buckets(results: &[Self]) -> Self {
        if results.contains(&WarmResult::StockInUse) {
            WarmResult::StockInUse
        } else if results.iter().all(|r| *r == WarmResult::Created) {
            WarmResult::Created
        } else if results.iter().all(|r| *r == WarmResult::Unchanged) {
            WarmResult::Unchanged
        } else {
            WarmResult::Updated
        }
    }
}

impl Stock<'_> {
    /// One SKU's remaining stock and `taken` counter, and its winners unless `known_taken` is
    /// current (or stock is back), in one call (`sold_out_view.lua`).
    pub async fn sold_out_view(
        &self,
        shard: Shard,
        sku_id: i64,
        known_taken: Option<i64>,
    ) -> Result<SoldOutView, StoreError> {
        let mut conn = self.pool.get().await?;
        let v: Vec<i64> = self
            .scripts
            .sold_out_view
            .call()
            .key("sku", self.keys.sku(shard, sku_id))
            .key("buyers", self.keys.buyers(shard, sku_id))
            .arg("known_taken", known_taken.unwrap_or(-1))
            .invoke_async(&mut *conn)
            .await?;
        let (remaining, taken) = (
            v.first().copied().unwrap_or(0),
            v.get(1).copied().unwrap_or(0),
        );
        let fresh = remaining <= 0 && Some(taken) != known_taken;
        Ok(SoldOutView {
            remaining,
            taken,
            winners: fresh.then(|| v.get(2..).unwrap_or_default().to_vec()),
        })
    }

    /// Writes the activity window and one SKU's stock, split into `buckets` stock buckets
    /// (docs/architecture/redis.md#stock-buckets). The split cannot change once warmed
    /// ([`WarmResult::BucketsFixed`]), nor the stock once any bucket holds reservations or
    /// moved units ([`WarmResult::StockInUse`]: checked for every bucket before any is written).
    #[allow(clippy::too_many_arguments)]
    pub async fn warm(
        &self,
        activity_id: i64,
        sku_id: i64,
        starts_at_ms: i64,
        ends_at_ms: i64,
        valid_ms: i64,
        total: i32,
        buckets: u16,
    ) -> Result<WarmResult, StoreError> {
        let buckets = buckets.max(1);
        let mut conn = self.pool.get().await?;
        let (starts, known): (Option<String>, Option<u16>) = redis::cmd("HMGET")
            .arg(self.keys.meta(activity_id))
            .arg("starts_at_ms")
            .arg("buckets")
            .query_async(&mut *conn)
            .await?;
        if starts.is_some() && known.unwrap_or(1) != buckets {
            return Ok(WarmResult::BucketsFixed {
                warmed: known.unwrap_or(1),
            });
        }
        let shares: Vec<i64> = (0..buckets)
            .map(|b| crate::domain::ids::bucket_share(i64::from(total), b, buckets))
            .collect();
        if buckets > 1 {
            // Every bucket first: a change refused in one must not be half written.
            for (b, share) in shares.iter().enumerate() {
                let (t, r, moved): (Option<i64>, Option<i64>, Option<i64>) = redis::cmd("HMGET")
                    .arg(
                        self.keys
                            .sku(Shard::new(activity_id, b as u16, buckets), sku_id),
                    )
                    .arg("total")
                    .arg("remaining")
                    .arg("moved_out")
                    .query_async(&mut *conn)
                    .await?;
                if t.is_some_and(|t| t != *share) && (t != r || moved.unwrap_or(0) != 0) {
                    return Ok(WarmResult::StockInUse);
                }
            }
        }
        let _: () = conn.sadd(self.keys.activities(), activity_id).await?;
        let _: () = conn.sadd(self.keys.skus(activity_id), sku_id).await?;
        let _: () = conn.persist(self.keys.skus(activity_id)).await?;
        let mut results = Vec::with_capacity(shares.len());
        for (b, share) in shares.iter().enumerate() {
            let shard = Shard::new(activity_id, b as u16, buckets);
            let code: String = self
                .scripts
                .warm
                .call()
                .key("meta", self.keys.meta(shard))
                .key("sku", self.keys.sku(shard, sku_id))
                .key("buyers", self.keys.buyers(shard, sku_id))
                .key("requests", self.keys.requests(shard))
                .key("pending", self.keys.pending(shard))
                .key("pending_since", self.keys.pending_since(shard))
                .arg("starts_at_ms", starts_at_ms)
                .arg("ends_at_ms", ends_at_ms)
                .arg("valid_ms", valid_ms)
                .arg("total", share)
                .arg("buckets", buckets)
                .invoke_async(&mut *conn)
                .await?;
            results.push(WarmResult::of_code(&code)?);
        }
        if let Ok(mut m) = self.buckets.write() {
            m.insert(activity_id, buckets);
        }
        Ok(WarmResult::of_buckets(&results))
    }

    /// Pauses (`Some(reason)`) or resumes (`None`) new reservations of an activity, or of one
    /// of its SKUs. `false` when the activity (or SKU) was never warmed into Redis.
    pub async fn set_paused(
        &self,
        activity_id: i64,
        sku_id: Option<i64>,
        reason: Option<&str>,
    ) -> Result<bool, StoreError> {
        // Every bucket carries its own copy of the activity's meta and the SKU's pause: the
        // reserve script reads the buyer's bucket only. Bucket 0 says whether it exists.
        let mut found_first = false;
        for shard in self.shards(activity_id).await? {
            let key = match sku_id {
                Some(sku) => self.keys.sku(shard, sku),
                None => self.keys.meta(shard),
            };
            let mut conn = self.pool.get().await?;
            let found: i64 = self
                .scripts
                .set_paused
                .call()
                .key("hash", key)
                .arg("paused", if reason.is_some() { "1" } else { "0" })
                .arg("reason", reason.unwrap_or(""))
                .invoke_async(&mut *conn)
                .await?;
            found_first |= shard.bucket == 0 && found == 1;
        }
        Ok(found_first)
    }

    /// The operator's pause of an activity (`None`) or SKU: its reason when paused.
    pub async fn paused(
        &self,
        activity_id: i64,
        sku_id: Option<i64>,
    ) -> Result<Option<String>, StoreError> {
        let key = match sku_id {
            Some(sku) => self.keys.sku(activity_id, sku),
            None => self.keys.meta(activity_id),
        };
        let mut conn = self.pool.get().await?;
        let (paused, reason): (Option<String>, Option<String>) = redis::cmd("HMGET")
            .arg(key)
            .arg("paused")
            .arg("paused_reason")
            .query_async(&mut *conn)
            .await?;
        Ok((paused.as_deref() == Some("1")).then(|| reason.unwrap_or_default()))
    }

    /// `(total, remaining)` of one SKU in Redis, over all its buckets: `remaining` counts
    /// every unit no reservation holds, those on their way between two buckets included
    /// ([`super::Moves::bucket_stock`] has them apart).
    pub async fn sku_stock(
        &self,
        activity_id: i64,
        sku_id: i64,
    ) -> Result<Option<(i64, i64)>, StoreError> {
        let stock = self.moves().bucket_stock(activity_id, sku_id).await?;
        if stock.buckets.is_empty() {
            return Ok(None);
        }
        Ok(Some((stock.total(), stock.remaining() + stock.in_transit)))
    }

    /// Census of one SKU's reservation hashes (bounded SCAN over the activity's keys):
    /// counts by `status` and the ids still holding stock (`RESERVED`).
    pub async fn reservation_census(
        &self,
        activity_id: i64,
        sku_id: i64,
    ) -> Result<Census, StoreError> {
        let mut census = Census::default();
        for shard in self.shards(activity_id).await? {
            self.shard_census(shard, sku_id, &mut census).await?;
        }
        Ok(census)
    }

    /// The census of one shard's reservation hashes, added to `census`.
    pub(super) async fn shard_census(
        &self,
        shard: Shard,
        sku_id: i64,
        census: &mut Census,
    ) -> Result<(), StoreError> {
        let sku = sku_id.to_string();
        for (id, f) in self
            .reservation_fields(shard, &["sku_id", "status"])
            .await?
        {
            if f[0].as_deref() != Some(sku.as_str()) {
                continue;
            }
            let status = f[1].clone().unwrap_or_default();
            if status == HoldStatus::Reserved.as_str() {
                census.reserved_ids.push(id);
            }
            *census.by_status.entry(status).or_default() += 1;
        }
        Ok(())
    }

    /// `fields` of every reservation hash of one shard (bounded SCAN pages, one pipelined
    /// HMGET per page), with the reservation id.
    pub(super) async fn reservation_fields(
        &self,
        shard: Shard,
        fields: &[&str],
    ) -> Result<Vec<(String, Vec<Option<String>>)>, StoreError> {
        let mut conn = self.pool.get().await?;
        let prefix = self.keys.reservation_prefix(shard);
        let pattern = format!("{prefix}*");
        let slot = self.keys.slot(shard);
        let (mut cursor, mut out) = (0u64, Vec::new());
        loop {
            let (next, keys) = conn.scan_page(slot, cursor, &pattern).await?;
            if !keys.is_empty() {
                let mut pipe = redis::pipe();
                for key in &keys {
                    pipe.cmd("HMGET").arg(key).arg(fields);
                }
                let rows: Vec<Vec<Option<String>>> = pipe.query_async(&mut *conn).await?;
                for (key, row) in keys.iter().zip(rows) {
                    out.push((key.trim_start_matches(prefix.as_str()).to_string(), row));
                }
            }
            cursor = next;
            if cursor == 0 {
                return Ok(out);
            }
        }
    }
}
