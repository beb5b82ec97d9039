//! The scanner's side: claiming due and unconsumed reservations under a lease, ending their
//! watch, retiring ended activities, and the pending gauges.

use std::collections::HashMap;

use deadpool_redis::redis::{self, AsyncCommands};

use super::{Recovery, Shard, StoreError};

/// What one scanner claim found for an activity.
#[derive(Debug, Default)]
pub struct Claimed {
    /// The reservations now leased to the caller, each as its Redis hash.
    pub reservations: Vec<HashMap<String, String>>,
    /// Nothing is pending and the activity ended over [`RETIRE_AFTER_END_MS`] ago: it can
    /// leave the work list.
    pub retire: bool,
}

/// How long after its end an activity with nothing pending stays on the scanner's work list:
/// long past any clock skew between the API hosts and the scanner.
pub const RETIRE_AFTER_END_MS: i64 = 10 * 60 * 1000;

impl Recovery<'_> {
    /// Leases up to `batch` due reservations of one shard to `owner` for `lease_ms`.
    pub async fn claim_due(
        &self,
        shard: impl Into<Shard>,
        now_ms: i64,
        batch: usize,
        owner: &str,
        lease_ms: u64,
    ) -> Result<Claimed, StoreError> {
        let k = &self.keys;
        let shard = shard.into();
        let mut conn = self.pool.get().await?;
        let raw: Vec<redis::Value> = self
            .scripts
            .claim
            .call()
            .key("pending", k.pending(shard))
            .key("pending_since", k.pending_since(shard))
            .key("meta", k.meta(shard))
            .arg("now_ms", now_ms)
            .arg("batch", batch)
            .arg("owner", owner)
            .arg("lease_ms", lease_ms)
            .arg("reservation_prefix", k.reservation_prefix(shard))
            .arg("retire_after_ms", RETIRE_AFTER_END_MS)
            .invoke_async(&mut *conn)
            .await?;
        if let [only] = raw.as_slice() {
            if redis::from_redis_value::<String>(only).is_ok_and(|s| s == "RETIRE") {
                return Ok(Claimed {
                    reservations: Vec::new(),
                    retire: true,
                });
            }
        }
        let mut reservations = Vec::new();
        for pair in raw.chunks(2) {
            if let [_, fields] = pair {
                let map: HashMap<String, String> = redis::from_redis_value(fields)?;
                reservations.push(map);
            }
        }
        Ok(Claimed {
            reservations,
            retire: false,
        })
    }

    /// Leases up to `batch` confirmed sends of one shard whose last copy went out before
    /// `cutoff_ms` and that are not yet seen consumed (`claim_awaiting.lua`). Returns them with
    /// the size of the awaiting index after the claim.
    pub async fn claim_awaiting(
        &self,
        shard: Shard,
        cutoff_ms: i64,
        batch: usize,
        lease_ms: u64,
    ) -> Result<(u64, Vec<HashMap<String, String>>), StoreError> {
        let k = &self.keys;
        let mut conn = self.pool.get().await?;
        let raw: Vec<redis::Value> = self
            .scripts
            .claim_awaiting
            .call()
            .key("awaiting", k.awaiting(shard))
            .arg("cutoff", cutoff_ms)
            .arg("batch", batch)
            .arg("lease_ms", lease_ms)
            .arg("reservation_prefix", k.reservation_prefix(shard))
            .invoke_async(&mut *conn)
            .await?;
        let Some((first, rest)) = raw.split_first() else {
            return Err(StoreError::unexpected(
                "claim_awaiting.lua answered nothing",
            ));
        };
        let remaining: u64 = redis::from_redis_value(first)?;
        let mut claims = Vec::with_capacity(rest.len() / 2);
        for pair in rest.chunks(2) {
            if let [_, fields] = pair {
                claims.push(redis::from_redis_value(fields)?);
            }
        }
        Ok((remaining, claims))
    }

    /// Ends the watch of reservations the consumers took (or that were settled), and watches
    /// `resent` ones again from `sent_at_ms` (a new copy went out; only those still in the
    /// index), in one round trip.
    pub async fn end_watch(
        &self,
        shard: Shard,
        done: &[String],
        resent: &[String],
        sent_at_ms: i64,
    ) -> Result<(), StoreError> {
        let key = self.keys.awaiting(shard);
        let mut pipe = redis::pipe();
        if !done.is_empty() {
            pipe.cmd("ZREM").arg(&key).arg(done).ignore();
        }
        if !resent.is_empty() {
            let mut zadd = redis::cmd("ZADD");
            zadd.arg(&key).arg("XX");
            for rid in resent {
                zadd.arg(sent_at_ms).arg(rid);
            }
            pipe.add_command(zadd).ignore();
        }
        if pipe.is_empty() {
            return Ok(());
        }
        let mut conn = self.pool.get().await?;
        let () = pipe.query_async(&mut *conn).await?;
        Ok(())
    }

    /// Takes an activity off the scanner's (and admission's) work list, and gives every key
    /// of the activity that has no expiry yet (stock, buyers, request ids, indexes, meta) one
    /// of `keep_secs`, so a finished sale leaves nothing in Redis for ever. Warming it again
    /// puts it back on the list (and the stock key back without expiry). Returns the keys given
    /// an expiry.
    pub async fn retire_activity(
        &self,
        activity_id: i64,
        keep_secs: u64,
    ) -> Result<u64, StoreError> {
        let shards = self.shards(activity_id).await?;
        let mut conn = self.pool.get().await?;
        let _: () = conn.srem(self.keys.activities(), activity_id).await?;
        let mut expired = 0;
        for shard in shards {
            expired += self.expire_shard(shard, keep_secs).await?;
        }
        Ok(expired)
    }

    /// Gives every key of one shard without an expiry one of `keep_secs` (its hash tag: one
    /// node, one pattern).
    pub(super) async fn expire_shard(
        &self,
        shard: Shard,
        keep_secs: u64,
    ) -> Result<u64, StoreError> {
        let mut conn = self.pool.get().await?;
        let pattern = format!("{}:*", self.keys.tag(shard));
        let slot = self.keys.slot(shard);
        let (mut cursor, mut expired) = (0u64, 0u64);
        loop {
            let (next, keys) = conn.scan_page(slot, cursor, &pattern).await?;
            if !keys.is_empty() {
                let mut pipe = redis::pipe();
                for key in &keys {
                    pipe.cmd("EXPIRE").arg(key).arg(keep_secs).arg("NX");
                }
                let set: Vec<i64> = pipe.query_async(&mut *conn).await?;
                expired += set.iter().filter(|&&n| n == 1).count() as u64;
            }
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
        Ok(expired)
    }

    /// `(count, oldest creation ms)` of the unconfirmed reservations of one activity, over
    /// its buckets.
    pub async fn pending_stats(&self, activity_id: i64) -> Result<(i64, Option<i64>), StoreError> {
        let mut conn = self.pool.get().await?;
        let (mut total, mut oldest) = (0, None::<i64>);
        for shard in self.shards(activity_id).await? {
            let key = self.keys.pending_since(shard);
            let (count, head): (i64, Vec<(String, f64)>) = redis::pipe()
                .zcard(&key)
                .zrange_withscores(&key, 0, 0)
                .query_async(&mut *conn)
                .await?;
            total += count;
            if let Some((_, at)) = head.first() {
                let at = *at as i64;
                oldest = Some(oldest.map_or(at, |o| o.min(at)));
            }
        }
        Ok((total, oldest))
    }

    /// Size of the activity's pending (not yet confirmed) index, over its buckets.
    pub async fn pending_count(&self, activity_id: i64) -> Result<i64, StoreError> {
        let mut conn = self.pool.get().await?;
        let mut total = 0;
        for shard in self.shards(activity_id).await? {
            let n: i64 = conn.zcard(self.keys.pending(shard)).await?;
            total += n;
        }
        Ok(total)
    }
}
