//! Non-core work steps aside while orders are behind (docs/architecture/recovery.md#projection):
//! when the order-create backlog's oldest message is older than
//! `consumer.projection_defer_lag_secs`, the projection holds each batch it is handed (at most
//! [`MAX_HOLD`]), so its Redis writes and the client's pulls for it leave the room to order
//! creation; it resumes when the backlog is back under half the threshold (hysteresis). The role's
//! backlog sampling feeds it every second; stopping the role releases every held batch at once.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// The longest one batch is held: past it, it is applied anyway.
pub const MAX_HOLD: Duration = Duration::from_secs(30);

/// How often a held batch looks again.
const RECHECK: Duration = Duration::from_millis(250);

pub struct Deferral {
    threshold: Duration,
    active: AtomicBool,
    released: CancellationToken,
    /// Batches held right now.
    holding: AtomicU64,
}

impl Deferral {
    /// Defers past `threshold` (zero: never).
    pub fn new(threshold: Duration) -> Self {
        metrics::gauge!("projection_deferred").set(0.0);
        Self {
            threshold,
            active: AtomicBool::new(false),
            released: CancellationToken::new(),
            holding: AtomicU64::new(0),
        }
    }

    /// The order-create backlog's oldest message is `age` old: defer past the threshold,
    /// resume under half of it. Returns whether deferring.
    pub fn note_backlog(&self, age: Duration) -> bool {
        if self.threshold.is_zero() {
            return false;
        }
        let was = self.active.load(Ordering::Relaxed);
        let now = if was {
            age > self.threshold / 2
        } else {
            age > self.threshold
        };
        if now != was {
            self.active.store(now, Ordering::Relaxed);
            metrics::gauge!("projection_deferred").set(if now { 1.0 } else { 0.0 });
            if now {
                tracing::warn!(
                    backlog_age_s = age.as_secs_f64(),
                    "orders are behind: the projection steps aside"
                );
            } else {
                tracing::info!(backlog_age_s = age.as_secs_f64(), "the projection resumes");
            }
        }
        now
    }

    pub fn active(&self) -> bool {
        self.active.load(Ordering::Relaxed) && !self.released.is_cancelled()
    }

    /// Batches held right now.
    pub fn holding(&self) -> u64 {
        self.holding.load(Ordering::Relaxed)
    }

    /// The role stops: nothing is held any more.
    pub fn release(&self) {
        self.released.cancel();
    }

    /// Holds the caller while deferring, at most `max`; returns how long it held.
    pub async fn hold(&self, max: Duration) -> Duration {
        let started = tokio::time::Instant::now();
        if !self.active() {
            return Duration::ZERO;
        }
        metrics::counter!("projection_deferred_batches_total").increment(1);
        self.holding.fetch_add(1, Ordering::Relaxed);
        while self.active() && started.elapsed() < max {
            tokio::select! {
                _ = self.released.cancelled() => break,
                _ = tokio::time::sleep(RECHECK) => {}
            }
        }
        self.holding.fetch_sub(1, Ordering::Relaxed);
        started.elapsed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defers_past_the_threshold_and_resumes_under_half_of_it() {
        let d = Deferral::new(Duration::from_secs(10));
        let s = Duration::from_secs;
        assert!(!d.note_backlog(s(9)));
        assert!(d.note_backlog(s(11)));
        assert!(d.note_backlog(s(6)), "hysteresis: still deferring");
        assert!(!d.note_backlog(s(4)));
        let never = Deferral::new(Duration::ZERO);
        assert!(!never.note_backlog(s(3600)), "0: never");
    }

    #[tokio::test(start_paused = true)]
    async fn a_held_batch_goes_when_the_backlog_clears_or_the_role_stops() {
        let d = std::sync::Arc::new(Deferral::new(Duration::from_secs(10)));
        assert_eq!(d.hold(MAX_HOLD).await, Duration::ZERO, "nothing to defer");
        d.note_backlog(Duration::from_secs(20));
        // Held until the backlog clears.
        let held = tokio::spawn({
            let d = d.clone();
            async move { d.hold(MAX_HOLD).await }
        });
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(!held.is_finished());
        d.note_backlog(Duration::from_secs(1));
        let waited = held.await.unwrap();
        assert!(
            waited >= Duration::from_secs(3) && waited < Duration::from_secs(4),
            "{waited:?}"
        );
        // Never longer than the bound.
        d.note_backlog(Duration::from_secs(20));
        assert!(d.hold(Duration::from_secs(5)).await >= Duration::from_secs(5));
        // Released at once when the role stops.
        d.release();
        assert_eq!(d.hold(MAX_HOLD).await, Duration::ZERO);
    }
}
