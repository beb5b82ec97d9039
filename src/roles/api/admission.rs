//! Fail-closed admission (docs/ARCHITECTURE.md#fail-closed-admission): when the pipeline cannot turn reservations into
//! orders before they expire, taking more only creates work that will be rejected and
//! compensated. The API checks, every `api.admission_check_ms`, how old the oldest
//! unconfirmed reservation is (Redis pending-since index); past
//! `api.fail_closed_share × reservation validity` it answers new reservations with 503
//! SALE_PAUSED and a reason, and it resumes by itself once the age is back under half the
//! bound (hysteresis, so it does not flap).
//!
//! An unreadable lag is not a fresh one: after `api.lag_unreadable_probes` failed probes in a
//! row, with reservations sent since the last good reading, admission closes too, and opens
//! again with the first good reading under half the bound.
//!
//! Reopening is a ramp, not a switch: for `api.resume_ramp_secs` after a pause ends, a share of
//! new reservations growing from 10 % to all is admitted (the rest get 503 SALE_PAUSED and
//! retry), so the backlog that built up during the outage is not met by the full burst at once.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::Utc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::mq::lag::{lag_age, LagSource};
use crate::redis::RedisStore;

/// Shared admission state: read on every reservation, written by the checker.
#[derive(Default)]
pub struct Admission {
    paused: AtomicBool,
    reason: Mutex<String>,
    /// Reservations confirmed by the broker since the last good lag reading: with an
    /// unreadable lag, they may be a backlog nobody measures.
    sent_since_reading: AtomicU64,
    /// How long admission ramps back up after a pause (0: at once).
    ramp: Duration,
    /// When the last pause ended, while the ramp runs.
    reopened: Mutex<Option<Instant>>,
    /// Requests seen during the ramp: admits an exact share of them, evenly spread.
    arrivals: AtomicU64,
}

/// The share of new reservations admitted at the start of a ramp.
const RAMP_START_SHARE: f64 = 0.1;

impl Admission {
    /// Admission that ramps back up over `ramp` after each pause.
    pub fn with_ramp(ramp: Duration) -> Self {
        Self {
            ramp,
            ..Self::default()
        }
    }

    /// `Some(why)` when this new reservation is refused: paused, or resuming and not in the
    /// share admitted yet.
    pub fn refusal(&self) -> Option<String> {
        self.refusal_at(Instant::now())
    }

    fn refusal_at(&self, now: Instant) -> Option<String> {
        if let Some(reason) = self.paused() {
            return Some(reason);
        }
        let mut reopened = self.reopened.lock().ok()?;
        let since = (*reopened)?;
        let elapsed = now.saturating_duration_since(since);
        if elapsed >= self.ramp {
            *reopened = None;
            metrics::gauge!("admission_ramp_share").set(1.0);
            return None;
        }
        drop(reopened);
        let share = RAMP_START_SHARE
            + (1.0 - RAMP_START_SHARE) * elapsed.as_secs_f64() / self.ramp.as_secs_f64();
        metrics::gauge!("admission_ramp_share").set(share);
        // The n-th arrival is admitted when the running count of admissions grows: exactly
        // `share` of any run of arrivals, spread evenly.
        let n = self.arrivals.fetch_add(1, Ordering::Relaxed) as f64;
        if ((n + 1.0) * share).floor() > (n * share).floor() {
            return None;
        }
        Some(format!(
            "resuming after a pause: {:.0}% of new reservations admitted, all in {:.0}s",
            share * 100.0,
            (self.ramp - elapsed).as_secs_f64().ceil()
        ))
    }

    /// `Some(reason)` while new reservations are refused.
    pub fn paused(&self) -> Option<String> {
        if self.paused.load(Ordering::Relaxed) {
            Some(self.reason.lock().map(|r| r.clone()).unwrap_or_default())
        } else {
            None
        }
    }

    /// A reservation's message was confirmed by the broker.
    pub fn note_sent(&self) {
        self.sent_since_reading.fetch_add(1, Ordering::Relaxed);
    }

    /// The lag could not be read `failed` times in a row: closes admission when that reaches
    /// `limit` and reservations were sent since the last good reading. Returns whether paused.
    pub fn lag_unreadable(&self, failed: u32, limit: u32) -> bool {
        let sent = self.sent_since_reading.load(Ordering::Relaxed);
        if failed >= limit && sent > 0 {
            if !self.paused.load(Ordering::Relaxed) {
                warn!(
                    failed_probes = failed,
                    sent_since_reading = sent,
                    "fail closed: the order queue's lag cannot be read"
                );
            }
            self.set(
                true,
                format!(
                    "the order queue's lag cannot be read ({failed} probes in a row) while \
                     {sent} reservations were sent: orders may not keep up"
                ),
            );
        }
        self.paused.load(Ordering::Relaxed)
    }

    fn set(&self, paused: bool, reason: String) {
        if let Ok(mut r) = self.reason.lock() {
            *r = reason;
        }
        let was = self.paused.swap(paused, Ordering::Relaxed);
        if was && !paused && !self.ramp.is_zero() {
            if let Ok(mut reopened) = self.reopened.lock() {
                *reopened = Some(Instant::now());
            }
            self.arrivals.store(0, Ordering::Relaxed);
        }
        metrics::gauge!("admission_paused").set(if paused { 1.0 } else { 0.0 });
    }

    /// One decision from the measured ages (oldest unconfirmed reservation, order-create
    /// consumer lag): pause when either passes `bound`, resume when both are under `bound / 2`.
    pub fn decide(&self, pending_age: Duration, lag_age: Duration, bound: Duration) -> bool {
        let was = self.paused.load(Ordering::Relaxed);
        let worst = pending_age.max(lag_age);
        let now = if was {
            worst > bound / 2
        } else {
            worst > bound
        };
        if now != was {
            let reason = if pending_age >= lag_age {
                format!(
                    "the oldest unconfirmed reservation is {:.1}s old (bound {:.1}s): orders cannot keep up",
                    pending_age.as_secs_f64(),
                    bound.as_secs_f64()
                )
            } else {
                format!(
                    "the order queue's oldest unconsumed message is {:.1}s old (bound {:.1}s): orders cannot keep up",
                    lag_age.as_secs_f64(),
                    bound.as_secs_f64()
                )
            };
            if now {
                warn!(
                    pending_age_s = pending_age.as_secs_f64(),
                    lag_age_s = lag_age.as_secs_f64(),
                    bound_s = bound.as_secs_f64(),
                    "fail closed: new reservations paused"
                );
            } else {
                info!(
                    pending_age_s = pending_age.as_secs_f64(),
                    lag_age_s = lag_age.as_secs_f64(),
                    "pipeline caught up: reservations resumed"
                );
            }
            self.set(now, reason);
        }
        now
    }
}

/// Oldest unconfirmed reservation age over all warmed activities.
pub async fn oldest_pending_age(redis: &RedisStore) -> anyhow::Result<Duration> {
    let now = Utc::now().timestamp_millis();
    let mut oldest: Option<i64> = None;
    let mut total = 0i64;
    for activity_id in redis.activities().await? {
        let (count, head) = redis.pending_stats(activity_id).await?;
        total += count;
        if let Some(h) = head {
            oldest = Some(oldest.map_or(h, |o| o.min(h)));
        }
    }
    let age = oldest.map(|o| (now - o).max(0) as u64).unwrap_or(0);
    metrics::gauge!("reservation_mq_pending").set(total as f64);
    metrics::gauge!("reservation_mq_pending_oldest_age_seconds").set(age as f64 / 1000.0);
    Ok(Duration::from_millis(age))
}

/// How the checker runs: its bound, its period, and how many unreadable lag probes in a row
/// close admission.
#[derive(Debug, Clone, Copy)]
pub struct CheckerSettings {
    pub bound: Duration,
    pub every: Duration,
    pub unreadable_probes: u32,
}

/// Runs the checker until `shutdown`.
pub async fn run_checker(
    admission: Arc<Admission>,
    redis: RedisStore,
    lag: Option<LagSource>,
    c: CheckerSettings,
    shutdown: CancellationToken,
) {
    let mut failed_probes = 0u32;
    loop {
        // Fault-injection point: a loop that dies (`api-admission-loop=panic`).
        fail::fail_point!("api-admission-loop");
        let lag_age = match &lag {
            Some(source) => lag_age(source).await,
            None => Some(Duration::ZERO),
        };
        match lag_age {
            Some(_) => {
                failed_probes = 0;
                admission.sent_since_reading.store(0, Ordering::Relaxed);
            }
            None => {
                failed_probes = failed_probes.saturating_add(1);
                metrics::counter!("admission_lag_unreadable_total").increment(1);
            }
        }
        let closed_blind =
            lag_age.is_none() && admission.lag_unreadable(failed_probes, c.unreadable_probes);
        match oldest_pending_age(&redis).await {
            Ok(_) if closed_blind => {}
            Ok(age) => {
                admission.decide(age, lag_age.unwrap_or(Duration::ZERO), c.bound);
            }
            Err(e) => warn!(error = %e, "admission check failed; keeping the last decision"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(c.every) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_past_the_bound_and_resumes_under_half_of_it() {
        let a = Admission::default();
        let bound = Duration::from_secs(60);
        let s = Duration::from_secs;
        assert!(!a.decide(s(59), s(0), bound));
        assert!(a.decide(s(61), s(0), bound));
        assert!(a
            .paused()
            .unwrap()
            .contains("unconfirmed reservation is 61.0s"));
        assert!(a.decide(s(45), s(0), bound), "hysteresis: still paused");
        assert!(!a.decide(s(29), s(0), bound));
        assert!(a.paused().is_none());
        // The consumer lag alone also closes admission, and says so.
        assert!(a.decide(s(0), s(70), bound));
        assert!(a.paused().unwrap().contains("unconsumed message is 70.0s"));
        assert!(a.decide(s(0), s(31), bound));
        assert!(!a.decide(s(10), s(20), bound));
    }

    #[test]
    fn after_a_pause_admission_ramps_up_from_a_tenth_to_all() {
        let a = Admission::with_ramp(Duration::from_secs(30));
        let bound = Duration::from_secs(60);
        let s = Duration::from_secs;
        assert!(a.refusal().is_none(), "never paused: no ramp");
        assert!(a.decide(s(61), s(0), bound));
        assert!(a.refusal().unwrap().contains("unconfirmed reservation"));
        assert!(!a.decide(s(10), s(0), bound));
        let start = a.reopened.lock().unwrap().unwrap();
        let admitted = |at: Duration| {
            (0..1000)
                .filter(|_| a.refusal_at(start + at).is_none())
                .count()
        };
        assert_eq!(admitted(s(0)), 100, "10 % right after the pause");
        assert_eq!(admitted(s(15)), 550, "halfway: 55 %");
        let refused = a
            .refusal_at(start + s(15))
            .or_else(|| a.refusal_at(start + s(15)));
        assert!(refused.unwrap().contains("resuming after a pause"));
        assert_eq!(admitted(s(30)), 1000, "all once the ramp is over");
        assert!(a.refusal().is_none());
    }

    #[test]
    fn without_a_ramp_admission_reopens_at_once() {
        let a = Admission::default();
        let bound = Duration::from_secs(60);
        assert!(a.decide(Duration::from_secs(61), Duration::ZERO, bound));
        assert!(!a.decide(Duration::ZERO, Duration::ZERO, bound));
        assert!((0..100).all(|_| a.refusal().is_none()));
    }

    #[test]
    fn an_unreadable_lag_closes_admission_once_reservations_went_out() {
        let a = Admission::default();
        let bound = Duration::from_secs(60);
        // Unreadable, but nothing was sent since the last reading: nothing to fear yet.
        assert!(!a.lag_unreadable(10, 8));
        a.note_sent();
        assert!(!a.lag_unreadable(7, 8), "under the configured count");
        assert!(a.lag_unreadable(8, 8));
        assert!(a
            .paused()
            .unwrap()
            .contains("cannot be read (8 probes in a row)"));
        // A good reading under half the bound opens it again.
        assert!(!a.decide(Duration::ZERO, Duration::from_secs(1), bound));
    }
}
