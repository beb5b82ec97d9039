//! How a delivered batch becomes PostgreSQL transactions, for every role that turns messages
//! into rows in batches: order creation and the timeout cancel
//! (docs/architecture/order-creation.md#batches-and-savepoints,
//! docs/architecture/order-creation.md#worker-budget).
//!
//! - At most `budget` transactions run at once in the process, under an adaptive limit
//!   (`src/limiter.rs`), each on its own pooled connection.
//! - Each transaction is bounded in time: a server gone silent mid-transaction costs a
//!   connection (dropped, never returned to the pool) and a retry, not a hung worker.
//! - A transient failure (deadlock, lost connection, timeout) is retried in-process twice
//!   before the batch goes back to the broker, whose first redelivery comes only after 10 s.
//! - A batch whose transaction still fails is split into one transaction per message, so one
//!   bad message cannot keep the others from committing.
//!
//! Metrics carry `kind` (`create` or `cancel`): `order_tx_latency_seconds`,
//! `order_tx_timeout_total`, `order_tx_retry_total` (a transaction rolled back by a transient
//! failure and attempted again in-process), `mq_consume_batch_split_total`.

use std::future::Future;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use crate::limiter::{AdaptiveLimiter, LimiterSettings, Sample};
use crate::pg::errors::TxError;

/// In-process attempts of a transaction that failed transiently before the batch goes back to
/// the broker. Pauses between attempts, in milliseconds.
const TRANSIENT_RETRY_PAUSES_MS: [u64; 2] = [20, 100];

/// Transaction slots of one process: a pool, an adaptive limit under the budget, a time bound.
pub struct TxSlots {
    pool: deadpool_postgres::Pool,
    limiter: Arc<AdaptiveLimiter>,
    tx_timeout: Duration,
    /// `create` or `cancel`: the `kind` label of the metrics.
    kind: &'static str,
    /// The one transaction that may run ahead of the slots ([`TxSlots::run_ahead`]).
    ahead: tokio::sync::Semaphore,
}

impl TxSlots {
    /// `budget` slots (at least 1) on `pool`, which should hold `budget + 1` connections.
    pub fn new(
        pool: deadpool_postgres::Pool,
        settings: &crate::config::Settings,
        budget: usize,
        kind: &'static str,
    ) -> Self {
        Self {
            pool,
            limiter: AdaptiveLimiter::new(LimiterSettings {
                initial: budget.max(1),
                max: budget.max(1),
                latency_target: Duration::from_millis(settings.consumer.tx_latency_target_ms),
                pool_wait_target: Duration::from_millis(settings.consumer.pool_wait_target_ms),
            }),
            tx_timeout: Duration::from_millis(settings.consumer.tx_timeout_ms),
            kind,
            ahead: tokio::sync::Semaphore::new(1),
        }
    }

    pub fn limiter(&self) -> &AdaptiveLimiter {
        &self.limiter
    }

    pub fn pool(&self) -> &deadpool_postgres::Pool {
        &self.pool
    }

    /// Runs one transaction under a slot, on a pooled connection, within `consumer.tx_timeout_ms`.
    pub async fn run<T>(
        &self,
        tx: impl AsyncFnOnce(&mut deadpool_postgres::Client) -> Result<T, TxError>,
    ) -> Result<T, TxError> {
        let permit = self.limiter.acquire().await;
        let wait = Instant::now();
        let client = match self.pool.get().await {
            Ok(c) => c,
            Err(e) => {
                permit.done(Sample {
                    latency: Duration::ZERO,
                    pool_wait: wait.elapsed(),
                    overloaded: true,
                });
                return Err(e.into());
            }
        };
        let pool_wait = wait.elapsed();
        metrics::histogram!("pg_pool_wait_seconds").record(pool_wait.as_secs_f64());
        let status = self.pool.status();
        metrics::gauge!("pg_pool_acquired").set((status.size - status.available) as f64);
        let started = Instant::now();
        let result = self.bounded(client, tx).await;
        permit.done(Sample {
            latency: started.elapsed(),
            pool_wait,
            overloaded: matches!(result, Err(TxError::Transient(_))),
        });
        result
    }

    /// Runs one transaction ahead of the slots: outside the adaptive limit, one at a time,
    /// on the pool's spare connection (the pool holds `budget + 1`), within the same time
    /// bound. For work that must not queue behind the batches (the fast lane,
    /// `roles::consume::fast_lane`); it does not feed the limiter.
    pub async fn run_ahead<T>(
        &self,
        tx: impl AsyncFnOnce(&mut deadpool_postgres::Client) -> Result<T, TxError>,
    ) -> Result<T, TxError> {
        let _one = self.ahead.acquire().await.expect("never closed");
        let client = self.pool.get().await?;
        self.bounded(client, tx).await
    }

    /// `tx` on `client` within `consumer.tx_timeout_ms`, its latency recorded.
    async fn bounded<T>(
        &self,
        mut client: deadpool_postgres::Client,
        tx: impl AsyncFnOnce(&mut deadpool_postgres::Client) -> Result<T, TxError>,
    ) -> Result<T, TxError> {
        let started = Instant::now();
        let result = match tokio::time::timeout(self.tx_timeout, tx(&mut client)).await {
            Ok(r) => r,
            Err(_) => {
                // A server that went silent mid-transaction: the connection leaves the pool
                // (it may hold an open transaction), PostgreSQL rolls back when it sees it
                // gone, and the batch is retried like any transient failure. Whether a commit
                // in flight landed is told by the inbox on the retry.
                drop(deadpool_postgres::Object::take(client));
                metrics::counter!("order_tx_timeout_total", "kind" => self.kind).increment(1);
                Err(TxError::Transient(
                    format!(
                        "transaction exceeded consumer.tx_timeout_ms ({} ms)",
                        self.tx_timeout.as_millis()
                    )
                    .into(),
                ))
            }
        };
        metrics::histogram!("order_tx_latency_seconds", "kind" => self.kind)
            .record(started.elapsed().as_secs_f64());
        result
    }

    /// `attempt` again while it fails transiently, up to the in-process retries.
    pub async fn retrying<T, Fut>(
        &self,
        size: usize,
        attempt: impl Fn() -> Fut,
    ) -> Result<T, TxError>
    where
        Fut: Future<Output = Result<T, TxError>>,
    {
        let mut pauses = TRANSIENT_RETRY_PAUSES_MS.iter();
        loop {
            match attempt().await {
                Err(TxError::Transient(why)) => match pauses.next() {
                    Some(ms) => {
                        metrics::counter!("order_tx_retry_total", "kind" => self.kind).increment(1);
                        debug!(kind = self.kind, batch = size, error = %why, pause_ms = ms,
                               "transient failure; retrying the transaction in-process");
                        tokio::time::sleep(Duration::from_millis(*ms)).await;
                    }
                    None => return Err(TxError::Transient(why)),
                },
                other => return other,
            }
        }
    }

    /// Outcome per item of a batch of `len` items: one transaction (`process` over the whole
    /// range, retried while transient); if it fails, one transaction per item, so one bad item
    /// cannot keep the others from committing. A failed item makes the broker redeliver the
    /// whole batch; the committed ones then hit the inbox.
    pub async fn split_on_failure<T, Fut>(
        &self,
        len: usize,
        process: impl Fn(Range<usize>) -> Fut,
    ) -> Vec<Result<T, TxError>>
    where
        Fut: Future<Output = Result<Vec<T>, TxError>>,
    {
        let first = match self.retrying(len, || process(0..len)).await {
            Ok(outcomes) => return outcomes.into_iter().map(Ok).collect(),
            Err(e) if len <= 1 => return vec![Err(e)],
            Err(e) => e,
        };
        metrics::counter!("mq_consume_batch_split_total", "kind" => self.kind).increment(1);
        warn!(kind = self.kind, batch = len, error_class = first.class(), error = %first,
              "batch transaction failed; splitting it into one transaction per message");
        let mut out = Vec::with_capacity(len);
        for i in 0..len {
            out.push(
                self.retrying(1, || process(i..i + 1))
                    .await
                    .and_then(|mut v| {
                        v.pop()
                            .ok_or_else(|| TxError::Unknown("no outcome for the message".into()))
                    }),
            );
        }
        out
    }
}
