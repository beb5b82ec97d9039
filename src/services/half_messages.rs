//! Transaction messages of the roles that originate events
//! (docs/architecture/messages.md#delivering-events): with `events.order_paid = "transaction"` the
//! API sends ORDER_PAID as a RocketMQ transaction message, with `events.order_canceled =
//! "transaction"` the timeout cancel sends ORDER_CANCELED so; every such process joins one producer
//! group and answers the broker's check-backs about any member's half messages, from PostgreSQL
//! alone.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tracing::warn;

use crate::config::Settings;
use crate::mq::{Delivery, LocalOutcome, OutMessage, TransactionChecker, TransactionPublisher};
use crate::mq::{RocketTransactionProducer, TransactionOptions};
use crate::pg::half_message_events::{verdict, Verdict};
use crate::pg::outbox::outbox_message;

/// The half message's property carrying the local transaction's deadline (epoch ms): past it
/// the transaction refuses to commit, and the check-back may answer ROLLBACK.
pub const DEADLINE_PROPERTY: &str = "tx_deadline_ms";

/// The half message of an event's outbox row: the very message the relay would send for it,
/// on any queue (a half cannot be keyed; consumers order an order's events by
/// `aggregate_version`, docs/architecture/messages.md#event-ordering), carrying the local
/// transaction's `deadline`.
pub fn half_message(row: &crate::pg::outbox::OutboxRow, deadline: DateTime<Utc>) -> OutMessage {
    let mut msg = outbox_message(row);
    msg.sharding_key = None;
    let at = deadline.timestamp_millis().to_string();
    msg.properties.push((DEADLINE_PROPERTY.to_owned(), at));
    msg
}

/// How long a check-back waits for the order's row lock (a local transaction holding it is
/// about to end); past it the answer is UNKNOWN and the broker asks again.
const CHECK_LOCK_TIMEOUT_MS: u64 = 1_000;

/// Answers check-backs from PostgreSQL: COMMIT when the event's row is committed with the
/// half's payload, ROLLBACK when it provably never will be, UNKNOWN otherwise, and whenever
/// PostgreSQL cannot tell.
pub struct PgChecker {
    pool: deadpool_postgres::Pool,
    /// The pool wait and the reads together.
    bound: Duration,
}

impl PgChecker {
    pub fn new(pool: deadpool_postgres::Pool, bound: Duration) -> Self {
        Self { pool, bound }
    }

    async fn ask(
        &self,
        order_id: &str,
        event_id: &str,
        payload: &serde_json::Value,
        deadline: DateTime<Utc>,
    ) -> Result<Verdict, String> {
        let until = tokio::time::Instant::now() + self.bound;
        let got = tokio::time::timeout_at(until, self.pool.get()).await;
        let mut client = got
            .map_err(|_| "no connection in time".to_owned())?
            .map_err(|e| e.to_string())?;
        let work = verdict(
            &mut client,
            order_id,
            event_id,
            payload,
            deadline,
            CHECK_LOCK_TIMEOUT_MS,
        );
        match tokio::time::timeout_at(until, work).await {
            Ok(v) => v.map_err(|e| e.to_string()),
            Err(_) => {
                // The reads may still be in flight on it: never hand it to the next caller.
                drop(deadpool_postgres::Object::take(client));
                Err("PostgreSQL did not answer in time".to_owned())
            }
        }
    }
}

#[async_trait::async_trait]
impl TransactionChecker for PgChecker {
    async fn check(&self, msg: &Delivery) -> LocalOutcome {
        let event_id = msg.properties.get("message_id");
        let deadline = msg
            .properties
            .get(DEADLINE_PROPERTY)
            .and_then(|d| d.parse::<i64>().ok())
            .and_then(DateTime::from_timestamp_millis);
        // The first key is the order (the event's aggregate).
        let order_id = msg.keys.split(' ').next().filter(|k| !k.is_empty());
        let payload = serde_json::from_slice::<serde_json::Value>(&msg.body).ok();
        let (Some(event_id), Some(deadline), Some(order_id), Some(payload)) =
            (event_id, deadline, order_id, payload)
        else {
            warn!(keys = %msg.keys, "check-back of a message without event id, deadline, order or JSON body: UNKNOWN");
            return LocalOutcome::Unknown;
        };
        match self.ask(order_id, event_id, &payload, deadline).await {
            Ok(Verdict::Committed) => LocalOutcome::Commit,
            Ok(Verdict::RolledBack) => LocalOutcome::Rollback,
            Ok(Verdict::InFlight) => LocalOutcome::Unknown,
            Err(e) => {
                warn!(%order_id, %event_id, error = %e, "check-back could not read PostgreSQL: UNKNOWN");
                LocalOutcome::Unknown
            }
        }
    }
}

/// The process's transaction producer, `in_flight` half messages at once, answering
/// check-backs from `pool`.
pub async fn start(
    settings: &Settings,
    pool: deadpool_postgres::Pool,
    in_flight: usize,
) -> anyhow::Result<Arc<dyn TransactionPublisher>> {
    let ev = &settings.events;
    let bound = Duration::from_millis(settings.pg.statement_timeout_ms + 1_000);
    let checker: Arc<dyn TransactionChecker> = Arc::new(PgChecker::new(pool, bound));
    let opts = TransactionOptions {
        name_srv: settings.mq.name_server_list(),
        group: settings.names().transaction_producer_group.clone(),
        topics: vec![settings.names().order_event_topic.clone()],
        send_timeout_ms: settings.mq.send_timeout_ms,
        retries: settings.mq.send_retries,
        // The payment's own bound (the API's PostgreSQL bound) covers its local transaction;
        // a caller slower than that has answered 503 and the check-back decides.
        outcome_wait: bound + Duration::from_millis(500),
        in_flight,
        check_threads: ev.transaction_check_threads,
        check_timeout: bound + Duration::from_millis(500),
    };
    let rt = crate::mq::runtime()?;
    let producer = RocketTransactionProducer::start(&rt, opts, checker).await?;
    Ok(Arc::new(producer))
}
