//! `seckill consume`: the order-create consumer group (§14–16, §22).
//!
//! Each batch the broker hands over becomes one PostgreSQL transaction (see
//! `pg::order_tx`); the batch is ACKed only after the commit. Transient failures roll back
//! and are redelivered by the broker with backoff; after `max_reconsume_times` a message goes
//! to the group's DLQ. At most `budget` transactions run at once (the worker budget, §22),
//! and the PostgreSQL pool is sized from the same number. SIGTERM stops pulling, lets the
//! in-flight transactions finish and exits without ACKing anything uncommitted.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use tokio::sync::Semaphore;
use tracing::{debug, info, warn};

use crate::config::Settings;
use crate::domain::OrderCreateRequested;
use crate::mq::{BatchHandler, ConsumeDecision, Delivery};
use crate::pg::order_tx::{process_batch, Decision, Inbound, TxNames};
use crate::telemetry::Readiness;

/// The order-create handler: decode, one transaction per batch, decide ACK or redelivery.
pub struct OrderCreateHandler {
    pool: deadpool_postgres::Pool,
    names: TxNames,
    /// Worker budget: PostgreSQL transactions this process runs at once.
    budget: Arc<Semaphore>,
    pay_window: chrono::Duration,
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
            budget: Arc::new(Semaphore::new(budget.max(1))),
            pay_window: chrono::Duration::seconds(settings.consumer.pay_window_secs as i64),
        }
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
        let _permit = self
            .budget
            .acquire()
            .await
            .map_err(|e| crate::pg::errors::TxError::Transient(e.to_string()))?;
        let wait = Instant::now();
        let mut client = self.pool.get().await?;
        metrics::histogram!("pg_pool_wait_seconds").record(wait.elapsed().as_secs_f64());
        let status = self.pool.status();
        metrics::gauge!("pg_pool_acquired").set((status.size - status.available) as f64);
        let tx_started = Instant::now();
        let result = process_batch(
            &mut client,
            &self.names,
            &items,
            Utc::now(),
            self.pay_window,
        )
        .await;
        metrics::histogram!("order_tx_latency_seconds").record(tx_started.elapsed().as_secs_f64());
        result
    }
}

#[async_trait::async_trait]
impl BatchHandler for OrderCreateHandler {
    async fn handle(&self, batch: Vec<Delivery>) -> ConsumeDecision {
        let started = Instant::now();
        metrics::gauge!("mq_consumer_inflight").increment(1.0);
        let result = self.process(&batch).await;
        metrics::gauge!("mq_consumer_inflight").decrement(1.0);
        metrics::histogram!("mq_consume_process_seconds", "topic" => "order_create")
            .record(started.elapsed().as_secs_f64());
        match result {
            Ok(decisions) => {
                for (d, decision) in batch.iter().zip(&decisions) {
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
                            metrics::counter!("mq_quarantine_total", "reason" => *code)
                                .increment(1);
                            warn!(message_id, broker_msg_id = %d.broker_msg_id, reason = *code,
                                  queue = d.queue_id, offset = d.queue_offset,
                                  "poison message quarantined with its raw body");
                        }
                    }
                }
                // Injection point of §29.3: committed, killed before the ACK
                // (`FAILPOINTS=consume-after-commit-before-ack=return` aborts like a SIGKILL).
                fail::fail_point!("consume-after-commit-before-ack", |_| std::process::abort());
                ConsumeDecision::Ack
            }
            Err(e) => {
                let ids: Vec<&str> = batch
                    .iter()
                    .filter_map(|d| d.properties.get("message_id").map(String::as_str))
                    .collect();
                // Remember why, outside the rolled-back transaction: a message that ends in
                // the DLQ is recorded with the error that killed it.
                if let Ok(client) = self.pool.get().await {
                    for id in &ids {
                        let _ = crate::pg::dlq::record_failure(
                            &**client,
                            &self.names.consumer_group,
                            id,
                            e.class(),
                            &e.to_string(),
                        )
                        .await;
                    }
                }
                metrics::counter!("mq_consume_total", "topic" => "order_create", "result" => e.class())
                    .increment(batch.len() as u64);
                warn!(
                    message_ids = ?ids, error_class = e.class(), error = %e,
                    delivery_attempt = batch.first().map(|d| d.reconsume_times).unwrap_or(0),
                    "order transaction rolled back; the broker will redeliver"
                );
                ConsumeDecision::Retry
            }
        }
    }
}

/// `seckill consume [--workers N]`.
pub async fn run(settings: Settings, workers: Option<usize>) -> anyhow::Result<()> {
    let budget = workers.unwrap_or_else(|| settings.worker_budget()).max(1);
    metrics::gauge!("worker_budget").set(budget as f64);
    let names = settings.names();
    // One connection per worker plus one spare, so a worker never waits on another's slot.
    let pool = crate::pg::connect_pool(&settings.pg, budget + 1).await?;
    let handler = Arc::new(OrderCreateHandler::new(pool, &settings, budget));
    let ready = Readiness::default();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let ops = crate::telemetry::serve_ops(
        settings.consumer.metrics_listen,
        ready.clone(),
        shutdown.clone(),
    )
    .await?;
    let consumer = crate::mq::start_order_create_consumer(&settings, handler, budget).await?;
    // Compensation shares the process: it is light (one Lua call and one UPDATE per message)
    // and must run wherever orders are created.
    let compensation = Arc::new(crate::roles::compensate::CompensationHandler {
        redis: crate::redis::RedisStore::connect(&settings.redis).await?,
        pool: crate::pg::connect_pool(&settings.pg, 2).await?,
        group: names.compensate_group.clone(),
    });
    let compensator = crate::mq::start_consumer(
        &settings,
        &names.compensate_group,
        &names.compensate_topic,
        compensation,
        2,
        16,
    )
    .await?;
    let projection = Arc::new(crate::roles::projection::ProjectionHandler {
        redis: crate::redis::RedisStore::connect(&settings.redis).await?,
        pool: crate::pg::connect_pool(&settings.pg, 1).await?,
        group: names.projection_group.clone(),
    });
    let projector = crate::mq::start_consumer(
        &settings,
        &names.projection_group,
        &names.order_event_topic,
        projection,
        2,
        16,
    )
    .await?;
    // Dead letters of every group are recorded in PostgreSQL for operators.
    let dlq_pool = crate::pg::connect_pool(&settings.pg, 2).await?;
    let intakes = crate::roles::dlq::start_intakes(&settings, dlq_pool.clone()).await?;
    tokio::spawn(crate::roles::dlq::run_gauges(dlq_pool, shutdown.clone()));
    // Lag of this group (messages and age of the oldest unconsumed one), for /metrics.
    let lag = crate::roles::admission::LagSource {
        probe: Arc::new(
            crate::mq::rocketmq::LagProbe::new(&crate::mq::runtime()?, &settings.mq.name_server)
                .await?,
        ),
        group: names.order_create_group.clone(),
        topic: names.order_create_topic.clone(),
    };
    let lag_stop = shutdown.clone();
    tokio::spawn(async move {
        while !lag_stop.is_cancelled() {
            crate::roles::admission::lag_age(&lag).await;
            tokio::select! {
                _ = lag_stop.cancelled() => break,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    });
    ready.set(true);
    info!(
        group = %names.order_create_group, topic = %names.order_create_topic, workers = budget,
        batch_size = settings.consumer.batch_size, metrics = %settings.consumer.metrics_listen,
        "consumer started"
    );
    crate::telemetry::shutdown_signal().await;
    info!("shutdown signal: no new messages; draining in-flight transactions");
    ready.set(false);
    let grace = Duration::from_secs(settings.consumer.shutdown_grace_secs);
    let both = async {
        tokio::join!(
            consumer.shutdown(),
            compensator.shutdown(),
            projector.shutdown(),
            futures::future::join_all(intakes.into_iter().map(|i| i.shutdown()))
        )
    };
    if tokio::time::timeout(grace, both).await.is_err() {
        warn!(
            grace_secs = grace.as_secs(),
            "shutdown grace elapsed; unfinished batches stay un-ACKed and will be redelivered"
        );
    }
    shutdown.cancel();
    let _ = ops.await;
    info!("consumer stopped");
    Ok(())
}
