//! RocketMQ adapter: the rest of the pipeline sees only these types and traits.
//!
//! `Publisher` sends one message (or a batch) and classifies the result into the three
//! outcomes of the design (CONFIRMED / UNKNOWN / DEFINITE_FAILURE). `BatchHandler` is what a
//! consumer group runs for each batch the broker hands over; it decides ACK or redelivery
//! only after its own work is durable. The real implementation lives in `rocketmq/`;
//! unit tests use in-memory fakes of the traits.

pub mod batching;
pub mod lag;
mod properties;
pub mod rocketmq;

pub use crate::config::Names;
pub use properties::Properties;
// What the roles hold of the client behind the traits: the lag probe, a running consumer, the
// transaction producer, the groups' settings and facts, a window of a topic, the broker's stats.
// Nothing outside mq/ names `mq::rocketmq` (tests and the bench may reach into the adapter).
pub use rocketmq::{
    export_broker_stats, group_facts, read_window, ConsumerHandle, GroupSpec, LagProbe,
    RocketTransactionProducer, TransactionOptions,
};

use std::sync::Arc;

/// The short name of one of the pipeline's topics, for metric labels (`order_create`,
/// `order_timeout`, `order_event`, `compensate`; `dlq` for a dead-letter topic, `other` else).
pub fn topic_label(topic: &str) -> &'static str {
    let t = topic.strip_prefix("%RETRY%").unwrap_or(topic);
    if t.starts_with("%DLQ%") {
        "dlq"
    } else if t.ends_with("SECKILL_ORDER_CREATE_V1") {
        "order_create"
    } else if t.ends_with("SECKILL_ORDER_TIMEOUT_V1") {
        "order_timeout"
    } else if t.ends_with("SECKILL_ORDER_EVENT_V1") {
        "order_event"
    } else if t.ends_with("SECKILL_INVENTORY_COMPENSATE_V1") {
        "compensate"
    } else {
        "other"
    }
}

/// A message to publish. Identity lives in `properties["message_id"]`, never in broker ids.
#[derive(Debug, Clone, Default)]
pub struct OutMessage {
    pub topic: String,
    pub tag: String,
    /// Message keys (the first is the business key, e.g. reservation_id); indexed by the broker.
    pub keys: Vec<String>,
    /// User properties: message_id, order_id, traceparent, ...
    pub properties: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// Absolute deliver time (epoch ms) for delayed messages; `None` for normal ones.
    pub deliver_time_ms: Option<i64>,
    /// Ordering key (e.g. the order_id): messages of one topic with the same key are stored on
    /// one queue, chosen deterministically from the key, in send order, provided the caller
    /// sends them one after another or in one `send_batch`. `None`: any queue.
    pub sharding_key: Option<String>,
}

/// What a send came to. UNKNOWN is not a failure: the broker may have stored the message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SendOutcome {
    /// The broker confirmed it stored the message.
    Confirmed { broker_msg_id: String },
    /// Timeout, lost connection, ...: the message may or may not be stored. Retry with the same id.
    Unknown { error: String },
    /// No route / topic, bad message, permission: retrying the same message will not help.
    DefiniteFailure { error: String },
}

impl SendOutcome {
    /// Stable label for metrics and logs.
    pub fn label(&self) -> &'static str {
        match self {
            SendOutcome::Confirmed { .. } => "confirmed",
            SendOutcome::Unknown { .. } => "unknown",
            SendOutcome::DefiniteFailure { .. } => "definite_failure",
        }
    }
}

#[async_trait::async_trait]
pub trait Publisher: Send + Sync + 'static {
    /// Sends one message, bounded by `timeout_ms`, and classifies the result.
    async fn send(&self, msg: OutMessage, timeout_ms: u64) -> SendOutcome;

    /// Sends messages as few broker calls as the broker allows; one outcome per message, in
    /// order. The broker batches messages of one topic without a deliver time (keyed ones per
    /// queue); implementations send anything else one call per message.
    async fn send_batch(&self, msgs: Vec<OutMessage>, timeout_ms: u64) -> Vec<SendOutcome>;
}

/// What the local transaction of a transaction message came to: what the broker is told at
/// its end, and what a check-back answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalOutcome {
    /// The business change is committed: deliver the message.
    Commit,
    /// The business change provably is not, and never will be: drop the message.
    Rollback,
    /// Not known yet (the transaction may still be in flight): the broker asks again.
    Unknown,
}

impl LocalOutcome {
    pub fn label(self) -> &'static str {
        match self {
            LocalOutcome::Commit => "commit",
            LocalOutcome::Rollback => "rollback",
            LocalOutcome::Unknown => "unknown",
        }
    }
}

/// A half message the broker stored and holds back from consumers until its end arrives
/// (docs/architecture/messages.md#delivering-events). Dropping it without `end` leaves the decision
/// to the check-back.
#[async_trait::async_trait]
pub trait HalfMessage: Send {
    /// Tells the broker what the local transaction came to. One way: an end that is lost
    /// is covered by the check-back. Returns the broker's message id.
    async fn end(self: Box<Self>, outcome: LocalOutcome) -> String;
}

/// Sends transaction messages: `begin` stores the half message, the caller runs its local
/// transaction, then ends the half with its outcome.
#[async_trait::async_trait]
pub trait TransactionPublisher: Send + Sync + 'static {
    /// Stores `msg` as a half message. An error is what the send came to: the half may still
    /// be stored after an UNKNOWN one (its check-back then answers from the local state).
    async fn begin(&self, msg: OutMessage) -> Result<Box<dyn HalfMessage>, SendOutcome>;

    /// Stores several half messages for one local transaction; one result per message, in
    /// order. The implementation takes their in-flight slots together, so two batches never
    /// each hold part of what the other waits for.
    async fn begin_many(
        &self,
        msgs: Vec<OutMessage>,
    ) -> Vec<Result<Box<dyn HalfMessage>, SendOutcome>> {
        let mut out = Vec::with_capacity(msgs.len());
        for msg in msgs {
            out.push(self.begin(msg).await);
        }
        out
    }

    /// Stops taking transactions and waits for those in flight to end.
    async fn shutdown(&self) {}
}

/// Answers the broker's check-back about a half message whose end did not arrive, from the
/// local store alone (any process of the producer group may be asked).
#[async_trait::async_trait]
pub trait TransactionChecker: Send + Sync + 'static {
    async fn check(&self, msg: &Delivery) -> LocalOutcome;
}

/// One message as the consumer sees it.
#[derive(Debug, Clone, Default)]
pub struct Delivery {
    /// The topic the message was originally sent to (not the retry topic).
    pub topic: String,
    pub tags: String,
    pub keys: String,
    pub properties: Properties,
    pub body: Vec<u8>,
    /// How many times the broker has already redelivered it (0 on the first delivery).
    pub reconsume_times: i32,
    pub queue_id: i32,
    pub queue_offset: i64,
    /// When the broker stored it (epoch ms): the basis of lag age.
    pub store_timestamp_ms: i64,
    /// Broker's id for diagnostics only.
    pub broker_msg_id: String,
    /// The broker that stored it (with `queue_id` and `queue_offset`: where it is).
    pub broker_name: String,
}

/// ACK the whole batch, or ask for redelivery of the whole batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConsumeDecision {
    Ack,
    Retry,
}

#[async_trait::async_trait]
pub trait BatchHandler: Send + Sync + 'static {
    /// Processes a batch; must only return `Ack` once every effect is committed.
    async fn handle(&self, batch: Vec<Delivery>) -> ConsumeDecision;
}

pub type SharedHandler = Arc<dyn BatchHandler>;

/// The broker message for an ORDER_CREATE_REQUESTED event
/// (docs/architecture/messages.md#the-order-create-message): tag CREATE_ORDER, key
/// reservation_id (plus order_id and request_id), identity in the `message_id` property.
pub fn order_create_message(
    topic: &str,
    event: &crate::domain::OrderCreateRequested,
) -> OutMessage {
    OutMessage {
        topic: topic.to_string(),
        tag: crate::domain::order_create::TAG_CREATE_ORDER.to_string(),
        keys: vec![
            event.reservation_id.clone(),
            event.order_id.clone(),
            event.request_id.clone(),
        ],
        properties: vec![
            ("message_id".into(), event.message_id.clone()),
            ("reservation_id".into(), event.reservation_id.clone()),
            ("order_id".into(), event.order_id.clone()),
            ("request_id".into(), event.request_id.clone()),
            ("schema_version".into(), event.schema_version.to_string()),
            ("traceparent".into(), event.trace.traceparent.clone()),
        ],
        body: event.encode(),
        deliver_time_ms: None,
        sharding_key: None,
    }
}

// ---------------------------------------------------------------------------------------------
// Wiring from settings: what the roles call.
// ---------------------------------------------------------------------------------------------

use crate::config::Settings;

static RUNTIME: std::sync::OnceLock<rocketmq::MqRuntime> = std::sync::OnceLock::new();

/// The process's one RocketMQ client runtime, built on first use.
pub fn runtime() -> anyhow::Result<rocketmq::MqRuntime> {
    if let Some(rt) = RUNTIME.get() {
        return Ok(rt.clone());
    }
    let rt = rocketmq::MqRuntime::new(rocketmq::MqRuntimeConfig {
        listener_slots: 160,
        ..Default::default()
    })?;
    Ok(RUNTIME.get_or_init(|| rt).clone())
}

/// Resolves each name server of `mq.name_server` at start and logs where it points. A name
/// that resolves nowhere is a warning (the client resolves names again on every connect, so a
/// name server added to DNS later is found); none resolving at all fails start-up naming the
/// key.
pub async fn check_name_servers(mq: &crate::config::MqSettings) -> anyhow::Result<()> {
    let mut resolved = 0;
    for server in mq.name_servers() {
        let lookup = tokio::net::lookup_host(server);
        match tokio::time::timeout(std::time::Duration::from_secs(5), lookup).await {
            Ok(Ok(addrs)) => {
                let addrs: Vec<String> = addrs.map(|a| a.to_string()).collect();
                tracing::info!(name_server = server, addresses = %addrs.join(","), "name server");
                resolved += 1;
            }
            Ok(Err(e)) => tracing::warn!(name_server = server, error = %e,
                "name server does not resolve (tried again on every connect)"),
            Err(_) => tracing::warn!(
                name_server = server,
                "name server lookup timed out (tried again on every connect)"
            ),
        }
    }
    anyhow::ensure!(
        resolved > 0,
        "mq.name_server: no name server of `{}` resolves",
        mq.name_server
    );
    Ok(())
}

/// How often each role probes its name servers (`mq_name_server_up`).
const NAME_SERVER_PROBE: std::time::Duration = std::time::Duration::from_secs(2);

/// Probes each name server of `mq.name_server` every two seconds with a TCP connect (one
/// second at most) for the whole life of the process: `mq_name_server_up{name_server}` 1 or 0,
/// `mq_name_server_down_total{name_server}` counts each time one stopped answering. The client
/// itself moves to the next name server on its own; this is what an operator sees of it.
pub fn watch_name_servers(mq: &crate::config::MqSettings) {
    let servers: Vec<String> = mq.name_servers().map(str::to_string).collect();
    tokio::spawn(async move {
        let mut up: Vec<Option<bool>> = vec![None; servers.len()];
        let mut tick = tokio::time::interval(NAME_SERVER_PROBE);
        loop {
            tick.tick().await;
            for (i, server) in servers.iter().enumerate() {
                let connect = tokio::net::TcpStream::connect(server.as_str());
                let answers = matches!(
                    tokio::time::timeout(std::time::Duration::from_secs(1), connect).await,
                    Ok(Ok(_))
                );
                let label = server.clone();
                metrics::gauge!("mq_name_server_up", "name_server" => label.clone())
                    .set(if answers { 1.0 } else { 0.0 });
                if up[i] != Some(answers) {
                    if answers {
                        tracing::info!(name_server = %server, "name server answers");
                    } else {
                        metrics::counter!("mq_name_server_down_total", "name_server" => label)
                            .increment(1);
                        tracing::warn!(name_server = %server,
                            "name server does not answer; the client uses the others");
                    }
                    up[i] = Some(answers);
                }
            }
        }
    });
}

/// Starts the producer of this process (`mq.name_server`, the environment's producer group).
pub async fn connect_publisher(settings: &Settings) -> anyhow::Result<Arc<dyn Publisher>> {
    let rt = runtime()?;
    let mut opts = rocketmq::ProducerOptions::new(
        settings.mq.name_server_list(),
        settings.names().producer_group.clone(),
    );
    opts.send_timeout_ms = settings.mq.send_timeout_ms;
    opts.retries = settings.mq.send_retries;
    let producer = rocketmq::RocketProducer::start(&rt, opts).await?;
    Ok(Arc::new(producer))
}

/// The API's publisher: batched sends (`mq.send_batch_max` > 1) over the process's producer.
pub async fn hot_path_publisher(settings: &Settings) -> anyhow::Result<Arc<dyn Publisher>> {
    let producer = connect_publisher(settings).await?;
    if settings.mq.send_batch_max <= 1 {
        return Ok(producer);
    }
    Ok(Arc::new(batching::BatchingPublisher::start(
        producer,
        batching::BatchingOptions {
            max_batch: settings.mq.send_batch_max,
            linger: std::time::Duration::from_micros(settings.mq.send_linger_us),
            max_in_flight: settings.mq.send_batches_in_flight,
        },
    )))
}

/// Starts a push consumer of `group` on `topic` with `threads` handler calls at once and up
/// to `batch` messages per call.
pub async fn start_consumer(
    settings: &Settings,
    group: &str,
    topic: &str,
    handler: SharedHandler,
    threads: usize,
    batch: usize,
) -> anyhow::Result<rocketmq::ConsumerHandle> {
    let rt = runtime()?;
    rocketmq::start_push_consumer(
        &rt,
        &settings.mq.name_server_list(),
        group,
        topic,
        "*",
        handler,
        rocketmq::ConsumerOptions {
            batch_size: batch.max(1) as u32,
            consume_threads: threads.max(1) as u32,
            max_reconsume_times: settings.consumer.max_reconsume_times,
            consume_from: rocketmq::ConsumeFrom::FirstOffset,
            shutdown_timeout: std::time::Duration::from_secs(settings.consumer.shutdown_grace_secs),
        },
    )
    .await
}

/// Starts the order-create consumer group with `workers` handler calls at once.
pub async fn start_order_create_consumer(
    settings: &Settings,
    handler: SharedHandler,
    workers: usize,
) -> anyhow::Result<rocketmq::ConsumerHandle> {
    let names = settings.names();
    start_consumer(
        settings,
        &names.order_create_group,
        &names.order_create_topic,
        handler,
        workers,
        settings.consumer.batch_size,
    )
    .await
}

/// Deletes `topics` from the configured cluster's brokers and the name server.
pub async fn delete_topics(settings: &Settings, topics: &[String]) -> anyhow::Result<()> {
    let rt = runtime()?;
    rocketmq::delete_topics(
        &rt,
        &settings.mq.name_server_list(),
        &settings.mq.cluster,
        topics,
    )
    .await
}

/// Creates (or updates) consumer `groups` on every configured master (`mq.broker_addr`, else
/// every master of the cluster; idempotent).
pub async fn create_groups(
    settings: &Settings,
    groups: &[rocketmq::GroupSpec],
) -> anyhow::Result<()> {
    let rt = runtime()?;
    let brokers: Vec<&str> = settings.mq.broker_addrs().collect();
    rocketmq::create_groups(
        &rt,
        &settings.mq.name_server_list(),
        &brokers,
        &settings.mq.cluster,
        groups,
    )
    .await
}

/// Deletes consumer `groups` (and their offsets) from every master of the cluster.
pub async fn delete_groups(settings: &Settings, groups: &[String]) -> anyhow::Result<()> {
    let rt = runtime()?;
    rocketmq::delete_groups(
        &rt,
        &settings.mq.name_server_list(),
        &settings.mq.cluster,
        groups,
    )
    .await
}

/// Creates `(topic, queues)` on every configured master (`mq.broker_addr`; idempotent).
pub async fn create_topics(settings: &Settings, topics: &[(String, u32)]) -> anyhow::Result<()> {
    let rt = runtime()?;
    let brokers: Vec<&str> = settings.mq.broker_addrs().collect();
    rocketmq::create_topics(
        &rt,
        &settings.mq.name_server_list(),
        &brokers,
        &settings.mq.cluster,
        topics,
    )
    .await
}
