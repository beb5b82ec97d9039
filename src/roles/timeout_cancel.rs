//! `seckill timeout-cancel`: consumes the delay topic
//! (docs/ARCHITECTURE.md#timeout-cancel-and-payment). A CANCEL_ORDER_IF_UNPAID message
//! only says "now you may check": the conditional update in PostgreSQL decides. A paid order
//! is a counted no-op; a message that arrives before `expires_at` is retried later, never
//! dropped; only a cancel that happened returns the unit (PostgreSQL final stock, ledger, and
//! the Redis release through compensation).

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use tracing::{info, warn};

use crate::config::Settings;
use crate::domain::events::CancelOrderIfUnpaid;
use crate::domain::CancelOutcome;
use crate::mq::{BatchHandler, ConsumeDecision, Delivery};
use crate::pg::order_state::{cancel_if_unpaid, StateNames};
use crate::telemetry::Readiness;

pub struct TimeoutCancelHandler {
    pub pool: deadpool_postgres::Pool,
    pub group: String,
    pub names: StateNames,
}

impl TimeoutCancelHandler {
    pub fn new(pool: deadpool_postgres::Pool, settings: &Settings) -> Self {
        let n = settings.names();
        Self {
            pool,
            group: n.timeout_group,
            names: StateNames {
                order_event_topic: n.order_event_topic,
                compensate_topic: n.compensate_topic,
            },
        }
    }

    /// Processes one message. `Ok(None)` = poison (quarantined); `Err` = retry later.
    pub async fn process(&self, d: &Delivery) -> anyhow::Result<Option<CancelOutcome>> {
        let mut client = self.pool.get().await?;
        let msg: CancelOrderIfUnpaid = match serde_json::from_slice(&d.body) {
            Ok(m) => m,
            Err(e) => {
                crate::pg::quarantine(&**client, &self.group, d, "INVALID_EVENT", &e.to_string())
                    .await?;
                metrics::counter!("mq_quarantine_total", "reason" => "INVALID_EVENT").increment(1);
                return Ok(None);
            }
        };
        if msg.expires_at > Utc::now() {
            // Early delivery: do not even open a transaction.
            metrics::counter!("order_cancel_total", "result" => "early").increment(1);
            return Ok(Some(CancelOutcome::NotYetExpired {
                expires_at: msg.expires_at,
            }));
        }
        let outcome = cancel_if_unpaid(
            &mut client,
            &self.group,
            &d.topic,
            &msg.event_id,
            &msg.order_id,
            &self.names,
        )
        .await?;
        metrics::counter!("order_cancel_total", "result" => outcome.label()).increment(1);
        info!(order_id = %msg.order_id, message_id = %msg.event_id, decision = outcome.label(),
              delivery_attempt = d.reconsume_times, "cancel-if-unpaid processed");
        Ok(Some(outcome))
    }
}

#[async_trait::async_trait]
impl BatchHandler for TimeoutCancelHandler {
    async fn handle(&self, batch: Vec<Delivery>) -> ConsumeDecision {
        let mut decision = ConsumeDecision::Ack;
        for d in &batch {
            match self.process(d).await {
                Ok(Some(CancelOutcome::NotYetExpired { expires_at })) => {
                    info!(expires_at = %expires_at, "cancel message arrived early; redelivered later");
                    decision = ConsumeDecision::Retry;
                }
                Ok(_) => {}
                Err(e) => {
                    warn!(error = %e, broker_msg_id = %d.broker_msg_id, "cancel failed; will be redelivered");
                    return ConsumeDecision::Retry;
                }
            }
        }
        // A retried batch re-runs its processed messages too: the inbox makes them no-ops.
        decision
    }
}

/// `seckill timeout-cancel`.
pub async fn run(settings: Settings) -> anyhow::Result<()> {
    let names = settings.names();
    let pool = crate::pg::connect_pool(&settings.pg, 3).await?;
    let handler = Arc::new(TimeoutCancelHandler::new(pool, &settings));
    let ready = Readiness::default();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let ops = crate::telemetry::serve_ops(
        "timeout.metrics_listen",
        settings.timeout.metrics_listen,
        ready.clone(),
        shutdown.clone(),
    )
    .await?;
    let consumer = crate::mq::start_consumer(
        &settings,
        &names.timeout_group,
        &names.order_timeout_topic,
        handler,
        2,
        1,
    )
    .await?;
    ready.set(true);
    info!(group = %names.timeout_group, topic = %names.order_timeout_topic, "timeout-cancel started");
    crate::shutdown::shutdown_signal().await;
    ready.set(false);
    let grace = Duration::from_secs(settings.consumer.shutdown_grace_secs);
    let _ = tokio::time::timeout(grace, consumer.shutdown()).await;
    shutdown.cancel();
    let _ = ops.await;
    info!("timeout-cancel stopped");
    Ok(())
}
