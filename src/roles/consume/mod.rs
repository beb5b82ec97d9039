//! `seckill consume`: every consumer group that turns messages into durable effects, in one
//! process (docs/ARCHITECTURE.md#roles).
//!
//! - `order_create`: ORDER_CREATE_REQUESTED → one PostgreSQL transaction per batch;
//! - `compensate`: RELEASE_RESERVATION → the unit back in Redis, exactly once;
//! - `projection`: order events → the buyer-facing status in Redis, in version order;
//! - `dlq_intake`: every group's dead letters → PostgreSQL, for `seckill dlq`.
//!
//! SIGTERM stops pulling, lets the in-flight transactions finish and exits without ACKing
//! anything uncommitted.

pub mod compensate;
pub mod dlq_intake;
pub mod order_create;
pub mod projection;

use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, info, warn};

use crate::config::Settings;
use crate::shutdown::Watchdog;
use crate::telemetry::Readiness;

/// `seckill consume [--workers N]`.
pub async fn run(settings: Settings, workers: Option<usize>) -> anyhow::Result<()> {
    // `--workers` sets the batches taken from the broker at once; the transactions among them
    // that run at once stay within the worker budget, under the adaptive limit. Raising
    // `--workers` past the budget only queues batches in memory, it cannot overload PostgreSQL.
    let workers = workers.unwrap_or_else(|| settings.worker_budget()).max(1);
    let budget = settings.worker_budget().min(workers);
    metrics::gauge!("worker_budget").set(budget as f64);
    let names = settings.names();
    // One connection per transaction slot plus one spare, so a worker never waits on another's.
    let pool = crate::pg::connect_pool(&settings.pg, budget + 1).await?;
    let handler = Arc::new(order_create::OrderCreateHandler::new(
        pool, &settings, budget,
    ));
    let ready = Readiness::default();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let ops = crate::telemetry::serve_ops(
        "consumer.metrics_listen",
        settings.consumer.metrics_listen,
        ready.clone(),
        shutdown.clone(),
    )
    .await?;
    let consumer = crate::mq::start_order_create_consumer(&settings, handler, workers).await?;
    // Compensation shares the process: it is light (one Lua call and one UPDATE per message)
    // and must run wherever orders are created.
    let compensation = Arc::new(compensate::CompensationHandler {
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
    let projection = Arc::new(projection::ProjectionHandler {
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
    let intakes = dlq_intake::start_intakes(&settings, dlq_pool.clone()).await?;
    let watchdog = Watchdog::new(shutdown.clone(), ready.clone());
    watchdog.spawn(
        "dlq_gauges",
        dlq_intake::run_gauges(dlq_pool, shutdown.clone()),
    );
    // Lag of this group (messages and age of the oldest unconsumed one), for /metrics.
    let lag = crate::mq::lag::LagSource {
        probe: Arc::new(
            crate::mq::rocketmq::LagProbe::new(&crate::mq::runtime()?, &settings.mq.name_server)
                .await?,
        ),
        group: names.order_create_group.clone(),
        topic: names.order_create_topic.clone(),
    };
    ready.set(true);
    info!(
        group = %names.order_create_group, topic = %names.order_create_topic, workers, budget,
        batch_size = settings.consumer.batch_size, metrics = %settings.consumer.metrics_listen,
        "consumer started"
    );
    // Every second, the consumer's lag figures, until SIGTERM or a dead background task.
    let signal = watchdog.stop_requested();
    tokio::pin!(signal);
    let died = loop {
        tokio::select! {
            died = &mut signal => break died,
            _ = tokio::time::sleep(Duration::from_secs(1)) => sample(&lag, &consumer).await,
        }
    };
    info!("stopping: no new messages; draining in-flight transactions");
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
    match died {
        Some(reason) => Err(anyhow::anyhow!(reason)),
        None => Ok(()),
    }
}

/// The group's lag (from the broker), the messages the client has pulled and holds
/// (`mq_consumer_cached_messages`), and the ones still waiting on the broker, not pulled yet
/// (`mq_consumer_ready`, RocketMQ's "ready" as opposed to in flight).
async fn sample(lag: &crate::mq::lag::LagSource, consumer: &crate::mq::rocketmq::ConsumerHandle) {
    let lag = crate::mq::lag::read_lag(lag).await;
    match consumer.cached_messages().await {
        Ok(cached) => {
            metrics::gauge!("mq_consumer_cached_messages", "topic" => "order_create")
                .set(cached as f64);
            if let Some(lag) = lag {
                let ready = (lag.messages - cached as i64).max(0);
                metrics::gauge!("mq_consumer_ready", "topic" => "order_create").set(ready as f64);
            }
        }
        Err(e) => debug!(error = %e, "consumer cache not sampled"),
    }
}
