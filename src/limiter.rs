//! Adaptive concurrency limit for order transactions
//! (docs/architecture/order-creation.md#worker-budget): AIMD.
//!
//! The worker budget (`config::budget::order_budget`) is a ceiling measured
//! once; what PostgreSQL sustains right now can be lower (a vacuum, a slow disk, another
//! tenant). The limit grows by one after a full window of transactions that stayed under both
//! targets (transaction latency and pool wait), and shrinks by a quarter when one does not or
//! fails transiently, at most once per window. It never leaves `1..=max`. Its value is the
//! gauge `order_tx_concurrency_limit`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Targets and bounds of an [`AdaptiveLimiter`].
#[derive(Debug, Clone, Copy)]
pub struct LimiterSettings {
    /// Starting limit.
    pub initial: usize,
    /// Ceiling: the worker budget.
    pub max: usize,
    /// Transactions slower than this (begin to commit) shrink the limit.
    pub latency_target: Duration,
    /// Waits for a pooled connection longer than this shrink the limit.
    pub pool_wait_target: Duration,
}

#[derive(Debug)]
struct State {
    limit: usize,
    /// Good completions since the last change.
    good: usize,
    /// Completions since the last decrease (a decrease waits for a full window).
    since_decrease: usize,
    /// Permits to retire as they come back (the limit fell below what is handed out).
    debt: usize,
}

/// A semaphore whose size follows AIMD.
pub struct AdaptiveLimiter {
    sem: Arc<Semaphore>,
    state: Mutex<State>,
    settings: LimiterSettings,
    /// Slots held right now, and the most ever held at once.
    held: AtomicUsize,
    high_water: AtomicUsize,
}

/// A slot for one transaction; report how it went with [`LimitPermit::done`].
pub struct LimitPermit {
    limiter: Arc<AdaptiveLimiter>,
    permit: Option<OwnedSemaphorePermit>,
}

/// How one transaction went, for the limiter.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    pub latency: Duration,
    pub pool_wait: Duration,
    /// Failed in a way that says "too much load" (timeout, deadlock, serialization, pool).
    pub overloaded: bool,
}

impl AdaptiveLimiter {
    pub fn new(settings: LimiterSettings) -> Arc<Self> {
        let max = settings.max.max(1);
        let initial = settings.initial.clamp(1, max);
        let limiter = Arc::new(Self {
            sem: Arc::new(Semaphore::new(initial)),
            state: Mutex::new(State {
                limit: initial,
                good: 0,
                since_decrease: 0,
                debt: 0,
            }),
            settings: LimiterSettings { max, ..settings },
            held: AtomicUsize::new(0),
            high_water: AtomicUsize::new(0),
        });
        limiter.publish(initial);
        limiter
    }

    /// Current limit.
    pub fn limit(&self) -> usize {
        self.lock().limit
    }

    /// The most slots ever held at once (never above the budget).
    pub fn high_water(&self) -> usize {
        self.high_water.load(Ordering::Acquire)
    }

    /// Waits for a slot.
    pub async fn acquire(self: &Arc<Self>) -> LimitPermit {
        let permit = Arc::clone(&self.sem)
            .acquire_owned()
            .await
            .expect("the limiter never closes its semaphore");
        let held = self.held.fetch_add(1, Ordering::AcqRel) + 1;
        self.high_water.fetch_max(held, Ordering::AcqRel);
        LimitPermit {
            limiter: Arc::clone(self),
            permit: Some(permit),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn publish(&self, limit: usize) {
        metrics::gauge!("order_tx_concurrency_limit").set(limit as f64);
    }

    fn record(&self, sample: Sample) {
        let good = !sample.overloaded
            && sample.latency <= self.settings.latency_target
            && sample.pool_wait <= self.settings.pool_wait_target;
        let mut st = self.lock();
        st.since_decrease += 1;
        if good {
            st.good += 1;
            if st.good >= st.limit && st.limit < self.settings.max {
                st.limit += 1;
                st.good = 0;
                if st.debt > 0 {
                    st.debt -= 1;
                } else {
                    self.sem.add_permits(1);
                }
                self.publish(st.limit);
            }
        } else if st.since_decrease >= st.limit && st.limit > 1 {
            let new = (st.limit * 3 / 4).max(1);
            let cut = st.limit - new;
            st.limit = new;
            st.good = 0;
            st.since_decrease = 0;
            let retired = self.sem.forget_permits(cut);
            st.debt += cut - retired;
            self.publish(new);
        }
    }

    /// A permit comes back: retire it if the limit fell meanwhile.
    fn release(&self, permit: OwnedSemaphorePermit) {
        self.held.fetch_sub(1, Ordering::AcqRel);
        let mut st = self.lock();
        if st.debt > 0 {
            st.debt -= 1;
            permit.forget();
        } else {
            drop(permit);
        }
    }
}

impl LimitPermit {
    /// Reports the transaction's outcome and gives the slot back.
    pub fn done(mut self, sample: Sample) {
        self.limiter.record(sample);
        if let Some(p) = self.permit.take() {
            self.limiter.release(p);
        }
    }
}

impl Drop for LimitPermit {
    fn drop(&mut self) {
        if let Some(p) = self.permit.take() {
            self.limiter.release(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limiter(initial: usize, max: usize) -> Arc<AdaptiveLimiter> {
        AdaptiveLimiter::new(LimiterSettings {
            initial,
            max,
            latency_target: Duration::from_millis(100),
            pool_wait_target: Duration::from_millis(10),
        })
    }

    fn ok() -> Sample {
        Sample {
            latency: Duration::from_millis(5),
            pool_wait: Duration::ZERO,
            overloaded: false,
        }
    }

    fn slow() -> Sample {
        Sample {
            latency: Duration::from_millis(500),
            ..ok()
        }
    }

    async fn complete(l: &Arc<AdaptiveLimiter>, n: usize, s: Sample) {
        for _ in 0..n {
            l.acquire().await.done(s);
        }
    }

    #[tokio::test]
    async fn grows_by_one_per_good_window_up_to_the_budget_only() {
        let l = limiter(1, 4);
        complete(&l, 1, ok()).await;
        assert_eq!(l.limit(), 2);
        complete(&l, 2, ok()).await;
        assert_eq!(l.limit(), 3);
        complete(&l, 100, ok()).await;
        assert_eq!(l.limit(), 4, "never above the budget");
        assert_eq!(l.sem.available_permits(), 4);
    }

    #[tokio::test]
    async fn shrinks_by_a_quarter_when_latency_or_pool_wait_rise_at_most_once_per_window() {
        let l = limiter(8, 8);
        complete(&l, 8, slow()).await;
        assert_eq!(l.limit(), 6);
        complete(&l, 5, slow()).await;
        assert_eq!(l.limit(), 6, "one decrease per window");
        complete(&l, 1, slow()).await;
        assert_eq!(l.limit(), 4);
        let waited = Sample {
            pool_wait: Duration::from_millis(50),
            ..ok()
        };
        complete(&l, 4, waited).await;
        assert_eq!(l.limit(), 3);
        let failed = Sample {
            overloaded: true,
            ..ok()
        };
        complete(&l, 100, failed).await;
        assert_eq!(l.limit(), 1, "never below one");
        assert_eq!(l.sem.available_permits(), 1);
    }

    #[tokio::test]
    async fn permits_held_while_the_limit_falls_are_retired_on_return() {
        let l = limiter(4, 4);
        let held: Vec<LimitPermit> = futures::future::join_all((0..4).map(|_| l.acquire())).await;
        assert_eq!(l.sem.available_permits(), 0);
        // Four slow completions with all slots taken: the limit drops to 3; one permit owed.
        let mut it = held.into_iter();
        for _ in 0..4 {
            it.next().unwrap().done(slow());
        }
        assert_eq!(l.limit(), 3);
        assert_eq!(l.sem.available_permits(), 3, "the owed permit was retired");
    }
}
