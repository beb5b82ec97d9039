//! Fail-closed admission (docs/architecture/hot-path.md#fail-closed-admission): when the pipeline
//! cannot turn reservations into orders before they expire, taking more only creates work that will
//! be rejected and compensated. The API checks, every `api.admission_check_ms`, how old each
//! activity's oldest unconfirmed reservation is (its Redis pending-since index) and how old the
//! order queue's oldest unconsumed message is (the broker); past `api.fail_closed_share ×
//! reservation validity` it answers new reservations with 503 SALE_PAUSED and a reason, and it
//! resumes by itself once the age is back under half the bound (hysteresis, so it does not flap).
//! An activity whose own reservations wait pauses alone; the order queue is shared by every
//! activity, so its lag pauses them all.
//!
//! An unreadable lag is not a fresh one: after `api.lag_unreadable_probes` failed probes in a
//! row, with reservations sent since the last good reading, admission closes too, and opens
//! again with the first good reading under half the bound.
//!
//! Reopening is a ramp, not a switch: for `api.resume_ramp_secs` after a pause ends, a share of
//! new reservations growing from 10 % to all is admitted (the rest get 503 SALE_PAUSED and
//! retry), so the backlog that built up during the outage is not met by the full burst at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::Utc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::gate::Gate;
use crate::mq::lag::{lag_age, LagSource};
use crate::redis::RedisStore;

/// Shared admission state: read on every reservation, written by the checker.
#[derive(Default)]
pub struct Admission {
    /// The whole API: the shared order queue's lag, or that lag unreadable.
    global: Gate,
    /// Each activity's own: its unconfirmed reservations.
    activities: Mutex<HashMap<i64, Arc<Gate>>>,
    /// Reservations confirmed by the broker since the last good lag reading: with an
    /// unreadable lag, they may be a backlog nobody measures.
    sent_since_reading: AtomicU64,
    /// How long admission ramps back up after a pause (0: at once).
    ramp: Duration,
    /// Activities paused at the last check.
    paused_activities: AtomicU64,
    /// Whether any activity's gate is closed or ramping: while not, a reservation is answered
    /// without looking its activity up (the map's lock stays off the hot path).
    activities_gated: AtomicBool,
}

fn set_ramp_share(share: f64) {
    metrics::gauge!("admission_ramp_share").set(share);
}

impl Admission {
    /// Admission that ramps back up over `ramp` after each pause.
    pub fn with_ramp(ramp: Duration) -> Self {
        metrics::gauge!("admission_paused_activities").set(0.0);
        Self {
            ramp,
            ..Self::default()
        }
    }

    /// `Some(why)` when a new reservation of `activity_id` is refused: the API or the
    /// activity paused, or resuming and this one not in the share admitted yet.
    pub fn refusal(&self, activity_id: i64) -> Option<String> {
        self.refusal_at(activity_id, Instant::now())
    }

    fn refusal_at(&self, activity_id: i64, now: Instant) -> Option<String> {
        if let Some(why) = self.global.refusal_at(now, self.ramp, set_ramp_share) {
            return Some(why);
        }
        if !self.activities_gated.load(Ordering::Relaxed) {
            return None;
        }
        let gate = self.activity_gate(activity_id)?;
        gate.refusal_at(now, self.ramp, |_| {})
            .map(|why| format!("activity {activity_id}: {why}"))
    }

    fn activity_gate(&self, activity_id: i64) -> Option<Arc<Gate>> {
        self.activities.lock().ok()?.get(&activity_id).cloned()
    }

    /// `Some(reason)` while the whole API refuses new reservations.
    pub fn paused(&self) -> Option<String> {
        self.global.paused()
    }

    /// `Some(reason)` while `activity_id` alone refuses new reservations.
    pub fn activity_paused(&self, activity_id: i64) -> Option<String> {
        self.activity_gate(activity_id)?.paused()
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
            if !self.global.is_paused() {
                warn!(
                    failed_probes = failed,
                    sent_since_reading = sent,
                    "fail closed: the order queue's lag cannot be read"
                );
            }
            self.set_global(
                true,
                format!(
                    "the order queue's lag cannot be read ({failed} probes in a row) while \
                     {sent} reservations were sent: orders may not keep up"
                ),
            );
        }
        self.global.is_paused()
    }

    fn set_global(&self, paused: bool, reason: String) {
        self.global.set(paused, reason, self.ramp);
        metrics::gauge!("admission_paused").set(if paused { 1.0 } else { 0.0 });
    }

    /// The whole API's decision from the order queue's lag (its oldest unconsumed message):
    /// pause past `bound`, resume under `bound / 2`. Returns whether paused.
    pub fn decide_lag(&self, lag_age: Duration, bound: Duration) -> bool {
        if let Some(now) = self.global.verdict(lag_age, bound) {
            let age = lag_age.as_secs_f64();
            if now {
                warn!(
                    lag_age_s = age,
                    bound_s = bound.as_secs_f64(),
                    "fail closed: the order queue is behind; every activity paused"
                );
            } else {
                info!(
                    lag_age_s = age,
                    "order queue caught up: reservations resumed"
                );
            }
            self.set_global(
                now,
                format!(
                    "the order queue's oldest unconsumed message is {age:.1}s old (bound {:.1}s): orders cannot keep up",
                    bound.as_secs_f64()
                ),
            );
        }
        self.global.is_paused()
    }

    /// One activity's decision from its oldest unconfirmed reservation: pause it alone past
    /// `bound`, resume under `bound / 2`. Returns whether it is paused.
    pub fn decide_activity(
        &self,
        activity_id: i64,
        pending_age: Duration,
        bound: Duration,
    ) -> bool {
        let gate = match self.activities.lock() {
            Ok(mut gates) => gates.entry(activity_id).or_default().clone(),
            Err(_) => return false,
        };
        if let Some(now) = gate.verdict(pending_age, bound) {
            let age = pending_age.as_secs_f64();
            if now {
                warn!(
                    activity_id,
                    pending_age_s = age,
                    bound_s = bound.as_secs_f64(),
                    "fail closed: this activity's reservations wait; it is paused"
                );
            } else {
                info!(
                    activity_id,
                    pending_age_s = age,
                    "activity caught up: reservations resumed"
                );
            }
            gate.set(
                now,
                format!(
                    "the oldest unconfirmed reservation is {age:.1}s old (bound {:.1}s): orders cannot keep up",
                    bound.as_secs_f64()
                ),
                self.ramp,
            );
            if now {
                self.activities_gated.store(true, Ordering::Relaxed);
            }
        }
        gate.is_paused()
    }

    /// Forgets the activities no longer warmed, notes whether any gate still refuses anything
    /// (closed or ramping), and exports how many are paused (when that changed).
    fn keep_activities(&self, warmed: &[i64]) {
        if let Ok(mut gates) = self.activities.lock() {
            gates.retain(|id, _| warmed.contains(id));
            let now = Instant::now();
            let gated = gates.values().any(|g| g.gated_at(now, self.ramp));
            self.activities_gated.store(gated, Ordering::Relaxed);
            let paused = gates.values().filter(|g| g.is_paused()).count() as u64;
            if self.paused_activities.swap(paused, Ordering::Relaxed) != paused {
                metrics::gauge!("admission_paused_activities").set(paused as f64);
            }
        }
    }
}

/// Each warmed activity's oldest unconfirmed reservation age, and the totals as gauges.
pub async fn pending_ages(redis: &RedisStore) -> anyhow::Result<Vec<(i64, Duration)>> {
    let now = Utc::now().timestamp_millis();
    let mut out = Vec::new();
    let (mut total, mut oldest) = (0i64, Duration::ZERO);
    for activity_id in redis.activities().await? {
        let (count, head) = redis.recovery().pending_stats(activity_id).await?;
        total += count;
        let age = head.map(|h| (now - h).max(0) as u64).unwrap_or(0);
        let age = Duration::from_millis(age);
        oldest = oldest.max(age);
        out.push((activity_id, age));
    }
    metrics::gauge!("reservation_mq_pending").set(total as f64);
    metrics::gauge!("reservation_mq_pending_oldest_age_seconds").set(oldest.as_secs_f64());
    Ok(out)
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
        if !closed_blind {
            admission.decide_lag(lag_age.unwrap_or(Duration::ZERO), c.bound);
        }
        match pending_ages(&redis).await {
            Ok(ages) => {
                for (activity_id, age) in &ages {
                    admission.decide_activity(*activity_id, *age, c.bound);
                }
                let warmed: Vec<i64> = ages.iter().map(|(id, _)| *id).collect();
                admission.keep_activities(&warmed);
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
        assert!(!a.decide_activity(7, s(59), bound));
        assert!(a.decide_activity(7, s(61), bound));
        assert!(a
            .activity_paused(7)
            .unwrap()
            .contains("unconfirmed reservation is 61.0s"));
        assert!(
            a.decide_activity(7, s(45), bound),
            "hysteresis: still paused"
        );
        assert!(!a.decide_activity(7, s(29), bound));
        assert!(a.activity_paused(7).is_none());
        // The order queue's lag closes the whole API, and says so.
        assert!(a.decide_lag(s(70), bound));
        assert!(a.paused().unwrap().contains("unconsumed message is 70.0s"));
        assert!(a.decide_lag(s(31), bound));
        assert!(!a.decide_lag(s(20), bound));
    }

    #[test]
    fn an_activity_whose_reservations_wait_pauses_alone() {
        let a = Admission::default();
        let bound = Duration::from_secs(60);
        assert!(a.decide_activity(1, Duration::from_secs(90), bound));
        assert!(!a.decide_activity(2, Duration::from_secs(1), bound));
        let why = a.refusal(1).unwrap();
        assert!(
            why.starts_with("activity 1: the oldest unconfirmed"),
            "{why}"
        );
        assert!(a.refusal(2).is_none(), "another activity sells on");
        assert!(
            a.refusal(3).is_none(),
            "an activity never measured sells too"
        );
        assert!(a.paused().is_none(), "the API as a whole is open");
        // The shared queue's lag closes every activity.
        assert!(a.decide_lag(Duration::from_secs(61), bound));
        assert!(a.refusal(2).unwrap().contains("order queue"));
        // An activity no longer warmed is forgotten.
        a.keep_activities(&[2]);
        assert!(a.activity_paused(1).is_none());
    }

    #[test]
    fn after_a_pause_admission_ramps_up_from_a_tenth_to_all() {
        let a = Admission::with_ramp(Duration::from_secs(30));
        let bound = Duration::from_secs(60);
        let s = Duration::from_secs;
        assert!(a.refusal(1).is_none(), "never paused: no ramp");
        assert!(a.decide_lag(s(61), bound));
        assert!(a.refusal(1).unwrap().contains("unconsumed message"));
        assert!(!a.decide_lag(s(10), bound));
        let start = a.global.reopened().unwrap();
        let admitted = |at: Duration| {
            (0..1000)
                .filter(|_| a.refusal_at(1, start + at).is_none())
                .count()
        };
        assert_eq!(admitted(s(0)), 100, "10 % right after the pause");
        assert_eq!(admitted(s(15)), 550, "halfway: 55 %");
        let refused = a
            .refusal_at(1, start + s(15))
            .or_else(|| a.refusal_at(1, start + s(15)));
        assert!(refused.unwrap().contains("resuming after a pause"));
        assert_eq!(admitted(s(30)), 1000, "all once the ramp is over");
        assert!(a.refusal(1).is_none());
        // An activity reopens the same way, alone.
        assert!(a.decide_activity(4, s(61), bound));
        assert!(!a.decide_activity(4, s(1), bound));
        let refused = (0..100).filter(|_| a.refusal(4).is_some()).count();
        assert!(
            (85..=95).contains(&refused),
            "{refused} of 100 refused right after"
        );
        assert!((0..100).all(|_| a.refusal(5).is_none()));
    }

    #[test]
    fn without_a_ramp_admission_reopens_at_once() {
        let a = Admission::default();
        let bound = Duration::from_secs(60);
        assert!(a.decide_lag(Duration::from_secs(61), bound));
        assert!(!a.decide_lag(Duration::ZERO, bound));
        assert!((0..100).all(|_| a.refusal(1).is_none()));
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
        assert!(!a.decide_lag(Duration::from_secs(1), bound));
    }
}
