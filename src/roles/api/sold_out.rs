//! Sold-out answers from memory (docs/architecture/hot-path.md#sold-out-from-memory). Once Redis
//! has answered SOLD_OUT for a SKU, every later request for it is answered SOLD_OUT by this process
//! without a Redis call, except a request from one of the SKU's winners: a winner may be repeating
//! its request (it must get its reservation back) or asking again (Redis answers
//! ALREADY_PURCHASED), so its requests still go to Redis. The winners are loaded once, with the
//! SKU's `taken` counter, by one script (`sold_out_view.lua`).
//!
//! A poller asks Redis every `api.sold_out_poll_ms` (100 ms) for each flagged SKU's `remaining`
//! and `taken`: stock back (a release) clears the flag, so a free unit is refused for at most
//! one poll; `taken` moved (a unit was released and taken again between two polls) reloads the
//! winners. Each API instance keeps its own flags; they are per SKU and stock bucket
//! (docs/architecture/redis.md#stock-buckets: one bucket sells out before another, and a unit moved
//! into a bucket is stock back like a release) and the keys share the bucket's hash tag, so it
//! works the same on Redis Cluster.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::redis::{RedisStore, Shard, SoldOutView};

/// One SKU in one stock bucket.
type Key = (Shard, i64);

/// One SKU's flag.
#[derive(Debug)]
enum Flag {
    /// Redis said SOLD_OUT; the winners are not loaded yet: every request still goes to Redis.
    Loading,
    /// Sold out with these winners, as of `taken` reservations ever made.
    Known { taken: i64, winners: HashSet<i64> },
}

/// The SKUs this process knows to be sold out.
#[derive(Debug, Default)]
pub struct SoldOut {
    skus: RwLock<HashMap<Key, Flag>>,
}

impl SoldOut {
    /// Whether this request can be answered SOLD_OUT without Redis: the SKU is known sold out
    /// and the buyer is none of its winners.
    pub fn answers(&self, shard: Shard, sku_id: i64, user_id: i64) -> bool {
        let Ok(skus) = self.skus.read() else {
            return false;
        };
        matches!(skus.get(&(shard, sku_id)),
                 Some(Flag::Known { winners, .. }) if !winners.contains(&user_id))
    }

    /// Redis answered SOLD_OUT for the SKU: the poller loads its winners at its next pass.
    pub fn note(&self, shard: Shard, sku_id: i64) {
        if let Ok(mut skus) = self.skus.write() {
            skus.entry((shard, sku_id)).or_insert(Flag::Loading);
        }
    }

    /// The flagged SKUs, with the `taken` their winners were loaded at (`None`: not loaded).
    fn flagged(&self) -> Vec<(Key, Option<i64>)> {
        self.skus.read().map_or_else(
            |_| Vec::new(),
            |skus| {
                skus.iter()
                    .map(|(k, f)| {
                        let taken = match f {
                            Flag::Loading => None,
                            Flag::Known { taken, .. } => Some(*taken),
                        };
                        (*k, taken)
                    })
                    .collect()
            },
        )
    }

    /// Applies what Redis said of one flagged SKU.
    fn apply(&self, key: Key, view: SoldOutView) {
        let Ok(mut skus) = self.skus.write() else {
            return;
        };
        if view.remaining > 0 {
            skus.remove(&key);
            debug!(
                activity_id = key.0.activity_id,
                bucket = key.0.bucket,
                sku_id = key.1,
                remaining = view.remaining,
                "stock is back: sold-out flag cleared"
            );
        } else if let Some(winners) = view.winners {
            skus.insert(
                key,
                Flag::Known {
                    taken: view.taken,
                    winners: winners.into_iter().collect(),
                },
            );
        }
    }

    /// How many SKUs are flagged (for the gauge).
    fn len(&self) -> usize {
        self.skus.read().map_or(0, |s| s.len())
    }
}

/// Keeps the flags true to Redis until `stop`: every `every`, one call per flagged SKU.
pub async fn run_poller(
    sold_out: Arc<SoldOut>,
    redis: RedisStore,
    every: Duration,
    stop: CancellationToken,
) {
    loop {
        for (key, taken) in sold_out.flagged() {
            match redis.stock().sold_out_view(key.0, key.1, taken).await {
                Ok(view) => sold_out.apply(key, view),
                // Left as it is: while Redis cannot be asked, a request sent to it would fail
                // as well; the flag is checked again at the next poll.
                Err(e) => warn!(activity_id = key.0.activity_id, bucket = key.0.bucket,
                                sku_id = key.1, error = %e,
                                "sold-out flag not checked"),
            }
        }
        metrics::gauge!("sold_out_flags").set(sold_out.len() as f64);
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(remaining: i64, taken: i64, winners: Option<Vec<i64>>) -> SoldOutView {
        SoldOutView {
            remaining,
            taken,
            winners,
        }
    }

    #[test]
    fn only_known_sold_out_skus_are_answered_and_never_for_a_winner() {
        let s = SoldOut::default();
        let a = Shard::from(1);
        assert!(!s.answers(a, 1, 7), "nothing known");
        s.note(a, 1);
        assert!(!s.answers(a, 1, 7), "winners not loaded yet: Redis decides");
        assert_eq!(s.flagged(), vec![((a, 1), None)]);
        s.apply((a, 1), view(0, 2, Some(vec![3, 4])));
        assert!(s.answers(a, 1, 7));
        assert!(!s.answers(a, 1, 3), "a winner goes to Redis");
        assert!(!s.answers(a, 2, 7), "another SKU");
        assert!(
            !s.answers(Shard::new(1, 1, 2), 1, 7),
            "another stock bucket of the SKU"
        );
        assert_eq!(s.flagged(), vec![((a, 1), Some(2))]);
    }

    #[test]
    fn stock_back_clears_the_flag_and_a_moved_counter_reloads_the_winners() {
        let s = SoldOut::default();
        let a = Shard::from(1);
        s.note(a, 1);
        s.apply((a, 1), view(0, 2, Some(vec![3, 4])));
        // Taken again between two polls: the new winner is loaded.
        s.apply((a, 1), view(0, 3, Some(vec![3, 5])));
        assert!(!s.answers(a, 1, 5));
        assert!(s.answers(a, 1, 4), "released, no longer a winner");
        // Unchanged: no winners sent, the flag stays.
        s.apply((a, 1), view(0, 3, None));
        assert!(s.answers(a, 1, 7));
        s.apply((a, 1), view(1, 3, None));
        assert!(
            !s.answers(a, 1, 7),
            "a free unit is never refused from memory"
        );
        assert!(s.flagged().is_empty());
    }
}
