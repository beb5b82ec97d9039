//! `seckill consume`: every consumer group that turns messages into durable effects, in one
//! process (docs/architecture/roles.md#roles).
//!
//! - `order_create`: ORDER_CREATE_REQUESTED → one PostgreSQL transaction per batch;
//! - `compensate`: RELEASE_RESERVATION → the unit back in Redis, exactly once;
//! - `projection`: order events → the buyer-facing status in Redis, in version order;
//! - `dlq_intake`: every group's dead letters → PostgreSQL, for `seckill dlq`.
//!
//! SIGTERM stops pulling, lets the in-flight transactions finish and exits without ACKing
//! anything uncommitted.

pub mod audit;
pub mod compensate;
pub mod deferral;
pub mod dlq_intake;
pub mod fast_lane;
pub mod order_create;
pub mod projection;

use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, info, warn};

use crate::config::Settings;
use crate::mq::ConsumerHandle;
use crate::mq::Names;
use crate::roles::runtime::RoleRuntime;

/// `seckill consume [--workers N]`.
pub async fn run(settings: Settings, workers: Option<usize>) -> anyhow::Result<()> {
    // `--workers` (default `consumer.listener_calls`) sets the batches taken from the broker at
    // once; they are gathered into transactions, and the transactions that run at once stay
    // within the worker budget, under the adaptive limit. Calls past the budget only wait in
    // memory (and join the next transaction), they cannot overload PostgreSQL.
    let workers = workers.unwrap_or(settings.consumer.listener_calls).max(1);
    let budget = crate::config::budget::order_budget(&settings.pg).min(workers);
    metrics::gauge!("worker_budget").set(budget as f64);
    let names = settings.names();
    // One connection per transaction slot plus one spare, so a worker never waits on another's.
    // The order transaction's repeated statements keep their plans (pg::PlanCache::Reuse).
    let pool =
        crate::pg::connect_pool_with(&settings.pg, budget + 1, crate::pg::PlanCache::Reuse).await?;
    let handler = Arc::new(order_create::OrderCreateHandler::new(
        pool, &settings, budget,
    ));
    let role = RoleRuntime::start(
        "consumer",
        "consumer.metrics_listen",
        settings.consumer.metrics_listen,
    )
    .await?;
    let consumer = crate::mq::start_order_create_consumer(&settings, handler, workers).await?;
    let defer = Duration::from_secs(settings.consumer.projection_defer_lag_secs);
    let deferral = Arc::new(deferral::Deferral::new(defer));
    let (compensator, projector) = start_side_groups(&settings, deferral.clone()).await?;
    // Dead letters of every group are recorded in PostgreSQL for operators.
    let dlq_pool =
        crate::pg::connect_pool(&settings.pg, crate::config::budget::pools::DLQ_INTAKE).await?;
    let mut intakes = dlq_intake::start_intakes(&settings, dlq_pool.clone()).await?;
    // The audit stream, drained with the side groups on SIGTERM.
    intakes.extend(start_audit(&settings).await?);
    // Which server the pools write to; a failover seen is counted and logged.
    role.watch_primary(&dlq_pool, &settings.pg);
    role.watchdog.spawn(
        "dlq_gauges",
        dlq_intake::run_gauges(
            dlq_pool,
            crate::services::tickets::Tickets::new(&settings.dlq)?,
            role.shutdown.clone(),
        ),
    );
    // The backlog of this role's groups (messages and age of the oldest unconsumed one,
    // retry topics included), for /metrics.
    let probe = Arc::new(
        crate::mq::LagProbe::new(&crate::mq::runtime()?, &settings.mq.name_server_list()).await?,
    );
    let groups = lag_groups(names, settings.consumer.audit_workers > 0);
    role.serving();
    info!(
        group = %names.order_create_group, topic = %names.order_create_topic, workers, budget,
        batch_size = settings.consumer.batch_size, metrics = %settings.consumer.metrics_listen,
        "consumer started"
    );
    let died = sample_until_stopped(&role, &probe, &groups, &consumer, &deferral).await;
    info!("stopping: no new messages; draining in-flight transactions");
    let grace = Duration::from_secs(settings.consumer.shutdown_grace_secs);
    deferral.release();
    drain(grace, [consumer, compensator, projector], intakes).await;
    role.finish(died).await
}

/// Every second, the consumer's lag figures, until SIGTERM or a dead background task: why the
/// role stops (`Some`: a task died).
async fn sample_until_stopped(
    role: &RoleRuntime,
    probe: &crate::mq::LagProbe,
    groups: &[(String, String, &'static str)],
    consumer: &crate::mq::ConsumerHandle,
    deferral: &deferral::Deferral,
) -> Option<String> {
    let signal = role.stop_requested();
    tokio::pin!(signal);
    let mut tick = 0u64;
    // The first sample is taken at once: the figures are on /metrics from the start.
    let mut every = tokio::time::interval(Duration::from_secs(1));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            died = &mut signal => return died,
            _ = every.tick() => {
                // Order-create every second (it drives mq_consumer_ready), the others every 5 s.
                let due = if tick.is_multiple_of(5) { groups } else { &groups[..1] };
                tick += 1;
                sample(probe, due, consumer, deferral).await;
            }
        }
    }
}

/// Compensation and projection share the process: they are light (one Lua call and one
/// UPDATE per message) and must run wherever orders are created.
async fn start_side_groups(
    settings: &Settings,
    deferral: Arc<deferral::Deferral>,
) -> anyhow::Result<(ConsumerHandle, ConsumerHandle)> {
    let names = settings.names();
    let compensation = Arc::new(compensate::CompensationHandler {
        redis: crate::redis::RedisStore::connect(&settings.redis).await?,
        pool: crate::pg::connect_pool(&settings.pg, settings.consumer.compensate_workers).await?,
        group: names.compensate_group.clone(),
    });
    let compensator = crate::mq::start_consumer(
        settings,
        &names.compensate_group,
        &names.compensate_topic,
        compensation,
        settings.consumer.compensate_workers,
        settings.consumer.compensate_batch_size,
    )
    .await?;
    let projection = Arc::new(projection::ProjectionHandler {
        redis: crate::redis::RedisStore::connect(&settings.redis).await?,
        pool: crate::pg::connect_pool(&settings.pg, settings.consumer.projection_workers).await?,
        group: names.projection_group.clone(),
        deferral: Some(deferral),
    });
    let projector = crate::mq::start_consumer(
        settings,
        &names.projection_group,
        &names.order_event_topic,
        projection,
        settings.consumer.projection_workers,
        settings.consumer.projection_batch_size,
    )
    .await?;
    Ok((compensator, projector))
}

/// The audit group (docs/architecture/messages.md#the-audit-stream), unless
/// `consumer.audit_workers` is 0.
async fn start_audit(settings: &Settings) -> anyhow::Result<Option<ConsumerHandle>> {
    let workers = settings.consumer.audit_workers;
    if workers == 0 {
        return Ok(None);
    }
    let group = settings.names().audit_group.clone();
    let pool = crate::pg::connect_pool(&settings.pg, workers).await?;
    let handler = Arc::new(audit::AuditHandler::new(pool, group.clone()));
    let topic = &settings.names().order_event_topic;
    let batch = settings.consumer.audit_batch_size;
    Ok(Some(
        crate::mq::start_consumer(settings, &group, topic, handler, workers, batch).await?,
    ))
}

/// The groups whose backlog this role reports, order-create first: (group, topic, the
/// `topic` label of its gauges). The audit stream, when it runs here, is labelled `audit`: it
/// reads the projection's topic.
fn lag_groups(names: &Names, audit: bool) -> Vec<(String, String, &'static str)> {
    let mut groups = vec![
        (
            names.order_create_group.clone(),
            names.order_create_topic.clone(),
            "order_create",
        ),
        (
            names.compensate_group.clone(),
            names.compensate_topic.clone(),
            "compensate",
        ),
        (
            names.projection_group.clone(),
            names.order_event_topic.clone(),
            "order_event",
        ),
    ];
    if audit {
        let topic = names.order_event_topic.clone();
        groups.push((names.audit_group.clone(), topic, "audit"));
    }
    groups
}

/// Stops every consumer of the role within `grace`: in-flight batches commit and are ACKed;
/// what is still unfinished stays un-ACKed and is redelivered.
async fn drain(grace: Duration, consumers: [ConsumerHandle; 3], intakes: Vec<ConsumerHandle>) {
    let [consumer, compensator, projector] = consumers;
    let all = async {
        tokio::join!(
            consumer.shutdown(),
            compensator.shutdown(),
            projector.shutdown(),
            futures::future::join_all(intakes.into_iter().map(|i| i.shutdown()))
        )
    };
    if tokio::time::timeout(grace, all).await.is_err() {
        warn!(
            grace_secs = grace.as_secs(),
            "shutdown grace elapsed; unfinished batches stay un-ACKed and will be redelivered"
        );
    }
}

/// The groups' backlog (from the broker; the first is order-create), the messages the
/// order-create client has pulled and holds (`mq_consumer_cached_messages`), and the ones
/// still waiting on the broker, not pulled yet (`mq_consumer_ready`, RocketMQ's "ready" as
/// opposed to in flight).
async fn sample(
    probe: &crate::mq::LagProbe,
    groups: &[(String, String, &'static str)],
    consumer: &crate::mq::ConsumerHandle,
    deferral: &deferral::Deferral,
) {
    let mut order_create = None;
    for (i, (group, topic, label)) in groups.iter().enumerate() {
        let b = crate::mq::lag::export_backlog_as(probe, group, topic, label).await;
        if i == 0 {
            if let Some(b) = &b {
                deferral.note_backlog(b.oldest_age);
            }
            order_create = b;
        }
    }
    match consumer.cached_messages().await {
        Ok(cached) => {
            metrics::gauge!("mq_consumer_cached_messages", "topic" => "order_create")
                .set(cached as f64);
            if let Some(b) = order_create {
                let ready = (b.messages - cached as i64).max(0);
                metrics::gauge!("mq_consumer_ready", "topic" => "order_create").set(ready as f64);
            }
        }
        Err(e) => debug!(error = %e, "consumer cache not sampled"),
    }
}
