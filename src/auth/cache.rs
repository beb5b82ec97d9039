//! Verified buyer tokens, remembered (docs/architecture/security.md#buyer-tokens): a buyer's
//! retries during a sale carry the same token, and each would otherwise cost a signature check.
//! Like Envoy's `jwt_authn` cache, an entry is keyed by a SHA-256 of the *whole* token (header,
//! claims and signature), so only the exact bytes that verified hit: a token with one bit of its
//! signature changed is another key, verified in full, and never stored unless it verifies. An
//! entry is kept no longer than the token's own `exp` (plus the leeway the verifier allows), the
//! cache holds at most `auth.token_cache_entries` (S3-FIFO eviction), and it is emptied whenever
//! the key set changes, so a key the provider withdrew verifies nothing from memory.

use std::sync::atomic::{AtomicU64, Ordering};

use quick_cache::sync::Cache;
use quick_cache::{DefaultHashBuilder, Lifecycle, UnitWeighter};
use sha2::{Digest, Sha256};

/// What a verified token gave: its buyer, and the last second it may still be believed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Verified {
    buyer: i64,
    valid_until: u64,
}

/// Counts evictions into `auth_token_cache_evictions_total`.
#[derive(Clone, Copy, Default)]
struct CountEvictions;

impl Lifecycle<[u8; 32], Verified> for CountEvictions {
    type RequestState = ();

    fn begin_request(&self) -> Self::RequestState {}

    fn on_evict(&self, _: &mut (), _: [u8; 32], _: Verified) {
        metrics::counter!("auth_token_cache_evictions_total").increment(1);
    }
}

/// A bounded map from a token's digest to its verified buyer.
pub struct TokenCache {
    entries: Cache<[u8; 32], Verified, UnitWeighter, DefaultHashBuilder, CountEvictions>,
    /// The second `auth_token_cache_entries` was last set: counting reads every shard, so
    /// it is done at most once a second, not on every insert.
    counted_at: AtomicU64,
}

/// The digest a token is remembered under.
pub fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

impl TokenCache {
    /// A cache of at most `capacity` tokens (at least 1).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        Self {
            entries: Cache::with(
                capacity,
                capacity as u64,
                UnitWeighter,
                DefaultHashBuilder::default(),
                CountEvictions,
            ),
            counted_at: AtomicU64::new(0),
        }
    }

    /// The buyer of a token that verified before and is still within its `exp` at `now`
    /// (seconds since the epoch); an entry past it is dropped and is a miss.
    pub fn get(&self, digest: &[u8; 32], now: u64) -> Option<i64> {
        let hit = match self.entries.get(digest) {
            Some(v) if now <= v.valid_until => Some(v.buyer),
            Some(_) => {
                self.entries.remove(digest);
                None
            }
            None => None,
        };
        let result = if hit.is_some() { "hit" } else { "miss" };
        metrics::counter!("auth_token_cache_total", "result" => result).increment(1);
        hit
    }

    /// Remembers a token that has just verified at `now`, until `valid_until`.
    pub fn insert(&self, digest: [u8; 32], buyer: i64, valid_until: u64, now: u64) {
        self.entries.insert(digest, Verified { buyer, valid_until });
        if self.counted_at.swap(now, Ordering::Relaxed) != now {
            metrics::gauge!("auth_token_cache_entries").set(self.entries.len() as f64);
        }
    }

    /// Forgets every token: the key set they verified against has changed.
    pub fn clear(&self) {
        self.entries.clear();
        metrics::gauge!("auth_token_cache_entries").set(0.0);
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_lives_no_longer_than_its_token() {
        let cache = TokenCache::new(8);
        let d = digest("a.b.c");
        cache.insert(d, 42, 1_000, 0);
        assert_eq!(cache.get(&d, 999), Some(42));
        assert_eq!(cache.get(&d, 1_000), Some(42));
        assert_eq!(cache.get(&d, 1_001), None);
        assert!(cache.is_empty(), "an expired entry is dropped when seen");
        assert_eq!(cache.get(&digest("a.b.d"), 0), None);
    }

    #[test]
    fn the_cache_stays_within_its_bound() {
        let cache = TokenCache::new(100);
        for i in 0..10_000 {
            cache.insert(digest(&format!("token-{i}")), i, u64::MAX, 0);
        }
        assert!(cache.len() <= 100, "{} entries", cache.len());
        cache.clear();
        assert!(cache.is_empty());
    }
}
