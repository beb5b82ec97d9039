//! One admission gate (docs/architecture/hot-path.md#fail-closed-admission): closed or open with a
//! reason, closing when a measured age passes a bound and opening again under half of it
//! (hysteresis), and reopening as a ramp: for `ramp` after a pause a share of new reservations
//! growing from 10 % to all is admitted. Admission holds one for the whole API (the shared
//! broker's health) and one per activity.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The share of new reservations admitted at the start of a ramp.
const RAMP_START_SHARE: f64 = 0.1;

#[derive(Default)]
pub(super) struct Gate {
    paused: AtomicBool,
    reason: Mutex<String>,
    /// When the last pause ended, while the ramp runs.
    reopened: Mutex<Option<Instant>>,
    /// Set while `reopened` holds a ramp: an open gate with no ramp answers every request
    /// from its two flags, never taking the lock.
    ramping: AtomicBool,
    /// Requests seen during the ramp: admits an exact share of them, evenly spread.
    arrivals: AtomicU64,
}

impl Gate {
    /// `Some(reason)` while closed.
    pub(super) fn paused(&self) -> Option<String> {
        if self.paused.load(Ordering::Relaxed) {
            Some(self.reason.lock().map(|r| r.clone()).unwrap_or_default())
        } else {
            None
        }
    }

    pub(super) fn is_paused(&self) -> bool {
        self.paused.load(Ordering::Relaxed)
    }

    /// Closes or opens it with `reason`; an opening starts the ramp. Returns whether it
    /// changed.
    pub(super) fn set(&self, paused: bool, reason: String, ramp: Duration) -> bool {
        if let Ok(mut r) = self.reason.lock() {
            *r = reason;
        }
        let was = self.paused.swap(paused, Ordering::Relaxed);
        if was && !paused && !ramp.is_zero() {
            if let Ok(mut reopened) = self.reopened.lock() {
                *reopened = Some(Instant::now());
            }
            self.arrivals.store(0, Ordering::Relaxed);
            self.ramping.store(true, Ordering::Relaxed);
        }
        was != paused
    }

    /// Whether it refuses anything at `now`: closed, or still ramping up (a ramp that is over
    /// is ended here).
    pub(super) fn gated_at(&self, now: Instant, ramp: Duration) -> bool {
        if self.is_paused() {
            return true;
        }
        if !self.ramping.load(Ordering::Relaxed) {
            return false;
        }
        let Ok(mut reopened) = self.reopened.lock() else {
            return false;
        };
        match *reopened {
            Some(since) if now.saturating_duration_since(since) < ramp => true,
            _ => {
                *reopened = None;
                self.ramping.store(false, Ordering::Relaxed);
                false
            }
        }
    }

    /// Whether it should be closed for a measured `age`: past `bound` when open, past half of
    /// it when already closed (`None`: no change).
    pub(super) fn verdict(&self, age: Duration, bound: Duration) -> Option<bool> {
        let was = self.paused.load(Ordering::Relaxed);
        let now = if was { age > bound / 2 } else { age > bound };
        (now != was).then_some(now)
    }

    /// `Some(why)` when a new reservation is refused at `now`: closed, or resuming and not in
    /// the share admitted yet. `ramp_share` is told the share while a ramp runs.
    pub(super) fn refusal_at(
        &self,
        now: Instant,
        ramp: Duration,
        ramp_share: impl Fn(f64),
    ) -> Option<String> {
        if let Some(reason) = self.paused() {
            return Some(reason);
        }
        if !self.ramping.load(Ordering::Relaxed) {
            return None;
        }
        let mut reopened = self.reopened.lock().ok()?;
        let since = (*reopened)?;
        let elapsed = now.saturating_duration_since(since);
        if elapsed >= ramp {
            *reopened = None;
            self.ramping.store(false, Ordering::Relaxed);
            ramp_share(1.0);
            return None;
        }
        drop(reopened);
        let share = RAMP_START_SHARE
            + (1.0 - RAMP_START_SHARE) * elapsed.as_secs_f64() / ramp.as_secs_f64();
        ramp_share(share);
        // The n-th arrival is admitted when the running count of admissions grows: exactly
        // `share` of any run of arrivals, spread evenly.
        let n = self.arrivals.fetch_add(1, Ordering::Relaxed) as f64;
        if ((n + 1.0) * share).floor() > (n * share).floor() {
            return None;
        }
        Some(format!(
            "resuming after a pause: {:.0}% of new reservations admitted, all in {:.0}s",
            share * 100.0,
            (ramp - elapsed).as_secs_f64().ceil()
        ))
    }

    /// When the last pause ended, while the ramp runs (tests).
    #[cfg(test)]
    pub(super) fn reopened(&self) -> Option<Instant> {
        *self.reopened.lock().unwrap()
    }
}
