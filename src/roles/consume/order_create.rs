//! The order-create handler (docs/ARCHITECTURE.md#order-creation): each batch the broker
//! hands over becomes one PostgreSQL transaction (see `pg::order_tx`); the batch is ACKed only
//! after the commit. Transient failures roll back and are redelivered by the broker with
//! backoff; after `max_reconsume_times` a message goes to the group's DLQ. At most `budget`
//! transactions run at once (the worker budget, docs/ARCHITECTURE.md#worker-budget), under
//! an adaptive limit.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use tracing::{debug, info, warn};

use crate::config::Settings;
use crate::domain::Decision;
use crate::domain::OrderCreateRequested;
use crate::limiter::{AdaptiveLimiter, LimiterSettings, Sample};
use crate::mq::{BatchHandler, ConsumeDecision, Delivery};
use crate::pg::errors::TxError;
use crate::pg::order_tx::{process_batch, Inbound, TxNames};

/// The order-create handler: decode, one transaction per batch, decide ACK or redelivery.
pub struct OrderCreateHandler {
    pool: deadpool_postgres::Pool,
    names: TxNames,
    /// PostgreSQL transactions this process runs at once: adaptive, at most the worker budget.
    limiter: Arc<AdaptiveLimiter>,
    pay_window: chrono::Duration,
    /// Bound on one order transaction, begin to commit (`consumer.tx_timeout_ms`).
    tx_timeout: Duration,
}

impl OrderCreateHandler {
    pub fn new(pool: deadpool_postgres::Pool, settings: &Settings, budget: usize) -> Self {
        let n = settings.names();
        Self {
            pool,
            names: TxNames {
                consumer_group: n.order_create_group,
                source_topic: n.order_create_topic,
                order_event_topic: n.order_event_topic,
                order_timeout_topic: n.order_timeout_topic,
                compensate_topic: n.compensate_topic,
            },
            limiter: AdaptiveLimiter::new(LimiterSettings {
                initial: budget.max(1),
                max: budget.max(1),
                latency_target: Duration::from_millis(settings.consumer.tx_latency_target_ms),
                pool_wait_target: Duration::from_millis(settings.consumer.pool_wait_target_ms),
            }),
            pay_window: chrono::Duration::seconds(settings.consumer.pay_window_secs as i64),
            tx_timeout: Duration::from_millis(settings.consumer.tx_timeout_ms),
        }
    }

    /// The limit on this handler's transactions in flight.
    pub fn limiter(&self) -> &AdaptiveLimiter {
        &self.limiter
    }

    /// Turns broker deliveries into transaction inputs (poison is kept, not dropped).
    pub fn inbound(d: &Delivery) -> Inbound {
        Inbound {
            event: OrderCreateRequested::decode(&d.body),
            raw_body: d.body.clone(),
            properties: serde_json::to_value(&d.properties).unwrap_or_default(),
            property_message_id: d.properties.get("message_id").cloned(),
            broker_msg_id: d.broker_msg_id.clone(),
            delivery_attempt: d.reconsume_times,
        }
    }

    /// Processes one batch and returns the decisions (or the error that made it roll back).
    pub async fn process(
        &self,
        batch: &[Delivery],
    ) -> Result<Vec<Decision>, crate::pg::errors::TxError> {
        let items: Vec<Inbound> = batch.iter().map(Self::inbound).collect();
        // Injection point: a failure that one message causes (its message_id is the
        // failpoint's argument) fails any transaction that contains it.
        #[cfg(feature = "failpoints")]
        if let Some(Some(id)) = fail::eval("order-tx-fails-for-message", |arg| arg) {
            if batch
                .iter()
                .any(|d| d.properties.get("message_id") == Some(&id))
            {
                return Err(TxError::Unknown(format!("injected failure for {id}")));
            }
        }
        let permit = self.limiter.acquire().await;
        let wait = Instant::now();
        let mut client = match self.pool.get().await {
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
        let tx_started = Instant::now();
        let bounded = tokio::time::timeout(
            self.tx_timeout,
            process_batch(
                &mut client,
                &self.names,
                &items,
                Utc::now(),
                self.pay_window,
            ),
        )
        .await;
        let result = match bounded {
            Ok(r) => r,
            Err(_) => {
                // A server that went silent mid-transaction: the connection leaves the pool
                // (it may hold an open transaction), PostgreSQL rolls back when it sees it
                // gone, and the batch is retried like any transient failure. Whether a commit
                // in flight landed is told by the inbox on the retry.
                drop(deadpool_postgres::Object::take(client));
                metrics::counter!("order_tx_timeout_total").increment(1);
                Err(TxError::Transient(format!(
                    "order transaction exceeded consumer.tx_timeout_ms ({} ms)",
                    self.tx_timeout.as_millis()
                )))
            }
        };
        let latency = tx_started.elapsed();
        metrics::histogram!("order_tx_latency_seconds").record(latency.as_secs_f64());
        permit.done(Sample {
            latency,
            pool_wait,
            overloaded: matches!(result, Err(TxError::Transient(_))),
        });
        result
    }
}

/// In-process attempts of a transaction that failed transiently (deadlock, serialization,
/// lost connection) before the batch goes back to the broker, whose first redelivery comes
/// only after 10 s. Pauses between attempts, in milliseconds.
const TRANSIENT_RETRY_PAUSES_MS: [u64; 2] = [20, 100];

impl OrderCreateHandler {
    /// One transaction for `batch`, retried in-process while it fails transiently.
    async fn process_retrying(&self, batch: &[Delivery]) -> Result<Vec<Decision>, TxError> {
        let mut pauses = TRANSIENT_RETRY_PAUSES_MS.iter();
        loop {
            match self.process(batch).await {
                Err(TxError::Transient(why)) => match pauses.next() {
                    Some(ms) => {
                        debug!(batch = batch.len(), error = %why, pause_ms = ms,
                               "transient failure; retrying the transaction in-process");
                        tokio::time::sleep(Duration::from_millis(*ms)).await;
                    }
                    None => return Err(TxError::Transient(why)),
                },
                other => return other,
            }
        }
    }

    /// Outcome per message of a batch: one transaction; if it fails, each message in a
    /// transaction of its own, so one bad message cannot keep the others from committing.
    /// A failed message makes the broker redeliver the whole batch; the committed ones then
    /// hit the inbox.
    async fn decide(&self, batch: &[Delivery]) -> Vec<Result<Decision, TxError>> {
        let first = match self.process_retrying(batch).await {
            Ok(decisions) => return decisions.into_iter().map(Ok).collect(),
            Err(e) if batch.len() == 1 => return vec![Err(e)],
            Err(e) => e,
        };
        metrics::counter!("mq_consume_batch_split_total").increment(1);
        warn!(batch = batch.len(), error_class = first.class(), error = %first,
              "batch transaction failed; splitting it into one transaction per message");
        let mut out = Vec::with_capacity(batch.len());
        for d in batch {
            out.push(
                self.process_retrying(std::slice::from_ref(d))
                    .await
                    .map(|mut one| one.remove(0)),
            );
        }
        out
    }

    fn log_decision(&self, d: &Delivery, decision: &Decision) {
        metrics::counter!("mq_consume_total", "topic" => "order_create", "result" => decision.label())
            .increment(1);
        let message_id = d
            .properties
            .get("message_id")
            .map(String::as_str)
            .unwrap_or("");
        let reservation_id = d.keys.split(' ').next().unwrap_or("");
        let trace = d
            .properties
            .get("traceparent")
            .map(String::as_str)
            .unwrap_or("");
        // The trace started at the API continues here: a span per message carrying
        // its trace and parent span ids (JSON logs print the span's fields).
        let (trace_id, parent_span_id) =
            crate::domain::ids::parse_traceparent(trace).unwrap_or_default();
        let span = tracing::info_span!(
            "order_create",
            trace_id = %trace_id,
            parent_span_id = %parent_span_id,
            message_id,
            reservation_id
        );
        let _entered = span.enter();
        match decision {
            Decision::Created { order_id } => debug!(
                message_id, reservation_id, order_id = %order_id,
                consumer_group = %self.names.consumer_group, queue = d.queue_id,
                offset = d.queue_offset, delivery_attempt = d.reconsume_times,
                decision = "CREATED", traceparent = trace, "order created"
            ),
            Decision::DuplicateMessage | Decision::DuplicateReservation => {
                metrics::counter!("mq_duplicate_message_total").increment(1);
                info!(
                    message_id,
                    reservation_id,
                    decision = decision.label(),
                    delivery_attempt = d.reconsume_times,
                    traceparent = trace,
                    "duplicate: already processed, acknowledged"
                );
            }
            Decision::Rejected(reason) => {
                metrics::counter!("mq_business_reject_total", "reason" => reason.code())
                    .increment(1);
                info!(
                    message_id,
                    reservation_id,
                    decision = "REJECTED",
                    reason = reason.code(),
                    traceparent = trace,
                    "reservation rejected; compensation recorded"
                );
            }
            Decision::Quarantined(code) => {
                metrics::counter!("mq_quarantine_total", "reason" => *code).increment(1);
                warn!(message_id, broker_msg_id = %d.broker_msg_id, reason = *code,
                      queue = d.queue_id, offset = d.queue_offset,
                      "poison message quarantined with its raw body");
            }
        }
    }
}

#[async_trait::async_trait]
impl BatchHandler for OrderCreateHandler {
    async fn handle(&self, batch: Vec<Delivery>) -> ConsumeDecision {
        let started = Instant::now();
        metrics::gauge!("mq_consumer_inflight").increment(1.0);
        metrics::histogram!("mq_consume_batch_size").record(batch.len() as f64);
        let result = self.decide(&batch).await;
        metrics::gauge!("mq_consumer_inflight").decrement(1.0);
        metrics::histogram!("mq_consume_process_seconds", "topic" => "order_create")
            .record(started.elapsed().as_secs_f64());
        for (d, outcome) in batch.iter().zip(&result) {
            if let Ok(decision) = outcome {
                self.log_decision(d, decision);
            }
        }
        let failed: Vec<(&Delivery, &TxError)> = batch
            .iter()
            .zip(&result)
            .filter_map(|(d, r)| r.as_ref().err().map(|e| (d, e)))
            .collect();
        if failed.is_empty() {
            // Fault-injection point: committed, killed before the ACK
            // (`FAILPOINTS=consume-after-commit-before-ack=return` aborts like a SIGKILL).
            fail::fail_point!("consume-after-commit-before-ack", |_| std::process::abort());
            return ConsumeDecision::Ack;
        }
        // Remember why, outside the rolled-back transaction: a message that ends in the DLQ
        // is recorded with the error that killed it.
        if let Ok(client) = self.pool.get().await {
            let failures: Vec<crate::pg::dlq::Failure> = failed
                .iter()
                .filter_map(|(d, e)| {
                    let id = d.properties.get("message_id")?;
                    Some((id.as_str(), e.class(), e.to_string()))
                })
                .collect();
            let _ =
                crate::pg::dlq::record_failures(&**client, &self.names.consumer_group, &failures)
                    .await;
        }
        for (d, e) in &failed {
            metrics::counter!("mq_consume_total", "topic" => "order_create", "result" => e.class())
                .increment(1);
            warn!(
                message_id = d.properties.get("message_id").map(String::as_str).unwrap_or(""),
                reservation_id = d.keys.split(' ').next().unwrap_or(""),
                error_class = e.class(), error = %e, delivery_attempt = d.reconsume_times,
                "order transaction rolled back; the broker will redeliver"
            );
        }
        ConsumeDecision::Retry
    }
}
