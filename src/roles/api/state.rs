//! What every handler of the API holds (`ApiState`), with the two things every route may ask
//! of it: its PostgreSQL work bounded in time, and the buyer a request's token names.

use std::sync::Arc;
use std::time::Duration;

use axum::http::HeaderMap;
use tokio::sync::Semaphore;

use super::admission::Admission;
use super::error::ApiError;
use super::pass_desk::PassDesk;
use super::sold_out::SoldOut;
use crate::auth::buyer::{AuthFailure, BuyerAuth};
use crate::config::Settings;
use crate::gather::{Gather, GatherSettings};
use crate::mq::lag::LagSource;
use crate::mq::Names;
use crate::mq::{Publisher, TransactionPublisher};
use crate::redis::{RedisStore, SentMark};
use crate::telemetry::Readiness;

/// Everything a request handler needs; cheap to clone.
#[derive(Clone)]
pub struct ApiState {
    pub settings: Arc<Settings>,
    pub names: Arc<Names>,
    pub redis: RedisStore,
    pub pg: deadpool_postgres::Pool,
    pub publisher: Arc<dyn Publisher>,
    /// Bounds reservation requests in flight; beyond it the API sheds load with 503.
    pub inflight: Arc<Semaphore>,
    pub ready: Readiness,
    /// Fail-closed admission, updated by the background checker.
    pub admission: Arc<Admission>,
    /// SKUs known sold out: answered from memory
    /// (docs/architecture/hot-path.md#sold-out-from-memory).
    pub sold_out: Arc<SoldOut>,
    /// Where the checker reads the order-create lag (`None`: pending age only).
    pub lag: Option<LagSource>,
    /// Verifies buyer tokens; `None` when `auth.buyers = "body"` (development only).
    pub auth: Option<Arc<BuyerAuth>>,
    /// Confirmed sends recorded in Redis, gathered: one pipelined round trip for every request
    /// whose broker batch was confirmed together (docs/architecture/hot-path.md#batched-sends).
    pub sent_marks: Arc<SentMarks>,
    /// The transaction producer, when ORDER_PAID is sent as transaction messages
    /// (`events.order_paid = "transaction"`).
    pub transactions: Option<Arc<dyn TransactionPublisher>>,
    /// Sale passes: their secrets, the proof of work, what this instance read of policies.
    pub passes: Arc<PassDesk>,
}

/// The gathering of confirmed sends: each request gets its own verdict, or the error's text.
pub type SentMarks = Gather<SentMark, Result<String, String>>;

/// Confirmed sends recorded in one pipeline per batch, at most `SENT_MARK_BATCH` each and
/// `SENT_MARK_ROUND_TRIPS` in flight; a batch starts as soon as a slot is free.
const SENT_MARK_BATCH: usize = 64;
const SENT_MARK_ROUND_TRIPS: usize = 4;

pub(super) fn sent_marks(redis: &RedisStore) -> SentMarks {
    let redis = redis.clone();
    Gather::start(
        GatherSettings {
            max: SENT_MARK_BATCH,
            wait: Duration::ZERO,
            queue: 4096,
            recheck: Duration::ZERO,
        },
        |_: &[SentMark]| SENT_MARK_ROUND_TRIPS,
        move |marks: Vec<SentMark>| {
            let redis = redis.clone();
            async move {
                match redis.sends().mark_sent_many(&marks).await {
                    Ok(verdicts) => verdicts.into_iter().map(Ok).collect(),
                    Err(e) => {
                        let why = e.to_string();
                        marks.iter().map(|_| Err(why.clone())).collect()
                    }
                }
            }
        },
    )
}

impl ApiState {
    /// Runs a request's PostgreSQL work on one pooled connection, the pool wait and the work
    /// together within `pg.statement_timeout_ms` plus a second: a PostgreSQL that stops answering
    /// (a dead network path the kernel has not noticed yet) gets the caller a 503 `UNAVAILABLE`
    /// in time, never a hung request. A connection whose work ran out of time may still have the
    /// request in flight: it is closed, never handed to the next request.
    pub(crate) async fn bounded_pg<T>(
        &self,
        work: impl AsyncFnOnce(&mut deadpool_postgres::Object) -> Result<T, ApiError>,
    ) -> Result<T, ApiError> {
        let deadline = tokio::time::Instant::now()
            + Duration::from_millis(self.settings.pg.statement_timeout_ms + 1000);
        let timed_out = || {
            metrics::counter!("pg_call_timeout_total").increment(1);
            Err(ApiError::unavailable("the order store"))
        };
        let Ok(got) = tokio::time::timeout_at(deadline, self.pg.get()).await else {
            return timed_out();
        };
        let mut client = got.map_err(|_| ApiError::unavailable("the order store"))?;
        let done = tokio::time::timeout_at(deadline, work(&mut client)).await;
        match done {
            Ok(result) => result,
            Err(_) => {
                drop(deadpool_postgres::Object::take(client));
                timed_out()
            }
        }
    }

    /// The buyer a request's token names: `Ok(None)` without token identity, 401
    /// `UNAUTHENTICATED` when the token is missing or not valid (no detail given).
    /// 503 `UNAVAILABLE` while the identity provider's keys have never been fetched.
    pub(crate) async fn buyer(&self, headers: &HeaderMap) -> Result<Option<i64>, ApiError> {
        let Some(auth) = &self.auth else {
            return Ok(None);
        };
        auth.buyer(headers).await.map(Some).map_err(|failure| {
            metrics::counter!("auth_failures_total", "reason" => failure.label()).increment(1);
            match failure {
                AuthFailure::KeysUnavailable => {
                    ApiError::unavailable("the identity provider's keys").retry_after(5)
                }
                _ => ApiError::unauthenticated(),
            }
        })
    }
}
