//! `seckill timeout-cancel`: consumes the delay topic
//! (docs/ARCHITECTURE.md#timeout-cancel-and-payment). A CANCEL_ORDER_IF_UNPAID message
//! only says "now you may check": the conditional update in PostgreSQL decides. A paid order
//! is a counted no-op; a message that arrives before `expires_at` is retried later, never
//! dropped; only a cancel that happened returns the unit (PostgreSQL final stock, ledger, and
//! the Redis release through compensation).
//!
//! Each delivered batch becomes one transaction (`pg::cancel_tx`), with the order consumer's
//! discipline (`roles::batch_tx`): at most `Settings::cancel_budget` at once, bounded in time,
//! retried in-process while transient, split into one per message on failure.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use tracing::{debug, info, warn};

use crate::config::Settings;
use crate::domain::events::CancelOrderIfUnpaid;
use crate::domain::CancelOutcome;
use crate::mq::{BatchHandler, ConsumeDecision, Delivery};
use crate::pg::cancel_tx::{cancel_batch, CancelNames, CancelRequest};
use crate::pg::errors::TxError;
use crate::pg::order_state::StateNames;
use crate::roles::batch_tx::TxSlots;
use crate::telemetry::Readiness;

pub struct TimeoutCancelHandler {
    slots: TxSlots,
    names: CancelNames,
}

/// A delivered message, decoded: a cancel to try, or why not.
enum Parsed {
    Cancel(CancelOrderIfUnpaid),
    /// Not a cancel message: quarantined with its raw body.
    Poison(String),
}

impl TimeoutCancelHandler {
    /// `budget` transactions at once, on `pool` (`budget + 1` connections).
    pub fn new(pool: deadpool_postgres::Pool, settings: &Settings, budget: usize) -> Self {
        let n = settings.names();
        Self {
            slots: TxSlots::new(pool, settings, budget, "cancel"),
            names: CancelNames {
                consumer_group: n.timeout_group,
                source_topic: n.order_timeout_topic,
                state: StateNames {
                    order_event_topic: n.order_event_topic,
                    compensate_topic: n.compensate_topic,
                },
            },
        }
    }

    /// What each message of a batch came to: `Ok(None)` = poison (quarantined); `Err` = the
    /// transaction that held it failed (retry later). Early messages never open a transaction.
    pub async fn process(&self, batch: &[Delivery]) -> Vec<Result<Option<CancelOutcome>, TxError>> {
        let parsed: Vec<Parsed> = batch
            .iter()
            .map(
                |d| match serde_json::from_slice::<CancelOrderIfUnpaid>(&d.body) {
                    Ok(m) => Parsed::Cancel(m),
                    Err(e) => Parsed::Poison(e.to_string()),
                },
            )
            .collect();
        let mut out: Vec<Result<Option<CancelOutcome>, TxError>> =
            (0..batch.len()).map(|_| Ok(None)).collect();
        let now = Utc::now();
        let mut due: Vec<(usize, CancelRequest)> = Vec::new();
        for (i, p) in parsed.iter().enumerate() {
            match p {
                Parsed::Poison(why) => out[i] = self.quarantine(&batch[i], why).await,
                // Early delivery (by this process's clock): no transaction at all.
                Parsed::Cancel(m) if m.expires_at > now => {
                    out[i] = Ok(Some(CancelOutcome::NotYetExpired {
                        expires_at: m.expires_at,
                    }))
                }
                Parsed::Cancel(m) => due.push((
                    i,
                    CancelRequest {
                        message_id: m.event_id.clone(),
                        order_id: m.order_id.clone(),
                    },
                )),
            }
        }
        if due.is_empty() {
            return out;
        }
        let requests: Vec<CancelRequest> = due.iter().map(|(_, r)| r.clone()).collect();
        let decided = self
            .slots
            .split_on_failure(requests.len(), |range| {
                let part = &requests[range];
                self.slots
                    .run(async move |client| cancel_batch(client, &self.names, part).await)
            })
            .await;
        for ((i, _), outcome) in due.iter().zip(decided) {
            out[*i] = outcome.map(Some);
        }
        out
    }

    async fn quarantine(&self, d: &Delivery, why: &str) -> Result<Option<CancelOutcome>, TxError> {
        let client = self.slots.pool().get().await?;
        crate::pg::quarantine(
            &**client,
            &self.names.consumer_group,
            d,
            "INVALID_EVENT",
            why,
        )
        .await
        .map_err(|e| crate::pg::errors::classify(&e))?;
        metrics::counter!("mq_quarantine_total", "reason" => "INVALID_EVENT").increment(1);
        warn!(broker_msg_id = %d.broker_msg_id, error = why,
              "poison cancel message quarantined with its raw body");
        Ok(None)
    }
}

#[async_trait::async_trait]
impl BatchHandler for TimeoutCancelHandler {
    async fn handle(&self, batch: Vec<Delivery>) -> ConsumeDecision {
        let started = Instant::now();
        metrics::histogram!("mq_consume_batch_size", "topic" => "order_timeout")
            .record(batch.len() as f64);
        let outcomes = self.process(&batch).await;
        metrics::histogram!("mq_consume_process_seconds", "topic" => "order_timeout")
            .record(started.elapsed().as_secs_f64());
        // A retried batch re-runs its processed messages too: the inbox makes them no-ops.
        let mut decision = ConsumeDecision::Ack;
        for (d, outcome) in batch.iter().zip(&outcomes) {
            let message_id = d
                .properties
                .get("message_id")
                .map(String::as_str)
                .unwrap_or("");
            let order_id = d.keys.split(' ').next().unwrap_or("");
            match outcome {
                Ok(Some(o)) => {
                    metrics::counter!("order_cancel_total", "result" => o.label()).increment(1);
                    if let CancelOutcome::NotYetExpired { expires_at } = o {
                        info!(order_id, message_id, expires_at = %expires_at,
                              "cancel message arrived early; redelivered later");
                        decision = ConsumeDecision::Retry;
                    } else {
                        debug!(
                            order_id,
                            message_id,
                            decision = o.label(),
                            delivery_attempt = d.reconsume_times,
                            "cancel-if-unpaid processed"
                        );
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    metrics::counter!("order_cancel_total", "result" => e.class()).increment(1);
                    warn!(order_id, message_id, broker_msg_id = %d.broker_msg_id,
                          error_class = e.class(), error = %e,
                          "cancel failed; will be redelivered");
                    decision = ConsumeDecision::Retry;
                }
            }
        }
        decision
    }
}

/// `seckill timeout-cancel`.
pub async fn run(settings: Settings) -> anyhow::Result<()> {
    let names = settings.names();
    let budget = settings.cancel_budget();
    let pool = crate::pg::connect_pool(&settings.pg, budget + 1).await?;
    let handler = Arc::new(TimeoutCancelHandler::new(pool, &settings, budget));
    let ready = Readiness::default();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let ops = crate::telemetry::serve_ops(
        "timeout.metrics_listen",
        settings.timeout.metrics_listen,
        ready.clone(),
        shutdown.clone(),
    )
    .await?;
    // `budget` batches handed over at once, each up to `consumer.batch_size` messages.
    let consumer = crate::mq::start_consumer(
        &settings,
        &names.timeout_group,
        &names.order_timeout_topic,
        handler,
        budget,
        settings.consumer.batch_size,
    )
    .await?;
    ready.set(true);
    info!(group = %names.timeout_group, topic = %names.order_timeout_topic, budget,
          batch_size = settings.consumer.batch_size, "timeout-cancel started");
    crate::shutdown::shutdown_signal().await;
    ready.set(false);
    let grace = Duration::from_secs(settings.consumer.shutdown_grace_secs);
    let _ = tokio::time::timeout(grace, consumer.shutdown()).await;
    shutdown.cancel();
    let _ = ops.await;
    info!("timeout-cancel stopped");
    Ok(())
}
