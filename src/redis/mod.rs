//! Redis: the reservation store of the hot path. Every state change is one Lua script over
//! keys that share the activity's hash tag (`<prefix>:{a<id>}`), so the scripts stay atomic
//! on Redis Cluster too, and pipelines are sent one per hash slot there
//! (docs/ARCHITECTURE.md#redis-cluster).

mod buckets;
pub mod pool;
pub mod reservation;

pub use buckets::{BucketStock, OpenTransfer, SkuBuckets};

use std::collections::HashMap;

use anyhow::Context as _;
use deadpool_redis::redis::{self, AsyncCommands, Script};

use crate::config::RedisSettings;
use crate::domain::event::ReservationRef;

/// Physical TTL kept beyond a reservation's business validity, so that the scanner,
/// compensation and reconcile still find it well after `valid_until`
/// (docs/ARCHITECTURE.md#reservation-validity).
pub const RESERVATION_TTL_MARGIN_SECS: u64 = 7 * 24 * 3600;

/// Where an activity's keys live: the activity and one of its `buckets` stock buckets
/// (docs/ARCHITECTURE.md#stock-buckets). Bucket 0 is the activity's own hash tag
/// (`{a<id>}`), so an activity whose stock is not split is one shard, as before; bucket k > 0
/// has its own, placed so that the K buckets' slots spread evenly over the slot space (and so
/// over a cluster's primaries). An activity id alone is its bucket 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Shard {
    pub activity_id: i64,
    pub bucket: u16,
    /// How many buckets the activity has (where bucket `bucket`'s tag is placed).
    pub buckets: u16,
}

impl Shard {
    pub fn new(activity_id: i64, bucket: u16, buckets: u16) -> Self {
        Self {
            activity_id,
            bucket,
            buckets: buckets.max(1),
        }
    }
}

impl From<i64> for Shard {
    fn from(activity_id: i64) -> Self {
        Self::new(activity_id, 0, 1)
    }
}

/// The hash tag (without braces) of bucket k > 0 of K: its slot in the k-th of K equal slot
/// ranges counted from the range of bucket 0's slot, so that K buckets take one range each
/// and spread evenly over primaries that own equal, contiguous slot ranges (as
/// `redis-cli --cluster create` assigns them). Deterministic: every process finds the same.
pub fn bucket_tag(s: Shard) -> String {
    const SLOTS: u32 = 16384;
    let k = u32::from(s.buckets.max(1));
    let range = |slot: u16| u32::from(slot) * k / SLOTS;
    let first = range(pool::slot(&format!("{{a{}}}", s.activity_id)));
    let want = (first + u32::from(s.bucket)) % k;
    let plain = format!("a{}.b{}", s.activity_id, s.bucket);
    if range(pool::slot(&format!("{{{plain}}}"))) == want {
        return plain;
    }
    // About K tries on average; bounded far beyond what any K up to 64 needs.
    (1..100_000u32)
        .map(|n| format!("{plain}.{n}"))
        .find(|t| range(pool::slot(&format!("{{{t}}}"))) == want)
        .unwrap_or(plain)
}

/// Key names of one deployment (its prefix).
#[derive(Debug, Clone)]
pub struct Keys {
    prefix: String,
    /// The hash tags of buckets k > 0, once placed (a few crc16 each).
    placed: std::sync::Arc<std::sync::RwLock<HashMap<Shard, String>>>,
}

impl Keys {
    pub fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_string(),
            placed: Default::default(),
        }
    }
    /// The hash tag every key of a shard carries: `<prefix>:{a<id>}` for bucket 0, and for
    /// bucket k of K `<prefix>:{a<id>.b<k>}` or `<prefix>:{a<id>.b<k>.<n>}`, with the smallest
    /// `n` that puts its slot in the k-th of K equal slot ranges counted from bucket 0's
    /// ([`bucket_tag`]).
    pub fn tag(&self, shard: impl Into<Shard>) -> String {
        let s = shard.into();
        if s.bucket == 0 {
            return format!("{}:{{a{}}}", self.prefix, s.activity_id);
        }
        if let Some(t) = self.placed.read().ok().and_then(|m| m.get(&s).cloned()) {
            return t;
        }
        let t = format!("{}:{{{}}}", self.prefix, bucket_tag(s));
        if let Ok(mut m) = self.placed.write() {
            m.insert(s, t.clone());
        }
        t
    }
    /// The Redis Cluster slot of every key of a shard.
    pub fn slot(&self, shard: impl Into<Shard>) -> u16 {
        pool::slot(&self.tag(shard))
    }
    pub fn meta(&self, shard: impl Into<Shard>) -> String {
        format!("{}:meta", self.tag(shard))
    }
    pub fn sku(&self, shard: impl Into<Shard>, sku_id: i64) -> String {
        format!("{}:sku:{}", self.tag(shard), sku_id)
    }
    pub fn buyers(&self, shard: impl Into<Shard>, sku_id: i64) -> String {
        format!("{}:buyers:{}", self.tag(shard), sku_id)
    }
    pub fn requests(&self, shard: impl Into<Shard>) -> String {
        format!("{}:req", self.tag(shard))
    }
    pub fn pending(&self, shard: impl Into<Shard>) -> String {
        format!("{}:pending", self.tag(shard))
    }
    /// Unconfirmed reservations scored by creation time: its head gives the oldest age.
    pub fn pending_since(&self, shard: impl Into<Shard>) -> String {
        format!("{}:pending_since", self.tag(shard))
    }
    /// Confirmed sends not yet seen taken by the consumers, scored by when their last copy
    /// was sent (docs/ARCHITECTURE.md#a-dead-brokers-messages).
    pub fn awaiting(&self, shard: impl Into<Shard>) -> String {
        format!("{}:awaiting", self.tag(shard))
    }
    /// A caller's rate-limit bucket in an activity (`kind` "u" for a buyer, "ip" for a client
    /// address), under the shard's hash tag so the reserve script takes its token in the
    /// same call (docs/ARCHITECTURE.md#abuse-limits).
    pub fn rate_bucket(&self, shard: impl Into<Shard>, kind: &str, caller: &str) -> String {
        format!("{}:rl:{}:{}", self.tag(shard), kind, caller)
    }
    /// The SKUs warmed into an activity (bucket 0 only): what the rebalancer walks.
    pub fn skus(&self, activity_id: i64) -> String {
        format!("{}:skus", self.tag(activity_id))
    }
    /// Transfers of a SKU's units out of a bucket: transfer id → "<to> <units> <ms>", kept
    /// as the trail (docs/ARCHITECTURE.md#moving-leftovers).
    pub fn transfers_out(&self, shard: impl Into<Shard>, sku_id: i64) -> String {
        format!("{}:xout:{}", self.tag(shard), sku_id)
    }
    /// Transfers out of a bucket not yet known credited (scored by when they were debited).
    pub fn transfers_open(&self, shard: impl Into<Shard>, sku_id: i64) -> String {
        format!("{}:xopen:{}", self.tag(shard), sku_id)
    }
    /// Transfers of a SKU's units into a bucket: transfer id → "<from> <units> <ms>".
    pub fn transfers_in(&self, shard: impl Into<Shard>, sku_id: i64) -> String {
        format!("{}:xin:{}", self.tag(shard), sku_id)
    }
    /// One rebalancer at a time per SKU (bucket 0's tag).
    pub fn rebalance_lease(&self, activity_id: i64, sku_id: i64) -> String {
        format!("{}:rebalance:{}", self.tag(activity_id), sku_id)
    }
    /// Activities with warmed stock: the scanner's work list (outside any hash tag).
    pub fn activities(&self) -> String {
        format!("{}:activities", self.prefix)
    }
    pub fn reservation_prefix(&self, shard: impl Into<Shard>) -> String {
        format!("{}:rsv:", self.tag(shard))
    }
    /// A reservation's hash, in its shard (the bucket its id names: [`RedisStore::shard_of`]).
    pub fn reservation(&self, shard: impl Into<Shard>, reservation_id: &str) -> String {
        format!("{}{}", self.reservation_prefix(shard), reservation_id)
    }
    /// Buyer-facing order status of one reservation (projection of the order events), under
    /// the hash tag of the activity its id names (docs/ARCHITECTURE.md#identifiers).
    pub fn projection(&self, reservation_id: &str) -> String {
        match crate::domain::ids::reservation_activity(reservation_id) {
            Some(activity_id) => format!("{}:proj:{}", self.tag(activity_id), reservation_id),
            None => format!("{}:proj:{}", self.prefix, reservation_id),
        }
    }
    /// reservation_id → activity_id, outside the hash tag, written by earlier versions for
    /// reservation ids that did not name their activity (docs/ARCHITECTURE.md#identifiers).
    pub fn location(&self, reservation_id: &str) -> String {
        format!("{}:rsvloc:{}", self.prefix, reservation_id)
    }
}

/// The reservation as the reserve script reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReservationView {
    pub reservation_id: String,
    pub message_id: String,
    pub order_id: String,
    pub mq_status: String,
    pub status: String,
    pub valid_until_ms: i64,
    pub created_at_ms: i64,
}

/// What the reserve script decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReserveResult {
    Reserved(ReservationView),
    /// The same (user, request_id) was seen before: the earlier reservation, unchanged.
    Duplicate(ReservationView),
    AlreadyPurchased {
        reservation_id: String,
    },
    /// The buyer used this request_id for another SKU of the activity: not a repeat of that
    /// request, and not a new one either. Nothing changed.
    RequestIdReused {
        reservation_id: String,
        sku_id: String,
    },
    SoldOut,
    NotStarted,
    Ended,
    /// The client address's (`by` = "ip") or the buyer's ("u") bucket is empty: a token is
    /// back after `retry_ms`. Nothing changed.
    RateLimited {
        by: String,
        retry_ms: u64,
    },
    /// An operator paused the activity or this SKU, with their reason.
    Paused {
        reason: String,
    },
    NotFound,
}

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

/// Arguments of one reservation attempt; ids are minted by the caller beforehand.
#[derive(Debug, Clone)]
pub struct ReserveArgs<'a> {
    pub reservation: ReservationRef<'a>,
    pub now_ms: i64,
    pub next_retry_at_ms: i64,
    pub traceparent: &'a str,
    pub valid_secs: u64,
    /// The caller's buckets the script takes a token from first.
    pub limits: RateLimits<'a>,
    /// The buyer's sales channel (`""`: none), kept on the reservation for its re-sends.
    pub channel: &'a str,
}

/// The abuse limits of one reservation request (docs/ARCHITECTURE.md#abuse-limits); a rate of 0
/// is no limit, and the default is none.
#[derive(Debug, Clone, Copy, Default)]
pub struct RateLimits<'a> {
    /// The client address (`""` when unknown: that bucket is skipped).
    pub client_addr: &'a str,
    pub address_rate_per_sec: f64,
    pub address_burst: u32,
    pub buyer_rate_per_sec: f64,
    pub buyer_burst: u32,
}

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

/// One reservation to give back (the compensation path).
#[derive(Debug, Clone, Copy)]
pub struct Release<'a> {
    pub activity_id: i64,
    pub sku_id: i64,
    pub reservation_id: &'a str,
    pub reason: &'a str,
}

/// A first send the broker confirmed, to record (`RedisStore::mark_sent_many`).
#[derive(Debug, Clone)]
pub struct SentMark {
    pub activity_id: i64,
    pub reservation_id: String,
    pub message_id: String,
    pub broker_msg_id: String,
    pub sent_at_ms: i64,
}

/// How often, and how far apart, a pipeline a failover redirected is sent again (at most
/// about a second in all: a replica's promotion takes the cluster's node timeout, 2 s on
/// `scripts/redis-cluster-up.sh`'s nodes, and the slot map follows it).
const REDIRECT_RETRIES: u32 = 10;
const REDIRECT_RETRY_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// An error a Redis Cluster answers while a slot changes owner.
fn redirected(e: &redis::RedisError) -> bool {
    use redis::ErrorKind::*;
    matches!(e.kind(), Moved | Ask | TryAgain | ClusterDown | MasterDown)
}

#[derive(Clone)]
pub struct RedisStore {
    pub pool: pool::Pool,
    pub keys: Keys,
    /// Redis Cluster (`redis.mode`): pipelines go one per hash slot.
    cluster: bool,
    scripts: std::sync::Arc<Scripts>,
    /// Stock buckets per warmed activity, read once from its meta (fixed once warmed).
    buckets: std::sync::Arc<std::sync::RwLock<HashMap<i64, u16>>>,
}

struct Scripts {
    reserve: Script,
    mark_sent: Script,
    schedule_resend: Script,
    mark_failed: Script,
    sold_out_view: Script,
    warm: Script,
    release: Script,
    claim: Script,
    claim_awaiting: Script,
    project: Script,
    set_paused: Script,
    transfer_out: Script,
    transfer_in: Script,
}

fn view(parts: &[String]) -> ReservationView {
    let get = |i: usize| parts.get(i).cloned().unwrap_or_default();
    ReservationView {
        reservation_id: get(1),
        message_id: get(2),
        order_id: get(3),
        mq_status: get(4),
        status: get(5),
        valid_until_ms: get(6).parse().unwrap_or(0),
        created_at_ms: get(7).parse().unwrap_or(0),
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
            scripts: std::sync::Arc::new(Scripts {
                reserve: Script::new(include_str!("lua/reserve.lua")),
                mark_sent: Script::new(include_str!("lua/mark_sent.lua")),
                schedule_resend: Script::new(include_str!("lua/schedule_resend.lua")),
                mark_failed: Script::new(include_str!("lua/mark_failed.lua")),
                sold_out_view: Script::new(include_str!("lua/sold_out_view.lua")),
                warm: Script::new(include_str!("lua/warm.lua")),
                release: Script::new(include_str!("lua/release.lua")),
                claim: Script::new(include_str!("lua/claim.lua")),
                claim_awaiting: Script::new(include_str!("lua/claim_awaiting.lua")),
                project: Script::new(include_str!("lua/project.lua")),
                set_paused: Script::new(include_str!("lua/set_paused.lua")),
                transfer_out: Script::new(include_str!("lua/transfer_out.lua")),
                transfer_in: Script::new(include_str!("lua/transfer_in.lua")),
            }),
            buckets: Default::default(),
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
    pub async fn buckets(&self, activity_id: i64) -> anyhow::Result<u16> {
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
    pub async fn shards(&self, activity_id: i64) -> anyhow::Result<Vec<Shard>> {
        let k = self.buckets(activity_id).await?;
        Ok((0..k).map(|b| Shard::new(activity_id, b, k)).collect())
    }

    /// The shard a reservation lives in: its activity and the bucket its id names.
    pub async fn shard_of(&self, activity_id: i64, reservation_id: &str) -> anyhow::Result<Shard> {
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
    pub async fn home_shard(&self, activity_id: i64, user_id: i64) -> anyhow::Result<Shard> {
        let k = self.buckets(activity_id).await?;
        Ok(Shard::new(
            activity_id,
            crate::domain::ids::home_bucket(user_id, k),
            k,
        ))
    }

    pub async fn ping(&self) -> anyhow::Result<()> {
        let mut conn = self.pool.get().await?;
        let _: String = redis::cmd("PING").query_async(&mut *conn).await?;
        Ok(())
    }

    /// The atomic reservation: activity open, request idempotency, one per buyer, stock > 0.
    pub async fn reserve(&self, a: &ReserveArgs<'_>) -> anyhow::Result<ReserveResult> {
        let k = &self.keys;
        // The bucket the reservation id names (the caller minted it for the buyer's home).
        let shard = self
            .shard_of(a.reservation.activity_id, a.reservation.reservation_id)
            .await?;
        let mut conn = self.pool.get().await?;
        let parts: Vec<String> = self
            .scripts
            .reserve
            .key(k.meta(shard))
            .key(k.sku(shard, a.reservation.sku_id))
            .key(k.buyers(shard, a.reservation.sku_id))
            .key(k.requests(shard))
            .key(k.pending(shard))
            .key(k.pending_since(shard))
            .key(k.rate_bucket(shard, "ip", a.limits.client_addr))
            .key(k.rate_bucket(shard, "u", &a.reservation.user_id.to_string()))
            .arg(a.now_ms)
            .arg(a.reservation.user_id)
            .arg(a.reservation.request_id)
            .arg(a.reservation.reservation_id)
            .arg(a.reservation.message_id)
            .arg(a.reservation.order_id)
            .arg(a.reservation.sku_id)
            .arg(a.reservation.activity_id)
            .arg(a.next_retry_at_ms)
            .arg(k.reservation_prefix(shard))
            .arg(a.traceparent)
            .arg(a.valid_secs + RESERVATION_TTL_MARGIN_SECS)
            .arg(if a.limits.client_addr.is_empty() {
                0.0
            } else {
                a.limits.address_rate_per_sec
            })
            .arg(a.limits.address_burst)
            .arg(a.limits.buyer_rate_per_sec)
            .arg(a.limits.buyer_burst)
            .arg(a.channel)
            .invoke_async(&mut *conn)
            .await?;
        let code = parts.first().map(String::as_str).unwrap_or("");
        Ok(match code {
            "OK" => ReserveResult::Reserved(view(&parts)),
            "DUPLICATE_REQUEST" => ReserveResult::Duplicate(view(&parts)),
            "ALREADY_PURCHASED" => ReserveResult::AlreadyPurchased {
                reservation_id: parts.get(1).cloned().unwrap_or_default(),
            },
            "REQUEST_ID_REUSED" => ReserveResult::RequestIdReused {
                reservation_id: parts.get(1).cloned().unwrap_or_default(),
                sku_id: parts.get(2).cloned().unwrap_or_default(),
            },
            "SOLD_OUT" => ReserveResult::SoldOut,
            "NOT_STARTED" => ReserveResult::NotStarted,
            "ENDED" => ReserveResult::Ended,
            "RATE_LIMITED" => ReserveResult::RateLimited {
                by: parts.get(1).cloned().unwrap_or_default(),
                retry_ms: parts.get(2).and_then(|v| v.parse().ok()).unwrap_or(1000),
            },
            "PAUSED" => ReserveResult::Paused {
                reason: parts.get(1).cloned().unwrap_or_default(),
            },
            "NOT_FOUND" => ReserveResult::NotFound,
            other => anyhow::bail!("reserve script returned an unknown code {other:?}"),
        })
    }

    /// The activity of an older reservation whose id does not name it (`rsv_<ulid>`), from the
    /// location key earlier versions wrote beside it; read-only, for lookups by id.
    pub async fn legacy_location(&self, reservation_id: &str) -> anyhow::Result<Option<i64>> {
        let mut conn = self.pool.get().await?;
        Ok(conn.get(self.keys.location(reservation_id)).await?)
    }

    /// CONFIRMED → MQ_SENT. Returns the script's verdict (`OK`, `MQ_SENT`, `MISSING`, ...).
    pub async fn mark_sent(
        &self,
        activity_id: i64,
        reservation_id: &str,
        message_id: &str,
        broker_msg_id: &str,
        now_ms: i64,
    ) -> anyhow::Result<String> {
        let now = now_ms.to_string();
        let shard = self.shard_of(activity_id, reservation_id).await?;
        let call = self.sent_call(shard, reservation_id, message_id, broker_msg_id, &now);
        self.invoke(call).await
    }

    /// Runs one script call on a pooled connection.
    async fn invoke(&self, call: redis::ScriptInvocation<'_>) -> anyhow::Result<String> {
        let mut conn = self.pool.get().await?;
        Ok(call.invoke_async(&mut *conn).await?)
    }

    /// `mark_sent.lua` for a confirmed send: MQ_SENT with the broker's id and the time, and
    /// into the awaiting index until the scanner sees it consumed.
    fn sent_call<'a>(
        &'a self,
        shard: Shard,
        reservation_id: &str,
        message_id: &str,
        broker_msg_id: &str,
        sent_at: &str,
    ) -> redis::ScriptInvocation<'a> {
        self.leave_pending_call(
            shard,
            reservation_id,
            message_id,
            ("MQ_SENT", sent_at),
            &[("broker_msg_id", broker_msg_id), ("sent_at", sent_at)],
        )
    }

    /// `MQ_PENDING` → `mq_status` with `fields` recorded, out of both pending indexes
    /// (`mark_sent.lua`, a compare-and-set on `message_id`); `status.1` is the score to watch
    /// it by in the awaiting index (`""`: not watched).
    fn leave_pending_call(
        &self,
        shard: Shard,
        reservation_id: &str,
        message_id: &str,
        status: (&str, &str),
        fields: &[(&str, &str)],
    ) -> redis::ScriptInvocation<'_> {
        let mut call = self.scripts.mark_sent.prepare_invoke();
        call.key(self.keys.reservation(shard, reservation_id))
            .key(self.keys.pending(shard))
            .key(self.keys.pending_since(shard))
            .key(self.keys.awaiting(shard))
            .arg(message_id)
            .arg(reservation_id)
            .arg(status.0)
            .arg(status.1);
        for (field, value) in fields {
            call.arg(*field).arg(*value);
        }
        call
    }

    /// Records first sends the broker confirmed, MQ_PENDING → MQ_SENT, in one round trip per
    /// Redis node. Verdicts in order, as `mark_sent`.
    pub async fn mark_sent_many(&self, marks: &[SentMark]) -> anyhow::Result<Vec<String>> {
        let sent_at: Vec<String> = marks.iter().map(|m| m.sent_at_ms.to_string()).collect();
        let mut shards = Vec::with_capacity(marks.len());
        for m in marks {
            shards.push(self.shard_of(m.activity_id, &m.reservation_id).await?);
        }
        let calls: Vec<(u16, redis::ScriptInvocation<'_>)> = marks
            .iter()
            .zip(&sent_at)
            .zip(&shards)
            .map(|((m, at), &shard)| {
                let call = self.sent_call(
                    shard,
                    &m.reservation_id,
                    &m.message_id,
                    &m.broker_msg_id,
                    at,
                );
                (self.slot(shard), call)
            })
            .collect();
        self.pipelined(&self.scripts.mark_sent, &calls).await
    }

    /// UNKNOWN → stays MQ_PENDING, re-send scheduled; never gives stock back.
    pub async fn schedule_resend(
        &self,
        activity_id: i64,
        reservation_id: &str,
        message_id: &str,
        next_retry_at_ms: i64,
        error: &str,
    ) -> anyhow::Result<String> {
        let shard = self.shard_of(activity_id, reservation_id).await?;
        let mut conn = self.pool.get().await?;
        Ok(self
            .scripts
            .schedule_resend
            .key(self.keys.reservation(shard, reservation_id))
            .key(self.keys.pending(shard))
            .arg(message_id)
            .arg(reservation_id)
            .arg(next_retry_at_ms)
            .arg(error)
            .invoke_async(&mut *conn)
            .await?)
    }

    /// DEFINITE_FAILURE → MQ_FAILED and the reservation released once; `UNCERTAIN` (nothing
    /// changed, still MQ_PENDING) when an earlier attempt may have been stored.
    pub async fn mark_failed(
        &self,
        activity_id: i64,
        sku_id: i64,
        reservation_id: &str,
        message_id: &str,
        error: &str,
        now_ms: i64,
    ) -> anyhow::Result<String> {
        let k = &self.keys;
        let shard = self.shard_of(activity_id, reservation_id).await?;
        let mut conn = self.pool.get().await?;
        Ok(self
            .scripts
            .mark_failed
            .key(k.reservation(shard, reservation_id))
            .key(k.pending(shard))
            .key(k.sku(shard, sku_id))
            .key(k.buyers(shard, sku_id))
            .key(k.requests(shard))
            .key(k.pending_since(shard))
            .arg(message_id)
            .arg(reservation_id)
            .arg(error)
            .arg(now_ms)
            .invoke_async(&mut *conn)
            .await?)
    }

    /// An uncertain reservation settled from PostgreSQL: out of the pending indexes with
    /// `mq_status` (`MQ_SENT` or `MQ_FENCED`). Returns `OK`, or the status it already had.
    pub async fn settle(
        &self,
        activity_id: i64,
        reservation_id: &str,
        message_id: &str,
        mq_status: &str,
        now_ms: i64,
    ) -> anyhow::Result<String> {
        let now = now_ms.to_string();
        let fields = [("settled_at", now.as_str())];
        let shard = self.shard_of(activity_id, reservation_id).await?;
        // Settled from PostgreSQL: the inbox already decided, nothing left to watch.
        let call =
            self.leave_pending_call(shard, reservation_id, message_id, (mq_status, ""), &fields);
        self.invoke(call).await
    }

    /// One SKU's remaining stock and `taken` counter, and its winners unless `known_taken` is
    /// current (or stock is back), in one call (`sold_out_view.lua`).
    pub async fn sold_out_view(
        &self,
        shard: Shard,
        sku_id: i64,
        known_taken: Option<i64>,
    ) -> anyhow::Result<SoldOutView> {
        let mut conn = self.pool.get().await?;
        let v: Vec<i64> = self
            .scripts
            .sold_out_view
            .key(self.keys.sku(shard, sku_id))
            .key(self.keys.buyers(shard, sku_id))
            .arg(known_taken.unwrap_or(-1))
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
    /// (docs/ARCHITECTURE.md#stock-buckets). The split cannot change once warmed
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
    ) -> anyhow::Result<WarmResult> {
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
                .key(self.keys.meta(shard))
                .key(self.keys.sku(shard, sku_id))
                .key(self.keys.buyers(shard, sku_id))
                .key(self.keys.requests(shard))
                .key(self.keys.pending(shard))
                .key(self.keys.pending_since(shard))
                .arg(starts_at_ms)
                .arg(ends_at_ms)
                .arg(valid_ms)
                .arg(share)
                .arg(buckets)
                .invoke_async(&mut *conn)
                .await?;
            results.push(match code.as_str() {
                "CREATED" => WarmResult::Created,
                "UNCHANGED" => WarmResult::Unchanged,
                "UPDATED" => WarmResult::Updated,
                "STOCK_IN_USE" => WarmResult::StockInUse,
                other => anyhow::bail!("warm script returned an unknown code {other:?}"),
            });
        }
        if let Ok(mut m) = self.buckets.write() {
            m.insert(activity_id, buckets);
        }
        Ok(if results.contains(&WarmResult::StockInUse) {
            WarmResult::StockInUse
        } else if results.iter().all(|r| *r == WarmResult::Created) {
            WarmResult::Created
        } else if results.iter().all(|r| *r == WarmResult::Unchanged) {
            WarmResult::Unchanged
        } else {
            WarmResult::Updated
        })
    }

    /// All fields of one reservation hash (empty when unknown).
    pub async fn reservation(
        &self,
        activity_id: i64,
        reservation_id: &str,
    ) -> anyhow::Result<HashMap<String, String>> {
        let shard = self.shard_of(activity_id, reservation_id).await?;
        let mut conn = self.pool.get().await?;
        Ok(conn
            .hgetall(self.keys.reservation(shard, reservation_id))
            .await?)
    }

    /// Pauses (`Some(reason)`) or resumes (`None`) new reservations of an activity, or of one
    /// of its SKUs. `false` when the activity (or SKU) was never warmed into Redis.
    pub async fn set_paused(
        &self,
        activity_id: i64,
        sku_id: Option<i64>,
        reason: Option<&str>,
    ) -> anyhow::Result<bool> {
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
                .key(key)
                .arg(if reason.is_some() { "1" } else { "0" })
                .arg(reason.unwrap_or(""))
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
    ) -> anyhow::Result<Option<String>> {
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
    /// ([`RedisStore::bucket_stock`] has them apart).
    pub async fn sku_stock(
        &self,
        activity_id: i64,
        sku_id: i64,
    ) -> anyhow::Result<Option<(i64, i64)>> {
        let stock = self.bucket_stock(activity_id, sku_id).await?;
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
    ) -> anyhow::Result<Census> {
        let mut census = Census::default();
        for shard in self.shards(activity_id).await? {
            self.shard_census(shard, sku_id, &mut census).await?;
        }
        Ok(census)
    }

    /// The census of one shard's reservation hashes, added to `census`.
    async fn shard_census(
        &self,
        shard: Shard,
        sku_id: i64,
        census: &mut Census,
    ) -> anyhow::Result<()> {
        let mut conn = self.pool.get().await?;
        let prefix = self.keys.reservation_prefix(shard);
        let pattern = format!("{prefix}*");
        let slot = self.keys.slot(shard);
        let mut cursor: u64 = 0;
        let sku = sku_id.to_string();
        loop {
            let (next, keys) = conn.scan_page(slot, cursor, &pattern).await?;
            if !keys.is_empty() {
                let mut pipe = redis::pipe();
                for key in &keys {
                    pipe.cmd("HMGET").arg(key).arg("sku_id").arg("status");
                }
                let rows: Vec<(Option<String>, Option<String>)> =
                    pipe.query_async(&mut *conn).await?;
                for (key, (s, status)) in keys.iter().zip(rows) {
                    if s.as_deref() != Some(sku.as_str()) {
                        continue;
                    }
                    let status = status.unwrap_or_default();
                    if status == "RESERVED" {
                        census
                            .reserved_ids
                            .push(key.trim_start_matches(prefix.as_str()).to_string());
                    }
                    *census.by_status.entry(status).or_default() += 1;
                }
            }
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
        Ok(())
    }

    /// Compensation: releases each reservation once, in one round trip (the release script
    /// pipelined). Returns `RELEASED`, `ALREADY_RELEASED` or `MISSING` per item, in order.
    pub async fn release_many(
        &self,
        items: &[Release<'_>],
        now_ms: i64,
    ) -> anyhow::Result<Vec<String>> {
        let k = &self.keys;
        let script = &self.scripts.release;
        // The unit goes back to the bucket the reservation took it from.
        let mut shards = Vec::with_capacity(items.len());
        for r in items {
            shards.push(self.shard_of(r.activity_id, r.reservation_id).await?);
        }
        let calls: Vec<(u16, redis::ScriptInvocation<'_>)> = items
            .iter()
            .zip(&shards)
            .map(|(r, &shard)| {
                let mut call = script.prepare_invoke();
                call.key(k.reservation(shard, r.reservation_id))
                    .key(k.sku(shard, r.sku_id))
                    .key(k.buyers(shard, r.sku_id))
                    .key(k.requests(shard))
                    .key(k.pending(shard))
                    .key(k.pending_since(shard))
                    .arg(r.reservation_id)
                    .arg(r.reason)
                    .arg(now_ms);
                (self.slot(shard), call)
            })
            .collect();
        self.pipelined(script, &calls).await
    }

    /// Runs the calls of one script pipelined, answers in call order: one pipeline per hash slot
    /// (each call's slot given beside it, see [`RedisStore::slot`]: all 0 on one server, so one
    /// round trip), sent side by side. A Redis that lost its script cache (a restart, a promoted replica)
    /// answers NOSCRIPT: the script is loaded and the pipeline sent again; each script here is
    /// idempotent per key.
    async fn pipelined<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        calls: &[(u16, redis::ScriptInvocation<'_>)],
    ) -> anyhow::Result<Vec<T>> {
        if calls.is_empty() {
            return Ok(Vec::new());
        }
        let mut by_slot: std::collections::BTreeMap<u16, Vec<usize>> = Default::default();
        for (i, (slot, _)) in calls.iter().enumerate() {
            by_slot.entry(*slot).or_default().push(i);
        }
        let groups: Vec<Vec<usize>> = by_slot.into_values().collect();
        let answers = futures::future::try_join_all(groups.iter().map(|idx| {
            let mut pipe = redis::pipe();
            for &i in idx {
                pipe.invoke_script(&calls[i].1);
            }
            async move { self.run_pipe::<T>(script, &pipe).await }
        }))
        .await?;
        let mut ordered: Vec<Option<T>> = (0..calls.len()).map(|_| None).collect();
        for (idx, group) in groups.iter().zip(answers) {
            for (&i, answer) in idx.iter().zip(group) {
                ordered[i] = Some(answer);
            }
        }
        ordered
            .into_iter()
            .map(|a| a.ok_or_else(|| anyhow::anyhow!("a pipelined call got no answer")))
            .collect()
    }

    /// Sends `pipe` (whose scripts are all `script`) in one round trip; on NOSCRIPT, loads the
    /// script and sends it again (every command in these pipelines is idempotent). On a
    /// cluster, a pipeline answered with a redirection or a cluster-down error (a failover
    /// moving its slot: the client follows the new owner once its slot map is refreshed) is
    /// sent again, every [`REDIRECT_RETRY_WAIT`] for at most [`REDIRECT_RETRIES`] times,
    /// counted in `redis_cluster_redirect_retry_total`.
    async fn run_pipe<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        pipe: &redis::Pipeline,
    ) -> anyhow::Result<Vec<T>> {
        if pipe.is_empty() {
            return Ok(Vec::new());
        }
        let mut conn = self.pool.get().await?;
        let mut retries = 0;
        loop {
            let err = match pipe.query_async(&mut *conn).await {
                Ok(answers) => return Ok(answers),
                Err(e) if e.kind() == redis::ErrorKind::NoScriptError => {
                    script.prepare_invoke().load_async(&mut *conn).await?;
                    match pipe.query_async(&mut *conn).await {
                        Ok(answers) => return Ok(answers),
                        Err(e) => e,
                    }
                }
                Err(e) => e,
            };
            if !(self.cluster && redirected(&err) && retries < REDIRECT_RETRIES) {
                return Err(err.into());
            }
            retries += 1;
            metrics::counter!("redis_cluster_redirect_retry_total").increment(1);
            tokio::time::sleep(REDIRECT_RETRY_WAIT).await;
        }
    }

    /// Leases up to `batch` due reservations of one shard to `owner` for `lease_ms`.
    pub async fn claim_due(
        &self,
        shard: impl Into<Shard>,
        now_ms: i64,
        batch: usize,
        owner: &str,
        lease_ms: u64,
    ) -> anyhow::Result<Claimed> {
        let k = &self.keys;
        let shard = shard.into();
        let mut conn = self.pool.get().await?;
        let raw: Vec<redis::Value> = self
            .scripts
            .claim
            .key(k.pending(shard))
            .key(k.pending_since(shard))
            .key(k.meta(shard))
            .arg(now_ms)
            .arg(batch)
            .arg(owner)
            .arg(lease_ms)
            .arg(k.reservation_prefix(shard))
            .arg(RETIRE_AFTER_END_MS)
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
    ) -> anyhow::Result<(u64, Vec<HashMap<String, String>>)> {
        let k = &self.keys;
        let mut conn = self.pool.get().await?;
        let raw: Vec<redis::Value> = self
            .scripts
            .claim_awaiting
            .key(k.awaiting(shard))
            .arg(cutoff_ms)
            .arg(batch)
            .arg(lease_ms)
            .arg(k.reservation_prefix(shard))
            .invoke_async(&mut *conn)
            .await?;
        let Some((first, rest)) = raw.split_first() else {
            anyhow::bail!("claim_awaiting.lua answered nothing");
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
    ) -> anyhow::Result<()> {
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
    pub async fn retire_activity(&self, activity_id: i64, keep_secs: u64) -> anyhow::Result<u64> {
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
    async fn expire_shard(&self, shard: Shard, keep_secs: u64) -> anyhow::Result<u64> {
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

    /// Applies order events to the projection, each only if it is newer than what is there,
    /// in one round trip (in order). Returns `APPLIED` or `STALE` per event.
    pub async fn project_many(
        &self,
        events: &[&crate::domain::events::OrderEventHeader],
        ttl_secs: u64,
        now_ms: i64,
    ) -> anyhow::Result<Vec<String>> {
        let script = &self.scripts.project;
        let calls: Vec<(u16, redis::ScriptInvocation<'_>)> = events
            .iter()
            .map(|event| {
                let key = self.keys.projection(&event.reservation_id);
                let slot = if self.cluster { pool::slot(&key) } else { 0 };
                let mut call = script.prepare_invoke();
                call.key(key)
                    .arg(event.aggregate_version)
                    .arg(&event.status)
                    .arg(&event.order_id)
                    .arg(&event.reservation_id)
                    .arg(ttl_secs)
                    .arg(now_ms)
                    .arg(event.user_id);
                (slot, call)
            })
            .collect();
        self.pipelined(script, &calls).await
    }

    /// The projected order status of a reservation (empty when none yet).
    pub async fn projection(
        &self,
        reservation_id: &str,
    ) -> anyhow::Result<HashMap<String, String>> {
        let mut conn = self.pool.get().await?;
        Ok(conn.hgetall(self.keys.projection(reservation_id)).await?)
    }

    /// Activities whose stock was warmed (the scanner's work list).
    pub async fn activities(&self) -> anyhow::Result<Vec<i64>> {
        let mut conn = self.pool.get().await?;
        Ok(conn.smembers(self.keys.activities()).await?)
    }

    /// `(count, oldest creation ms)` of the unconfirmed reservations of one activity, over
    /// its buckets.
    pub async fn pending_stats(&self, activity_id: i64) -> anyhow::Result<(i64, Option<i64>)> {
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

    /// The reservation a buyer's request made in the activity, if Redis has it (the request
    /// index that answers a repeated request).
    pub async fn request_reservation(
        &self,
        activity_id: i64,
        user_id: i64,
        request_id: &str,
    ) -> anyhow::Result<Option<String>> {
        let shard = self.home_shard(activity_id, user_id).await?;
        let mut conn = self.pool.get().await?;
        Ok(conn
            .hget(self.keys.requests(shard), format!("{user_id}:{request_id}"))
            .await?)
    }

    /// Size of the activity's pending (not yet confirmed) index, over its buckets.
    pub async fn pending_count(&self, activity_id: i64) -> anyhow::Result<i64> {
        let mut conn = self.pool.get().await?;
        let mut total = 0;
        for shard in self.shards(activity_id).await? {
            let n: i64 = conn.zcard(self.keys.pending(shard)).await?;
            total += n;
        }
        Ok(total)
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
