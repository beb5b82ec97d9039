//! Where the store's keys live: an activity's stock buckets as hash tags (`Shard`) and every
//! key name (`Keys`), all of one bucket under one tag so its scripts stay atomic on a cluster.

use std::collections::HashMap;

use super::pool;

/// Where an activity's keys live: the activity and one of its `buckets` stock buckets
/// (docs/architecture/redis.md#stock-buckets). Bucket 0 is the activity's own hash tag
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

impl Default for Shard {
    /// No activity's shard (activity 0): a placeholder until one is named.
    fn default() -> Self {
        Self::new(0, 0, 1)
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
    /// Present (with a lease's TTL) while a rebuild reads and writes the shard: the scripts
    /// that move its stock answer `HELD` (docs/architecture/redis.md#when-redis-forgets).
    pub fn rebuilding(&self, shard: impl Into<Shard>) -> String {
        format!("{}:rebuilding", self.tag(shard))
    }
    pub fn sku(&self, shard: impl Into<Shard>, sku_id: i64) -> String {
        format!("{}:sku:{}", self.tag(shard), sku_id)
    }
    pub fn buyers(&self, shard: impl Into<Shard>, sku_id: i64) -> String {
        format!("{}{}", self.buyers_prefix(shard), sku_id)
    }
    /// A SKU's buyers key is this and its id (reserve.lua reads another SKU's buyers).
    pub fn buyers_prefix(&self, shard: impl Into<Shard>) -> String {
        format!("{}:buyers:", self.tag(shard))
    }
    pub fn requests(&self, shard: impl Into<Shard>) -> String {
        format!("{}:req", self.tag(shard))
    }
    /// A SKU's fair-start draw: its entrants (buyer ids) scored by ticket
    /// (docs/architecture/hot-path.md#a-fair-start).
    pub fn draw(&self, shard: impl Into<Shard>, sku_id: i64) -> String {
        format!("{}:draw:{}", self.tag(shard), sku_id)
    }
    /// The bucket's buyers whose sale pass holds a reservation: user id → the SKU it holds
    /// (docs/architecture/hot-path.md#sale-passes).
    pub fn passes_used(&self, shard: impl Into<Shard>) -> String {
        format!("{}:passes", self.tag(shard))
    }
    pub fn pending(&self, shard: impl Into<Shard>) -> String {
        format!("{}:pending", self.tag(shard))
    }
    /// Unconfirmed reservations scored by creation time: its head gives the oldest age.
    pub fn pending_since(&self, shard: impl Into<Shard>) -> String {
        format!("{}:pending_since", self.tag(shard))
    }
    /// Confirmed sends not yet seen taken by the consumers, scored by when their last copy
    /// was sent (docs/architecture/messages.md#a-dead-brokers-messages).
    pub fn awaiting(&self, shard: impl Into<Shard>) -> String {
        format!("{}:awaiting", self.tag(shard))
    }
    /// A caller's rate-limit bucket in an activity (`kind` "u" for a buyer, "ip" for a client
    /// address), under the shard's hash tag so the reserve script takes its token in the
    /// same call (docs/architecture/hot-path.md#abuse-limits).
    pub fn rate_bucket(&self, shard: impl Into<Shard>, kind: &str, caller: &str) -> String {
        format!("{}:rl:{}:{}", self.tag(shard), kind, caller)
    }
    /// The SKUs warmed into an activity (bucket 0 only): what the rebalancer walks.
    pub fn skus(&self, activity_id: i64) -> String {
        format!("{}:skus", self.tag(activity_id))
    }
    /// Transfers of a SKU's units out of a bucket: transfer id → "<to> <units> <ms>", kept
    /// as the trail (docs/architecture/redis.md#moving-leftovers).
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
    /// the hash tag of the activity its id names (docs/architecture/messages.md#identifiers).
    pub fn projection(&self, reservation_id: &str) -> String {
        match crate::domain::ids::reservation_activity(reservation_id) {
            Some(activity_id) => format!("{}:proj:{}", self.tag(activity_id), reservation_id),
            None => format!("{}:proj:{}", self.prefix, reservation_id),
        }
    }
    /// reservation_id → activity_id, outside the hash tag, written by earlier versions for
    /// reservation ids that did not name their activity
    /// (docs/architecture/messages.md#identifiers).
    pub fn location(&self, reservation_id: &str) -> String {
        format!("{}:rsvloc:{}", self.prefix, reservation_id)
    }
}
