//! Redis: the reservation store of the hot path. Every state change is one Lua script over
//! keys that share the activity's hash tag (`<prefix>:{a<id>}`), so the scripts stay atomic
//! on Redis Cluster too, and pipelines are sent one per hash slot there
//! (docs/architecture/redis.md#redis-cluster).
//!
//! This file holds the store itself (connect, scripts, an activity's buckets); its methods are
//! spread by concern: `keys` (hash tags and key names), `reserve` (the attempt), `send_state`
//! (sent, re-send scheduled, failed, settled, released), `stock` (warm, sold-out view, pause,
//! census), `recovery` (the scanner's claims and watches), `projection`, `buckets` (moves
//! between stock buckets) and `pipeline` (per-slot pipelines through failovers).

mod buckets;
mod draw;
mod error;
mod keys;
mod marks;
mod passes;
mod pipeline;
pub mod pool;
mod projection;
mod rebuild;
mod recovery;
pub mod reservation;
mod reserve;
mod script;
mod send_state;
mod stock;

pub use buckets::{BucketStock, OpenTransfer, SkuBuckets};
pub use draw::{DrawReport, DrawState, DRAW_CHUNK};
pub use error::StoreError;
pub use keys::{bucket_tag, Keys, Shard};
pub use marks::{Mark, Marks, ShardTrust};
pub use rebuild::{
    RebuildReservation, RebuildShard, RebuildSku, ShardSnapshot, SkuSnapshot, Survivor,
};
pub use recovery::{Claimed, RETIRE_AFTER_END_MS};
pub use reserve::{RateLimits, ReservationView, ReserveArgs, ReserveResult};
pub use send_state::{Release, Released, SentMark};
pub use stock::{Census, SoldOutView, WarmResult};

use std::collections::HashMap;

use anyhow::Context as _;
use deadpool_redis::redis::{self, AsyncCommands};

use crate::config::RedisSettings;
use script::LuaScript;

/// Physical TTL kept beyond a reservation's business validity, so that the scanner,
/// compensation and reconcile still find it well after `valid_until`
/// (docs/architecture/hot-path.md#reservation-validity).
pub const RESERVATION_TTL_MARGIN_SECS: u64 = 7 * 24 * 3600;

#[derive(Clone)]
pub struct RedisStore {
    pub pool: pool::Pool,
    pub keys: Keys,
    /// Redis Cluster (`redis.mode`): pipelines go one per hash slot.
    cluster: bool,
    scripts: std::sync::Arc<Scripts>,
    /// Stock buckets per warmed activity, read once from its meta (fixed once warmed).
    buckets: std::sync::Arc<std::sync::RwLock<HashMap<i64, u16>>>,
    /// The highest (epoch, seq) this process has seen per shard
    /// (docs/architecture/redis.md#when-redis-forgets).
    marks: Marks,
}

/// One concern of the store as a small type borrowing it (`store.stock().warm(..)`): a caller
/// names the concern it uses and sees only its methods, each file below one concern. The
/// shared parts (keys, pool, scripts, shards) stay on [`RedisStore`], which each derefs to.
macro_rules! concerns {
    ($($(#[$doc:meta])* $ty:ident: $method:ident;)*) => {$(
        $(#[$doc])*
        #[derive(Clone, Copy)]
        pub struct $ty<'a>(&'a RedisStore);

        impl std::ops::Deref for $ty<'_> {
            type Target = RedisStore;
            fn deref(&self) -> &RedisStore {
                self.0
            }
        }

        impl RedisStore {
            $(#[$doc])*
            pub fn $method(&self) -> $ty<'_> {
                $ty(self)
            }
        }
    )*};
}

concerns! {
    /// Moving leftovers between stock buckets and their trails (docs/architecture/redis.md#moving-leftovers).
    Moves: moves;
    /// The fair start's draw (docs/architecture/hot-path.md#a-fair-start).
    Draws: draws;
    /// The shards' (epoch, seq) marks and their fences (docs/architecture/redis.md#when-redis-forgets).
    Fences: fences;
    /// Sale passes in the buckets' meta (docs/architecture/hot-path.md#sale-passes).
    Passes: passes;
    /// The buyers' order projection (docs/architecture/messages.md#event-ordering).
    Projections: projections;
    /// A shard read and written again from PostgreSQL (docs/architecture/redis.md#when-redis-forgets).
    Rebuild: rebuild;
    /// The scanner's claims, the awaiting index and retiring activities (docs/architecture/redis.md#pending-index-and-leases).
    Recovery: recovery;
    /// The buyers' reservations (docs/architecture/hot-path.md#the-hot-path).
    Intake: intake;
    /// A reservation's send state and the release of its unit (docs/architecture/hot-path.md#uncertain-sends).
    Sends: sends;
    /// Warming, pausing and reading a SKU's stock.
    Stock: stock;
}

struct Scripts {
    reserve: LuaScript,
    mark_sent: LuaScript,
    schedule_resend: LuaScript,
    mark_failed: LuaScript,
    sold_out_view: LuaScript,
    warm: LuaScript,
    release: LuaScript,
    claim: LuaScript,
    claim_awaiting: LuaScript,
    project: LuaScript,
    set_paused: LuaScript,
    transfer_out: LuaScript,
    transfer_in: LuaScript,
    draw: LuaScript,
}

/// Every script under lua/, by its file's stem.
const SOURCES: [(&str, &str); 14] = [
    ("reserve", include_str!("lua/reserve.lua")),
    ("mark_sent", include_str!("lua/mark_sent.lua")),
    ("schedule_resend", include_str!("lua/schedule_resend.lua")),
    ("mark_failed", include_str!("lua/mark_failed.lua")),
    ("sold_out_view", include_str!("lua/sold_out_view.lua")),
    ("warm", include_str!("lua/warm.lua")),
    ("release", include_str!("lua/release.lua")),
    ("claim", include_str!("lua/claim.lua")),
    ("claim_awaiting", include_str!("lua/claim_awaiting.lua")),
    ("project", include_str!("lua/project.lua")),
    ("set_paused", include_str!("lua/set_paused.lua")),
    ("transfer_out", include_str!("lua/transfer_out.lua")),
    ("transfer_in", include_str!("lua/transfer_in.lua")),
    ("draw", include_str!("lua/draw.lua")),
];

impl Scripts {
    fn new() -> Self {
        let lua = |name: &'static str| {
            let (_, source) = SOURCES
                .iter()
                .find(|(n, _)| *n == name)
                .expect("a script of SOURCES");
            LuaScript::new(name, source)
        };
        Self {
            reserve: lua("reserve"),
            mark_sent: lua("mark_sent"),
            schedule_resend: lua("schedule_resend"),
            mark_failed: lua("mark_failed"),
            sold_out_view: lua("sold_out_view"),
            warm: lua("warm"),
            release: lua("release"),
            claim: lua("claim"),
            claim_awaiting: lua("claim_awaiting"),
            project: lua("project"),
            set_paused: lua("set_paused"),
            transfer_out: lua("transfer_out"),
            transfer_in: lua("transfer_in"),
            draw: lua("draw"),
        }
    }
}

impl RedisStore {
    /// Builds the pool and checks the server answers (a bad address fails here, not mid-sale).
    pub async fn connect(settings: &RedisSettings) -> anyhow::Result<Self> {
        let pool = pool::build(settings)?;
        let store = Self {
            pool,
            keys: Keys::new(&settings.key_prefix),
            cluster: settings.mode == crate::config::RedisMode::Cluster,
            scripts: std::sync::Arc::new(Scripts::new()),
            buckets: Default::default(),
            marks: Marks::default(),
        };
        store.ping().await.with_context(|| {
            format!(
                "redis.url: Redis at {} does not answer",
                pool::endpoint(&store.pool)
            )
        })?;
        Ok(store)
    }

    /// The slot a pipeline groups a shard's calls by: its keys' hash slot on a cluster,
    /// 0 on one server (everything in one pipeline, and no hashing on the hot path).
    fn slot(&self, shard: impl Into<Shard>) -> u16 {
        if self.cluster {
            self.keys.slot(shard)
        } else {
            0
        }
    }

    /// How many stock buckets an activity's SKUs are split into (1 when not split, or not
    /// warmed yet). Read once from bucket 0's meta and kept: warming refuses to change it.
    pub async fn buckets(&self, activity_id: i64) -> Result<u16, StoreError> {
        if let Some(k) = self
            .buckets
            .read()
            .ok()
            .and_then(|m| m.get(&activity_id).copied())
        {
            return Ok(k);
        }
        let mut conn = self.pool.get().await?;
        let (starts, k): (Option<String>, Option<u16>) = redis::cmd("HMGET")
            .arg(self.keys.meta(activity_id))
            .arg("starts_at_ms")
            .arg("buckets")
            .query_async(&mut *conn)
            .await?;
        let k = k.unwrap_or(1).max(1);
        // Only a warmed activity's count is kept: one not warmed yet may be warmed split.
        if starts.is_some() {
            if let Ok(mut m) = self.buckets.write() {
                m.insert(activity_id, k);
            }
        }
        Ok(k)
    }

    /// Every shard of an activity (one per stock bucket).
    pub async fn shards(&self, activity_id: i64) -> Result<Vec<Shard>, StoreError> {
        let k = self.buckets(activity_id).await?;
        Ok((0..k).map(|b| Shard::new(activity_id, b, k)).collect())
    }

    /// The shard a reservation lives in: its activity and the bucket its id names.
    pub async fn shard_of(
        &self,
        activity_id: i64,
        reservation_id: &str,
    ) -> Result<Shard, StoreError> {
        let bucket = crate::domain::ids::reservation_bucket(reservation_id);
        if bucket == 0 {
            return Ok(Shard::from(activity_id));
        }
        let k = self.buckets(activity_id).await?;
        // An id naming a bucket the activity does not have (a forged or mistyped id) names
        // keys that do not exist: the reservation is unknown, as for any id never minted.
        Ok(Shard::new(activity_id, bucket, k.max(bucket + 1)))
    }

    /// The shard a buyer reserves in: their home bucket of the activity.
    pub async fn home_shard(&self, activity_id: i64, user_id: i64) -> Result<Shard, StoreError> {
        let k = self.buckets(activity_id).await?;
        Ok(Shard::new(
            activity_id,
            crate::domain::ids::home_bucket(user_id, k),
            k,
        ))
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        let mut conn = self.pool.get().await?;
        let _: String = redis::cmd("PING").query_async(&mut *conn).await?;
        Ok(())
    }

    /// Runs one script call on a pooled connection.
    async fn invoke(&self, call: redis::ScriptInvocation<'_>) -> Result<String, StoreError> {
        let mut conn = self.pool.get().await?;
        Ok(call.invoke_async(&mut *conn).await?)
    }

    /// All fields of one reservation hash (empty when unknown).
    pub async fn reservation(
        &self,
        activity_id: i64,
        reservation_id: &str,
    ) -> Result<HashMap<String, String>, StoreError> {
        let shard = self.shard_of(activity_id, reservation_id).await?;
        let mut conn = self.pool.get().await?;
        Ok(conn
            .hgetall(self.keys.reservation(shard, reservation_id))
            .await?)
    }

    /// Activities whose stock was warmed (the scanner's work list).
    pub async fn activities(&self) -> Result<Vec<i64>, StoreError> {
        let mut conn = self.pool.get().await?;
        Ok(conn.smembers(self.keys.activities()).await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_buckets_of_an_activity_take_one_slot_range_each() {
        let keys = Keys::new("p");
        for k in [2_u16, 3, 4, 6, 8, 64] {
            for activity in [1_i64, 7, 982, 179_617_307_613] {
                let ranges: std::collections::BTreeSet<u32> = (0..k)
                    .map(|b| {
                        u32::from(keys.slot(Shard::new(activity, b, k))) * u32::from(k) / 16384
                    })
                    .collect();
                assert_eq!(
                    ranges.len(),
                    usize::from(k),
                    "activity {activity}, {k} buckets"
                );
            }
        }
        // Bucket 0 is the activity's own tag, whatever the count.
        assert_eq!(keys.tag(Shard::new(7, 0, 6)), "p:{a7}");
        // The same tag every time (placed once, then remembered).
        assert_eq!(keys.tag(Shard::new(7, 4, 6)), keys.tag(Shard::new(7, 4, 6)));
        assert_eq!(
            Keys::new("p").tag(Shard::new(7, 4, 6)),
            keys.tag(Shard::new(7, 4, 6))
        );
    }

    #[test]
    fn keys_of_one_activity_share_a_hash_tag() {
        let k = Keys::new("p");
        for key in [
            k.meta(7),
            k.sku(7, 1),
            k.buyers(7, 1),
            k.requests(7),
            k.pending(7),
            k.reservation(7, "rsv_x"),
        ] {
            assert!(key.starts_with("p:{a7}:"), "{key}");
        }
    }
}
