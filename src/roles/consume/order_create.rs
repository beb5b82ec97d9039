//! The order-create handler (docs/architecture/order-creation.md#order-creation): each batch the
//! broker hands over becomes one PostgreSQL transaction (see `pg::order_tx`); the batch is ACKed
//! only after the commit. Transient failures roll back and are redelivered by the broker with
//! backoff; after `max_reconsume_times` a message goes to the group's DLQ. At most `budget`
//! transactions run at once (the worker budget, docs/architecture/order-creation.md#worker-budget),
//! under an adaptive limit, split on failure (`services::batch_tx`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use tracing::{debug, info, warn};

use crate::config::Settings;
use crate::domain::ids::reservation_bucket;
use crate::domain::Decision;
use crate::domain::OrderCreateRequested;
use crate::gather::{Gather, GatherSettings};
use crate::limiter::AdaptiveLimiter;
use crate::mq::{BatchHandler, ConsumeDecision, Delivery};
use crate::pg::errors::TxError;
use crate::pg::order_tx::{process_batch, Inbound, TxNames};
use crate::services::batch_tx::TxSlots;

/// The order-create handler: decode, gather the listener calls' batches into transactions
/// (docs/architecture/order-creation.md#gathering-batches-across-queues), decide ACK or redelivery
/// per call.
pub struct OrderCreateHandler {
    core: Arc<Core>,
    /// Each item comes back with its outcome.
    gather: Gather<Inbound, (Inbound, Result<Decision, TxError>)>,
    names: TxNames,
    /// `consumer.bucket_lanes`: each stock bucket's messages gathered apart.
    bucket_lanes: bool,
    /// Doomed reservations rejected ahead of the queue while the consumer is behind.
    fast_lane: super::fast_lane::FastLane,
}

/// Where the items of one listener call go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Lane {
    /// The fast lane's own transaction, ahead of the batches.
    Ahead,
    /// Gathered with other calls' items of the same lane (a stock bucket, or 0).
    Gathered(u32),
}

/// What one transaction needs; shared with the gathering task.
struct Core {
    /// PostgreSQL transactions this process runs at once: adaptive, at most the worker budget.
    slots: TxSlots,
    names: TxNames,
    pay_window: chrono::Duration,
}

impl Core {
    async fn process_items(&self, items: &[Inbound]) -> Result<Vec<Decision>, TxError> {
        // Injection point: a failure that one message causes (its message_id is the
        // failpoint's argument) fails any transaction that contains it.
        #[cfg(feature = "failpoints")]
        if let Some(Some(id)) = fail::eval("order-tx-fails-for-message", |arg| arg) {
            if items.iter().any(|i| i.message_id() == Some(id.as_str())) {
                return Err(TxError::Unknown(
                    format!("injected failure for {id}").into(),
                ));
            }
        }
        self.slots
            .run(async |client| {
                process_batch(client, &self.names, items, Utc::now(), self.pay_window).await
            })
            .await
    }

    /// Outcome per message of a batch: one transaction, split into one per message if it
    /// fails (`TxSlots::split_on_failure`).
    async fn decide(&self, items: &[Inbound]) -> Vec<Result<Decision, TxError>> {
        self.slots
            .split_on_failure(items.len(), |range| self.process_items(&items[range]))
            .await
    }
}

impl Core {
    /// The fast lane's items, rejected in one transaction ahead of the batches; each comes
    /// back with its outcome (on failure, the error for each: the broker redelivers them).
    async fn shed(&self, items: Vec<Inbound>) -> Vec<(Inbound, Result<Decision, TxError>)> {
        let result = self
            .slots
            .retrying(items.len(), || {
                self.slots.run_ahead(async |client| {
                    crate::pg::order_tx::shed(client, &self.names, &items, Utc::now()).await
                })
            })
            .await;
        match result {
            Ok(decisions) => {
                for d in &decisions {
                    if let Decision::Rejected(reason) = d {
                        metrics::counter!("order_fast_lane_total", "reason" => reason.code())
                            .increment(1);
                    }
                }
                items
                    .into_iter()
                    .zip(decisions.into_iter().map(Ok))
                    .collect()
            }
            Err(e) => {
                let (transient, why) = match &e {
                    TxError::Transient(c) => (true, c.to_string()),
                    TxError::Unknown(c) => (false, c.to_string()),
                };
                let error = |why: String| match transient {
                    true => TxError::Transient(why.into()),
                    false => TxError::Unknown(why.into()),
                };
                items
                    .into_iter()
                    .map(|i| (i, Err(error(why.clone()))))
                    .collect()
            }
        }
    }
}

/// While pacing holds, how often the gathering looks again at the age of the waiting work.
const PACE_RECHECK: Duration = Duration::from_millis(20);

/// Order transactions that may run at once (docs/architecture/roles.md#pacing-during-a-burst): the
/// adaptive limit, or one while the oldest waiting reservation (`oldest`, by Redis's acceptance
/// time) is younger than `pace`. Work whose age is unknown (poison) is not held.
fn paced_limit(
    adaptive: usize,
    oldest: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
    pace: chrono::Duration,
) -> usize {
    match oldest {
        Some(created) if now - created < pace => adaptive.min(1),
        _ => adaptive,
    }
}

impl OrderCreateHandler {
    /// Must be called inside a Tokio runtime (it starts the gathering task).
    pub fn new(pool: deadpool_postgres::Pool, settings: &Settings, budget: usize) -> Self {
        let core = Arc::new(Core {
            slots: TxSlots::new(pool, settings, budget, "create"),
            names: TxNames::order_create(settings),
            pay_window: chrono::Duration::seconds(settings.consumer.pay_window_secs as i64),
        });
        let limit = Arc::clone(&core);
        let work = Arc::clone(&core);
        let pace = chrono::Duration::milliseconds(settings.consumer.pace_age_ms as i64);
        let gather = Gather::start(
            GatherSettings {
                max: settings.consumer.batch_size,
                wait: Duration::from_millis(settings.consumer.gather_wait_ms),
                // Listener calls are bounded by the client; this only caps a misconfiguration.
                queue: 1024,
                // Pacing opens up as the waiting work ages, not only when a slot frees up.
                recheck: if pace.is_zero() {
                    Duration::ZERO
                } else {
                    PACE_RECHECK
                },
            },
            move |head: &[Inbound]| {
                let adaptive = limit.slots.limiter().limit();
                if pace.is_zero() {
                    return adaptive;
                }
                let oldest = head
                    .iter()
                    .filter_map(|i| Some(i.event.as_ref().ok()?.reservation_created_at))
                    .min();
                let allowed = paced_limit(adaptive, oldest, Utc::now(), pace);
                metrics::gauge!("order_tx_paced").set(if allowed < adaptive { 1.0 } else { 0.0 });
                allowed
            },
            move |items: Vec<Inbound>| {
                let core = Arc::clone(&work);
                async move {
                    metrics::histogram!("order_tx_batch_size").record(items.len() as f64);
                    let outcomes = core.decide(&items).await;
                    items.into_iter().zip(outcomes).collect()
                }
            },
        );
        Self {
            names: TxNames::order_create(settings),
            core,
            gather,
            bucket_lanes: settings.consumer.bucket_lanes,
            fast_lane: super::fast_lane::FastLane::new(&settings.consumer),
        }
    }

    /// The limit on this handler's transactions in flight.
    pub fn limiter(&self) -> &AdaptiveLimiter {
        self.core.slots.limiter()
    }

    /// Turns broker deliveries into transaction inputs (poison is kept, not dropped). The raw
    /// body, the properties and the ids of the delivery are copied for poison only, the one
    /// case that stores them.
    pub fn inbound(d: &Delivery) -> Inbound {
        match OrderCreateRequested::decode(&d.body) {
            Ok(event) => Inbound {
                event: Ok(event),
                raw_body: Vec::new(),
                properties: serde_json::Value::Null,
                property_message_id: None,
                broker_msg_id: String::new(),
                delivery_attempt: d.reconsume_times,
            },
            Err(reason) => Inbound {
                event: Err(reason),
                raw_body: d.body.clone(),
                properties: serde_json::to_value(&d.properties).unwrap_or_default(),
                property_message_id: d.properties.get("message_id").map(str::to_owned),
                broker_msg_id: d.broker_msg_id.clone(),
                delivery_attempt: d.reconsume_times,
            },
        }
    }

    /// Processes one batch as one transaction of its own (not gathered with other calls) and
    /// returns the decisions (or the error that made it roll back).
    pub async fn process(
        &self,
        batch: &[Delivery],
    ) -> Result<Vec<Decision>, crate::pg::errors::TxError> {
        let items: Vec<Inbound> = batch.iter().map(Self::inbound).collect();
        self.core.process_items(&items).await
    }

    /// Each item with its outcome, in order: the items gathered into transactions, in their
    /// stock bucket's lane when `consumer.bucket_lanes` is on (a call whose messages span
    /// several buckets is split, its parts gathered apart and awaited together); the doomed
    /// ones, while the consumer is behind, in the fast lane's transaction ahead of them.
    async fn submit(
        &self,
        batch: &[Delivery],
        items: Vec<Inbound>,
    ) -> Vec<(Inbound, Result<Decision, TxError>)> {
        let doomed = self.fast_lane.doomed(&items, Utc::now());
        let lanes: Vec<Lane> = items
            .iter()
            .zip(doomed)
            .map(|(i, doomed)| match (&i.event, self.bucket_lanes) {
                _ if doomed => Lane::Ahead,
                (Ok(e), true) => Lane::Gathered(u32::from(reservation_bucket(&e.reservation_id))),
                _ => Lane::Gathered(0),
            })
            .collect();
        let mut parts: BTreeMap<Lane, (Vec<usize>, Vec<Inbound>)> = BTreeMap::new();
        for ((i, item), lane) in items.into_iter().enumerate().zip(&lanes) {
            let part = parts.entry(*lane).or_default();
            part.0.push(i);
            part.1.push(item);
        }
        let answers =
            futures::future::join_all(parts.into_iter().map(|(lane, (idxs, part))| async move {
                let answer = match lane {
                    Lane::Ahead => Some(self.core.shed(part).await),
                    Lane::Gathered(lane) => self.gather.submit_in(lane, part).await,
                };
                (idxs, answer)
            }))
            .await;
        let mut out: Vec<Option<(Inbound, Result<Decision, TxError>)>> =
            (0..batch.len()).map(|_| None).collect();
        for (idxs, answer) in answers {
            match answer {
                Some(outcomes) => {
                    for (i, outcome) in idxs.into_iter().zip(outcomes) {
                        out[i] = Some(outcome);
                    }
                }
                // The transaction's task died: nothing is known, the broker redelivers.
                None => {
                    for i in idxs {
                        let lost = "the gathered transaction ended without an outcome";
                        out[i] = Some((
                            Self::inbound(&batch[i]),
                            Err(TxError::Transient(lost.into())),
                        ));
                    }
                }
            }
        }
        out.into_iter()
            .map(|o| o.expect("one outcome per item"))
            .collect()
    }

    /// The metrics and log lines of a batch's decided messages (committed at `committed`):
    /// the SLO histogram per created order, one counter increment per outcome, the metrics'
    /// handles looked up once per batch rather than once per message.
    fn record_outcomes(
        &self,
        batch: &[Delivery],
        items: &[Inbound],
        result: &[Result<Decision, TxError>],
        committed: DateTime<Utc>,
        log: &BatchLog,
    ) {
        let slo = metrics::histogram!("order_reservation_to_order_seconds");
        let mut counts: Vec<(&'static str, u64)> = Vec::new();
        for ((d, item), outcome) in batch.iter().zip(items).zip(result) {
            let Ok(decision) = outcome else { continue };
            if let (Decision::Created { .. }, Ok(e)) = (decision, &item.event) {
                // The pipeline's SLO, live: Redis's acceptance to the committed order.
                let age = (committed - e.reservation_created_at).num_milliseconds();
                slo.record(age.max(0) as f64 / 1000.0);
            }
            match counts.iter_mut().find(|(l, _)| *l == decision.label()) {
                Some((_, n)) => *n += 1,
                None => counts.push((decision.label(), 1)),
            }
            self.log_decision(d, decision, item, log);
        }
        for (result, n) in counts {
            metrics::counter!("mq_consume_total", "topic" => "order_create", "result" => result)
                .increment(n);
        }
    }

    /// Logs one message's outcome with the fields an operator searches by: the business ids,
    /// what the inbox said (`inbox_result`), how the batch was answered (`ack_result`), the
    /// transaction's latency and the event's schema version.
    fn log_decision(&self, d: &Delivery, decision: &Decision, item: &Inbound, batch: &BatchLog) {
        // A created order logs at DEBUG only: below that, its span (nine fields formatted per
        // message) would be built for nothing on the one path every order takes.
        if matches!(decision, Decision::Created { .. }) && !tracing::enabled!(tracing::Level::DEBUG)
        {
            return;
        }
        let message_id = d.properties.get("message_id").unwrap_or("");
        let reservation_id = d.keys.split(' ').next().unwrap_or("");
        let trace = d.properties.get("traceparent").unwrap_or("");
        // The trace started at the API continues here: a span per message carrying
        // its trace and parent span ids (JSON logs print the span's fields).
        let (trace_id, parent_span_id) =
            crate::domain::ids::parse_traceparent(trace).unwrap_or_default();
        let inbox_result = match decision {
            Decision::DuplicateMessage | Decision::DuplicateReservation => "DUPLICATE",
            Decision::Quarantined(_) => "QUARANTINED",
            _ => "NEW",
        };
        let schema_version = item.event.as_ref().map_or(-1, |e| e.schema_version);
        let span = tracing::info_span!(
            "order_create",
            trace_id = %trace_id,
            parent_span_id = %parent_span_id,
            message_id,
            reservation_id,
            inbox_result,
            ack_result = batch.ack_result,
            tx_latency_ms = batch.tx_latency_ms,
            schema_version
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

/// What the log line of each message of a batch says about the batch.
struct BatchLog {
    /// `ACK`, or `RECONSUME_LATER` when any message of the batch failed.
    ack_result: &'static str,
    tx_latency_ms: f64,
}

#[async_trait::async_trait]
impl BatchHandler for OrderCreateHandler {
    async fn handle(&self, batch: Vec<Delivery>) -> ConsumeDecision {
        let started = Instant::now();
        metrics::gauge!("mq_consumer_inflight").increment(1.0);
        metrics::histogram!("mq_consume_batch_size").record(batch.len() as f64);
        let items: Vec<Inbound> = batch.iter().map(Self::inbound).collect();
        let (items, result): (Vec<Inbound>, Vec<Result<Decision, TxError>>) =
            self.submit(&batch, items).await.into_iter().unzip();
        metrics::gauge!("mq_consumer_inflight").decrement(1.0);
        metrics::histogram!("mq_consume_process_seconds", "topic" => "order_create")
            .record(started.elapsed().as_secs_f64());
        let log = BatchLog {
            ack_result: if result.iter().all(Result::is_ok) {
                "ACK"
            } else {
                "RECONSUME_LATER"
            },
            tx_latency_ms: started.elapsed().as_secs_f64() * 1000.0,
        };
        self.record_outcomes(&batch, &items, &result, Utc::now(), &log);
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
        if let Ok(client) = self.core.slots.pool().get().await {
            let failures: Vec<crate::pg::dlq::Failure> = failed
                .iter()
                .filter_map(|(d, e)| {
                    let id = d.properties.get("message_id")?;
                    Some((id, e.class(), e.to_string()))
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
                message_id = d.properties.get("message_id").unwrap_or(""),
                reservation_id = d.keys.split(' ').next().unwrap_or(""),
                error_class = e.class(), error = %e, delivery_attempt = d.reconsume_times,
                "order transaction rolled back; the broker will redeliver"
            );
        }
        ConsumeDecision::Retry
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pacing_holds_one_transaction_while_the_oldest_reservation_is_young() {
        let now = Utc::now();
        let pace = chrono::Duration::milliseconds(1500);
        let aged = |ms| Some(now - chrono::Duration::milliseconds(ms));
        assert_eq!(paced_limit(8, aged(200), now, pace), 1);
        assert_eq!(paced_limit(8, aged(1499), now, pace), 1);
        // Old enough: the whole adaptive limit, so the backlog drains within the SLO.
        assert_eq!(paced_limit(8, aged(1500), now, pace), 8);
        assert_eq!(paced_limit(8, aged(2900), now, pace), 8);
        // Poison has no age and is never held; off means off.
        assert_eq!(paced_limit(8, None, now, pace), 8);
        assert_eq!(paced_limit(8, aged(10), now, chrono::Duration::zero()), 8);
        // A reservation stamped ahead of this host's clock is young, not an error.
        assert_eq!(paced_limit(8, aged(-300), now, pace), 1);
    }
}
