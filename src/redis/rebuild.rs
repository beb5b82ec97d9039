//! The Redis half of a rebuild (docs/architecture/redis.md#when-redis-forgets): what one shard
//! holds now ([`ShardSnapshot`]), and writing a shard's rebuilt state ([`RebuildShard`]) with
//! absolute values, so a rebuild run twice leaves the same state.

use crate::domain::status::HoldStatus;
use std::collections::{BTreeMap, HashMap, HashSet};

use std::time::Duration;

use deadpool_redis::redis::{self, AsyncCommands};

use super::{Rebuild, Shard, StoreError};

/// One SKU's stock hash in one shard, as found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SkuSnapshot {
    pub sku_id: i64,
    /// `None`: the hash is gone.
    pub total: Option<i64>,
    pub remaining: Option<i64>,
    pub moved_in: i64,
    pub moved_out: i64,
    pub taken: i64,
    /// The SKU's buyers set: user id → reservation id.
    pub buyers: HashMap<String, String>,
}

/// A reservation hash Redis holds with its unit (status RESERVED).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Survivor {
    pub reservation_id: String,
    pub sku_id: i64,
    pub user_id: String,
    pub req_field: String,
}

/// One shard as found before a rebuild.
#[derive(Debug, Clone, Default)]
pub struct ShardSnapshot {
    pub shard: Shard,
    pub meta_present: bool,
    pub skus: Vec<SkuSnapshot>,
    /// The request index: `<user>:<request_id>` → reservation id.
    pub requests: HashMap<String, String>,
    /// Reservation hashes still holding a unit.
    pub reserved: Vec<Survivor>,
    /// Reservation hashes whose unit was given back (status RELEASED).
    pub released: HashSet<String>,
    /// Every reservation hash present, whatever its status.
    pub present: usize,
}

/// One SKU of a shard as the rebuild writes it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RebuildSku {
    pub sku_id: i64,
    pub total: i64,
    pub remaining: i64,
    pub taken: i64,
    pub buyers: BTreeMap<String, String>,
}

/// A reservation hash as the rebuild writes it (the facts PostgreSQL recorded).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RebuildReservation {
    pub reservation_id: String,
    pub fields: Vec<(&'static str, String)>,
    /// Seconds the hash is kept.
    pub ttl_secs: u64,
}

/// A shard's whole rebuilt state.
#[derive(Debug, Clone, Default)]
pub struct RebuildShard {
    pub shard: Shard,
    pub starts_at_ms: i64,
    pub ends_at_ms: i64,
    pub valid_ms: i64,
    pub skus: Vec<RebuildSku>,
    pub requests: BTreeMap<String, String>,
    pub reservations: Vec<RebuildReservation>,
    /// Recorded reservations to take off the re-send and watch indexes (they were consumed).
    pub consumed: Vec<String>,
    /// The activity sells only to pass holders: the meta says so, and each buyer's pass holds
    /// the SKU the buyers sets give them (docs/architecture/hot-path.md#sale-passes).
    pub passes_required: bool,
}

/// Hash fields written per HSET: far under any argument limit.
const CHUNK: usize = 500;

impl Rebuild<'_> {
    /// Holds the scripts that move the shards' stock (a compensation's release, a leftover
    /// move) for at most `lease`: they answer `HELD` until [`Rebuild::write_shard`] writes
    /// the shard, or the lease runs out (a rebuild that died holds nothing for long).
    pub async fn hold_stock(&self, shards: &[Shard], lease: Duration) -> Result<(), StoreError> {
        let mut conn = self.pool.get().await?;
        for &s in shards {
            let () = redis::cmd("SET")
                .arg(self.keys.rebuilding(s))
                .arg("1")
                .arg("PX")
                .arg(lease.as_millis() as u64)
                .query_async(&mut *conn)
                .await?;
        }
        Ok(())
    }

    /// Lets the shards' stock move again (a rebuild that gave up before writing).
    pub async fn unhold_stock(&self, shards: &[Shard]) -> Result<(), StoreError> {
        let mut conn = self.pool.get().await?;
        for &s in shards {
            let () = conn.del(self.keys.rebuilding(s)).await?;
        }
        Ok(())
    }

    /// What one shard holds now for the activity's `skus`: its meta, stock hashes, buyers and
    /// request index in one pipeline, then its reservation hashes.
    pub async fn snapshot_shard(
        &self,
        shard: Shard,
        skus: &[i64],
    ) -> Result<ShardSnapshot, StoreError> {
        let k = &self.keys;
        let mut pipe = redis::pipe();
        pipe.exists(k.meta(shard)).hgetall(k.requests(shard));
        for &sku_id in skus {
            pipe.cmd("HMGET").arg(k.sku(shard, sku_id)).arg(&[
                "total",
                "remaining",
                "moved_in",
                "moved_out",
                "taken",
            ]);
            pipe.hgetall(k.buyers(shard, sku_id));
        }
        let mut conn = self.pool.get().await?;
        let mut replies = pipe
            .query_async::<Vec<redis::Value>>(&mut *conn)
            .await?
            .into_iter();
        drop(conn);
        let mut next = || {
            replies
                .next()
                .ok_or_else(|| StoreError::unexpected("a snapshot call got no answer"))
        };
        let mut out = ShardSnapshot {
            shard,
            meta_present: redis::from_redis_value(&next()?)?,
            requests: redis::from_redis_value(&next()?)?,
            ..Default::default()
        };
        for &sku_id in skus {
            let v: Vec<Option<i64>> = redis::from_redis_value(&next()?)?;
            let f = |i: usize| v.get(i).copied().flatten();
            out.skus.push(SkuSnapshot {
                sku_id,
                total: f(0),
                remaining: f(1),
                moved_in: f(2).unwrap_or(0),
                moved_out: f(3).unwrap_or(0),
                taken: f(4).unwrap_or(0),
                buyers: redis::from_redis_value(&next()?)?,
            });
        }
        let fields = ["status", "sku_id", "user_id", "req_field"];
        for (id, mut f) in self.stock().reservation_fields(shard, &fields).await? {
            out.present += 1;
            if f[0].as_deref() == Some(HoldStatus::Released.as_str()) {
                out.released.insert(id);
                continue;
            }
            if f[0].as_deref() != Some(HoldStatus::Reserved.as_str()) {
                continue;
            }
            out.reserved.push(Survivor {
                reservation_id: id,
                sku_id: f[1].as_deref().and_then(|v| v.parse().ok()).unwrap_or(0),
                user_id: f[2].take().unwrap_or_default(),
                req_field: f[3].take().unwrap_or_default(),
            });
        }
        Ok(out)
    }

    /// Writes a shard's rebuilt state with absolute values, then lets its stock move again (the
    /// shard stays fenced: the caller lifts the fence once every shard is written).
    pub async fn write_shard(&self, r: &RebuildShard) -> Result<(), StoreError> {
        let k = &self.keys;
        let s = r.shard;
        let mut pipe = redis::pipe();
        pipe.cmd("HSET")
            .arg(k.meta(s))
            .arg("starts_at_ms")
            .arg(r.starts_at_ms)
            .arg("ends_at_ms")
            .arg(r.ends_at_ms)
            .arg("valid_ms")
            .arg(r.valid_ms)
            .arg("buckets")
            .arg(s.buckets)
            .ignore();
        let passes_used = k.passes_used(s);
        pipe.del(&passes_used).ignore();
        if r.passes_required {
            pipe.hset(k.meta(s), "passes", "1").ignore();
            let held: BTreeMap<String, String> = r
                .skus
                .iter()
                .flat_map(|sku| {
                    sku.buyers
                        .keys()
                        .map(|u| (u.clone(), sku.sku_id.to_string()))
                })
                .collect();
            hset_chunks(&mut pipe, &passes_used, &held);
        } else {
            pipe.hdel(k.meta(s), "passes").ignore();
        }
        for sku in &r.skus {
            pipe.cmd("HSET")
                .arg(k.sku(s, sku.sku_id))
                .arg("total")
                .arg(sku.total)
                .arg("remaining")
                .arg(sku.remaining)
                .arg("taken")
                .arg(sku.taken)
                .ignore();
            let buyers = k.buyers(s, sku.sku_id);
            pipe.del(&buyers).ignore();
            hset_chunks(&mut pipe, &buyers, &sku.buyers);
        }
        let requests = k.requests(s);
        pipe.del(&requests).ignore();
        hset_chunks(&mut pipe, &requests, &r.requests);
        for rsv in &r.reservations {
            let key = k.reservation(s, &rsv.reservation_id);
            pipe.hset_multiple(&key, &rsv.fields).ignore();
            pipe.expire(&key, rsv.ttl_secs as i64).ignore();
        }
        for ids in r.consumed.chunks(CHUNK) {
            for index in [k.pending(s), k.pending_since(s), k.awaiting(s)] {
                pipe.cmd("ZREM").arg(index).arg(ids).ignore();
            }
        }
        pipe.del(k.rebuilding(s)).ignore();
        let mut conn = self.pool.get().await?;
        let () = pipe.query_async(&mut *conn).await?;
        if s.bucket == 0 {
            // Outside the shard's hash tag (the activities list) or on bucket 0's: apart.
            let _: () = conn.sadd(k.activities(), s.activity_id).await?;
            let skus: Vec<i64> = r.skus.iter().map(|x| x.sku_id).collect();
            if !skus.is_empty() {
                let _: () = conn.sadd(k.skus(s.activity_id), skus).await?;
            }
        }
        if let Ok(mut m) = self.buckets.write() {
            m.insert(s.activity_id, s.buckets);
        }
        Ok(())
    }
}

fn hset_chunks(pipe: &mut redis::Pipeline, key: &str, map: &BTreeMap<String, String>) {
    let pairs: Vec<(&String, &String)> = map.iter().collect();
    for chunk in pairs.chunks(CHUNK) {
        pipe.hset_multiple(key, chunk).ignore();
    }
}
