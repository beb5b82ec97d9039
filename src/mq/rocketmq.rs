//! RocketMQ implementation of the `mq` traits on the rocketmq-rust 1.0.0 client.
//!
//! * [`MqRuntime`]: the one client runtime of the process. The client runs its own Tokio
//!   runtime (owned by a `rocketmq_runtime::RuntimeOwner`); push-consumer listeners run on
//!   its blocking lane `metadata_io`, which this type sizes so that no listener call is ever
//!   refused (a refused call silently goes through the retry topic, +10 s).
//! * [`RocketProducer`]: [`Publisher`] over `DefaultMQProducer`, with every error classified
//!   into CONFIRMED / UNKNOWN / DEFINITE_FAILURE by the pure [`classify_send_error`].
//! * [`start_push_consumer`]: a clustering push consumer whose synchronous listener hands each
//!   batch to a [`super::BatchHandler`] on the caller's Tokio runtime and waits for its decision.
//! * Ordered sends: a message with a `sharding_key` goes to the queue [`shard_index`] picks
//!   from the key, so one key's messages are stored on one queue in send order.
//! * [`LagProbe`]: a group's backlog on a topic (messages and age of the oldest unconsumed
//!   message) for lag metrics and fail-closed admission.
//! * [`create_topics`]: idempotent topic creation through the admin API, waiting until the
//!   name server serves each route (a send before that is a DEFINITE_FAILURE "no route").
//!
//! The crate root needs `#![recursion_limit = "256"]`: proving the client's futures `Send`
//! (as `async_trait` requires) overflows the default limit.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _};
use cheetah_string::CheetahString;
use rocketmq_client_rust::{
    ClientConfig, ClientError, ClientResult, ClientRuntime, ClientRuntimeConfig,
    ConsumeConcurrentlyContext, ConsumeConcurrentlyStatus, ConsumerAdmin, DefaultMQAdminExt,
    DefaultMQProducer, DefaultMQPushConsumer, MQClientException, MQPushConsumer,
    MessageListenerConcurrently, OffsetAdmin, RouteAdmin, SendResult, SendStatus, TelemetryHandle,
    TopicAdmin,
};
use rocketmq_model::common::consumer::consume_from_where::ConsumeFromWhere;
use rocketmq_model::common::message::message_ext::MessageExt;
use rocketmq_model::common::message::message_queue::MessageQueue;
use rocketmq_model::common::message::message_single::Message;
use rocketmq_model::common::message::MessageConst;
use rocketmq_model::topic::TopicConfig;
use rocketmq_runtime::{RuntimeConfig, RuntimeOwner};
use tokio::sync::Notify;

use super::{ConsumeDecision, Delivery, OutMessage, Publisher, SendOutcome, SharedHandler};

/// Prefix of the per-group retry topic through which redelivered messages arrive.
const RETRY_TOPIC_PREFIX: &str = "%RETRY%";

/// Blocking slots of the `metadata_io` lane kept free for the client's own metadata work
/// (route/offset bookkeeping) next to the listener calls.
const LANE_HEADROOM: usize = 8;

// ---------------------------------------------------------------------------------------------
// Runtime
// ---------------------------------------------------------------------------------------------

/// Sizing of the process-wide client runtime.
#[derive(Debug, Clone)]
pub struct MqRuntimeConfig {
    /// Listener calls that may be in flight at once across *all* push consumers of the
    /// process (each consumer reserves its `consume_threads` from this budget).
    pub listener_slots: usize,
    /// Async worker threads of the client's Tokio runtime.
    pub worker_threads: usize,
}

impl Default for MqRuntimeConfig {
    fn default() -> Self {
        Self {
            listener_slots: 40,
            worker_threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
        }
    }
}

/// The RocketMQ client runtime of the process. Cheap to clone; producers and consumers keep a
/// clone, so the runtime lives as long as anything built on it.
#[derive(Clone)]
pub struct MqRuntime {
    inner: Arc<RuntimeInner>,
}

struct RuntimeInner {
    // `None` once `shutdown` has run; dropping the owner shuts its Tokio runtime down in the
    // background, which is safe from inside an async context.
    owner: Mutex<Option<RuntimeOwner>>,
    client: Arc<ClientRuntime>,
    listener_slots: usize,
    reserved_slots: AtomicUsize,
}

impl MqRuntime {
    /// Builds the client runtime. Call from inside a Tokio runtime or not; the client brings
    /// its own.
    pub fn new(config: MqRuntimeConfig) -> anyhow::Result<Self> {
        if config.listener_slots == 0 || config.worker_threads == 0 {
            bail!("MqRuntimeConfig: listener_slots and worker_threads must be positive");
        }
        let lane = config.listener_slots + LANE_HEADROOM;
        let parallelism = config.worker_threads;
        let base = RuntimeConfig::for_parallelism("seckill-mq", parallelism);
        // The global blocking limit must cover the enlarged metadata lane plus the other lanes.
        let global = (lane
            + base.blocking_lane_policies.storage_io.max_concurrency
            + base.blocking_lane_policies.cpu_crypto.max_concurrency)
            .max(48);
        let mut rt = base
            .with_max_blocking_threads(global)
            .map_err(|e| anyhow!("rocketmq runtime config: {e}"))?;
        let md = &mut rt.blocking_lane_policies.metadata_io;
        md.max_concurrency = lane;
        md.max_queue_depth = (2 * lane).max(64);
        // A listener call waits for the batch handler (database work): the lane must not
        // give up on it early, or the client sends the batch to the retry topic while the
        // handler may still commit. 15 min matches the consumer's own consume_timeout.
        md.queue_timeout = Duration::from_secs(60);
        md.task_timeout = Duration::from_secs(15 * 60);
        rt.validate()
            .map_err(|e| anyhow!("rocketmq runtime config: {e}"))?;
        let owner = RuntimeOwner::plan(rt)
            .map_err(|e| anyhow!("rocketmq runtime plan: {e}"))?
            .build()
            .context("building the rocketmq client runtime")?;
        let client = ClientRuntime::try_new(
            owner.root_context().component("seckill-mq"),
            ClientRuntimeConfig::default(),
            TelemetryHandle::noop(),
        )
        .map_err(|e| anyhow!("rocketmq ClientRuntime: {e}"))?;
        Ok(Self {
            inner: Arc::new(RuntimeInner {
                owner: Mutex::new(Some(owner)),
                client,
                listener_slots: config.listener_slots,
                reserved_slots: AtomicUsize::new(0),
            }),
        })
    }

    /// The handle the client builders take.
    pub fn client_runtime(&self) -> Arc<ClientRuntime> {
        Arc::clone(&self.inner.client)
    }

    /// Listener slots not yet reserved by a running push consumer.
    pub fn free_listener_slots(&self) -> usize {
        self.inner
            .listener_slots
            .saturating_sub(self.inner.reserved_slots.load(Ordering::Acquire))
    }

    fn reserve_slots(&self, n: usize) -> anyhow::Result<SlotReservation> {
        let reserved = &self.inner.reserved_slots;
        let mut current = reserved.load(Ordering::Acquire);
        loop {
            let next = current + n;
            if next > self.inner.listener_slots {
                bail!(
                    "consumer needs {n} listener slots but only {} of {} are free; raise \
                     MqRuntimeConfig.listener_slots or lower consume_threads",
                    self.inner.listener_slots - current,
                    self.inner.listener_slots
                );
            }
            match reserved.compare_exchange(current, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    return Ok(SlotReservation {
                        runtime: self.clone(),
                        n,
                    })
                }
                Err(actual) => current = actual,
            }
        }
    }

    /// Stops the client runtime: pooled connections, then tracked tasks. Shut producers and
    /// consumers down first.
    pub async fn shutdown(&self) {
        let report = self.inner.client.shutdown().await;
        if !report.is_healthy() {
            tracing::debug!(report = %report.to_json(), "rocketmq client runtime shutdown report");
        }
        let owner = match self.inner.owner.lock() {
            Ok(mut guard) => guard.take(),
            Err(poisoned) => poisoned.into_inner().take(),
        };
        if let Some(owner) = owner {
            let _ = owner.shutdown_tasks().await;
            let _ = owner.shutdown_background();
        }
    }
}

/// Listener slots held by one push consumer; returned on drop.
struct SlotReservation {
    runtime: MqRuntime,
    n: usize,
}

impl Drop for SlotReservation {
    fn drop(&mut self) {
        self.runtime
            .inner
            .reserved_slots
            .fetch_sub(self.n, Ordering::AcqRel);
    }
}

// ---------------------------------------------------------------------------------------------
// Error classification
// ---------------------------------------------------------------------------------------------

/// The parts of a client error the classification looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ErrorFacts<'a> {
    /// Canonical descriptor code, e.g. `transport.response.timeout`.
    pub code: &'a str,
    /// Canonical condition, e.g. `invalid_argument`, `permission_denied`.
    pub condition: &'a str,
    /// Response code the broker (or name server) answered with, when the error carries one.
    pub broker_code: Option<i32>,
    /// Response code of a wrapped `MQClientException` (`-1` when the client set none).
    pub client_code: Option<i32>,
}

/// Whether a failed send may have stored the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendErrorClass {
    /// The message may or may not be stored: retry with the same message id.
    Unknown,
    /// Certainly not stored, and the same message would fail again.
    DefiniteFailure,
}

/// Broker response codes after which resending the same message cannot succeed:
/// MESSAGE_ILLEGAL, NO_PERMISSION, TOPIC_NOT_EXIST, INVALID_PARAMETER.
const DEFINITE_BROKER_CODES: [i32; 4] = [13, 16, 17, 29];

/// `MQClientException` codes with the same meaning, plus the client's own
/// NOT_FOUND_TOPIC_EXCEPTION (10005). Client code 17 is the name server's "no route".
const DEFINITE_CLIENT_CODES: [i32; 5] = [13, 16, 17, 29, 10005];

/// Descriptor codes that always mean "this message cannot be sent as is".
const DEFINITE_DESCRIPTOR_CODES: [&str; 6] = [
    "route.topic.not_found",
    "broker.topic.not_found",
    "broker.message.invalid",
    "broker.message.too_large",
    "broker.queue.id_out_of_range",
    "protocol.message.property.invalid",
];

/// Classifies a send error. Only failures that certainly left nothing on the broker *and*
/// would repeat are definite; everything else (timeouts, lost connections, busy broker,
/// unclear client states) is UNKNOWN, which the caller resolves by retrying with the same id.
pub fn classify_send_error(facts: &ErrorFacts<'_>) -> SendErrorClass {
    use SendErrorClass::{DefiniteFailure, Unknown};
    if let Some(code) = facts.broker_code {
        // SYSTEM_ERROR, SYSTEM_BUSY, SERVICE_NOT_AVAILABLE, flow control, ...: transient.
        return if DEFINITE_BROKER_CODES.contains(&code) {
            DefiniteFailure
        } else {
            Unknown
        };
    }
    if let Some(code) = facts.client_code.filter(|c| *c != -1) {
        // 10001 connect, 10002/10006 timeout, 10003 "no route available" (broker down), ...
        return if DEFINITE_CLIENT_CODES.contains(&code) {
            DefiniteFailure
        } else {
            Unknown
        };
    }
    if DEFINITE_DESCRIPTOR_CODES.contains(&facts.code) {
        return DefiniteFailure;
    }
    if matches!(facts.condition, "permission_denied" | "unauthenticated") {
        return DefiniteFailure;
    }
    if facts.code == "core.argument.invalid" {
        // The client wraps *every* MQClientException in core.argument.invalid; without a
        // code it is a generic state ("send failed N times", "producer not running"), so
        // only a typed argument error (no wrapped exception) is a real bad message/batch.
        return if facts.client_code.is_some() {
            Unknown
        } else {
            DefiniteFailure
        };
    }
    Unknown
}

/// Turns a client error into the outcome of the design, with a loggable description.
fn outcome_from_error(err: &ClientError) -> SendOutcome {
    let descriptor = err.descriptor();
    let exception = err.source_ref::<MQClientException>();
    let facts = ErrorFacts {
        code: descriptor.code().as_str(),
        condition: descriptor.condition().as_str(),
        broker_code: err.broker_response_code(),
        client_code: exception.map(MQClientException::response_code),
    };
    let detail = exception
        .and_then(MQClientException::error_message)
        .map_or_else(|| err.to_string(), str::to_owned);
    // The error's Display usually starts with its code already.
    let detail = detail
        .strip_prefix(facts.code)
        .map_or(detail.as_str(), |rest| rest.trim_start_matches(": "));
    let error = match (facts.broker_code, facts.client_code) {
        (Some(b), _) => format!("{} (broker code {b}): {detail}", facts.code),
        (None, Some(c)) if c != -1 => format!("{} (client code {c}): {detail}", facts.code),
        _ => format!("{}: {detail}", facts.code),
    };
    match classify_send_error(&facts) {
        SendErrorClass::Unknown => SendOutcome::Unknown { error },
        SendErrorClass::DefiniteFailure => SendOutcome::DefiniteFailure { error },
    }
}

// ---------------------------------------------------------------------------------------------
// Producer
// ---------------------------------------------------------------------------------------------

/// Settings of a [`RocketProducer`].
#[derive(Debug, Clone)]
pub struct ProducerOptions {
    pub name_srv: String,
    pub group: String,
    /// Default bound of a send (each call of the trait passes its own).
    pub send_timeout_ms: u64,
    /// Client-side retries after a failed attempt. Keep 0: a retry after a timeout is a
    /// second copy the caller does not know about; the caller's own retry reuses the id.
    pub retries: u32,
}

impl ProducerOptions {
    pub fn new(name_srv: impl Into<String>, group: impl Into<String>) -> Self {
        Self {
            name_srv: name_srv.into(),
            group: group.into(),
            send_timeout_ms: 3_000,
            retries: 0,
        }
    }
}

/// [`Publisher`] over a started `DefaultMQProducer`.
pub struct RocketProducer {
    // DefaultMQProducer is a cheap handle (Arc inside); cloned for `shutdown(&mut self)`.
    producer: DefaultMQProducer,
    _runtime: MqRuntime,
}

impl RocketProducer {
    /// Builds and starts the producer.
    pub async fn start(runtime: &MqRuntime, opts: ProducerOptions) -> anyhow::Result<Self> {
        let timeout = u32::try_from(opts.send_timeout_ms).unwrap_or(u32::MAX);
        let mut producer = DefaultMQProducer::builder(runtime.client_runtime())
            .producer_group(opts.group.clone())
            .name_server_addr(opts.name_srv.clone())
            .send_msg_timeout(timeout)
            .retry_times_when_send_failed(opts.retries)
            .retry_times_when_send_async_failed(opts.retries)
            .build();
        producer.start().await.map_err(|e| {
            anyhow!(
                "starting producer {} against {}: {e}",
                opts.group,
                opts.name_srv
            )
        })?;
        Ok(Self {
            producer,
            _runtime: runtime.clone(),
        })
    }

    /// Stops the producer (idempotent).
    pub async fn shutdown(&self) {
        let mut producer = self.producer.clone();
        producer.shutdown().await;
    }
}

/// Builds the client message. Fails (definitely) on a reserved property name.
fn to_message(msg: OutMessage, with_delay: bool) -> Result<Message, ClientError> {
    let mut builder = Message::builder().topic(msg.topic).body(msg.body);
    if !msg.tag.is_empty() {
        builder = builder.tags(msg.tag);
    }
    if !msg.keys.is_empty() {
        builder = builder.keys(msg.keys);
    }
    if with_delay {
        if let Some(at) = msg.deliver_time_ms.and_then(|t| u64::try_from(t).ok()) {
            builder = builder.deliver_time_ms(at);
        }
    }
    for (k, v) in msg.properties {
        builder = builder
            .raw_property(k, v)
            .map_err(ClientError::from_error)?;
    }
    builder.build().map_err(ClientError::from_error)
}

fn outcome_from_result(result: ClientResult<Option<SendResult>>) -> SendOutcome {
    match result {
        Ok(Some(r)) if r.send_status == SendStatus::SendOk => SendOutcome::Confirmed {
            broker_msg_id: r.msg_id.map(|id| id.to_string()).unwrap_or_default(),
        },
        // FLUSH_DISK_TIMEOUT / SLAVE_NOT_AVAILABLE: in the broker's memory, durability unsure.
        Ok(Some(r)) => SendOutcome::Unknown {
            error: format!("send status {:?}", r.send_status),
        },
        Ok(None) => SendOutcome::Unknown {
            error: "send returned no result".to_owned(),
        },
        Err(e) => outcome_from_error(&e),
    }
}

impl RocketProducer {
    async fn send_one(&self, msg: OutMessage, timeout_ms: u64) -> SendOutcome {
        match to_message(msg, true) {
            Ok(m) => outcome_from_result(self.producer.send_with_timeout(m, timeout_ms).await),
            Err(e) => outcome_from_error(&e),
        }
    }

    async fn send_each(&self, msgs: Vec<OutMessage>, timeout_ms: u64) -> Vec<SendOutcome> {
        futures::future::join_all(msgs.into_iter().map(|m| self.send_one(m, timeout_ms))).await
    }

    /// Messages without sharding keys: one broker batch when possible, else one send each.
    async fn send_unsharded_batch(
        &self,
        msgs: Vec<OutMessage>,
        timeout_ms: u64,
    ) -> Vec<SendOutcome> {
        let batchable = msgs.len() > 1
            && msgs
                .iter()
                .all(|m| m.deliver_time_ms.is_none() && m.topic == msgs[0].topic);
        if !batchable {
            // The broker stores a batch on one topic and without delay; anything else goes
            // out message by message.
            return self.send_each(msgs, timeout_ms).await;
        }
        let n = msgs.len();
        let mut built = Vec::with_capacity(n);
        for m in msgs.iter().cloned() {
            match to_message(m, false) {
                Ok(b) => built.push(b),
                // One bad message must not sink the others: give each its own verdict.
                Err(_) => return self.send_each(msgs, timeout_ms).await,
            }
        }
        match self
            .producer
            .send_batch_with_timeout(built, timeout_ms)
            .await
        {
            Ok(r) => batch_outcomes(r, n),
            Err(e) => match outcome_from_error(&e) {
                // Nothing of the batch is stored; the reason may be one message or the
                // batch's total size, so retry individually for per-message verdicts.
                SendOutcome::DefiniteFailure { .. } => self.send_each(msgs, timeout_ms).await,
                other => vec![other; n],
            },
        }
    }
}

/// Outcomes of a batch the broker answered: per-message ids on success.
fn batch_outcomes(r: SendResult, n: usize) -> Vec<SendOutcome> {
    if r.send_status != SendStatus::SendOk {
        return vec![outcome_from_result(Ok(Some(r))); n];
    }
    // msg_id lists each message's id, comma separated, in order.
    let ids = r.msg_id.as_ref().map(|s| s.as_str()).unwrap_or_default();
    let mut ids = ids.split(',');
    (0..n)
        .map(|_| SendOutcome::Confirmed {
            broker_msg_id: ids.next().unwrap_or_default().to_owned(),
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Ordered (sharded) sends
// ---------------------------------------------------------------------------------------------
//
// A message with `sharding_key: Some(k)` goes to the queue `shard_index(k, n)` of the topic's
// n writable queues (ranked by broker name, then queue id), taken from the producer's cached
// route: the same list every send of the process uses. Sends of one key never overlap inside
// a call, and after a message of a key is not confirmed, the later messages of that key in the
// same call are not sent (they come back UNKNOWN, "not sent"): the caller's retry of the
// failed one would otherwise land behind them. Ordering holds while the topic's queue count
// is stable; changing it moves keys to other queues.

/// FNV-1a, 64 bit: a fixed, documented hash (unlike `std`'s, which is seeded per process).
/// Changing it moves every key to another queue, so it is part of the wire contract.
fn fnv1a_64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Index of the queue (among `queue_count`) a sharding key maps to; `None` without queues.
pub fn shard_index(key: &str, queue_count: usize) -> Option<usize> {
    let n = u64::try_from(queue_count).ok().filter(|n| *n > 0)?;
    usize::try_from(fnv1a_64(key.as_bytes()) % n).ok()
}

/// The queue of `key` among `queues`. The client's queue order is not a contract, so the
/// queues are ranked by (broker name, queue id) first.
fn shard_queue(queues: &[MessageQueue], key: &str) -> Option<MessageQueue> {
    let mut ranked: Vec<&MessageQueue> = queues.iter().collect();
    ranked.sort_unstable_by(|a, b| {
        (a.broker_name().as_str(), a.queue_id()).cmp(&(b.broker_name().as_str(), b.queue_id()))
    });
    let index = shard_index(key, ranked.len())?;
    ranked.get(index).map(|q| (*q).clone())
}

/// A keyed message with its place in the caller's list.
struct Routed {
    index: usize,
    /// (topic, sharding key): the unit of ordering.
    stream: (String, String),
    delayed: bool,
    msg: Message,
}

/// Outcome of a message deliberately not sent to keep its key's order.
fn not_sent(stream: &(String, String), why: &str) -> SendOutcome {
    SendOutcome::Unknown {
        error: format!(
            "not sent: {why} for sharding key {} on {}; retry after it",
            stream.1, stream.0
        ),
    }
}

fn remaining_ms(deadline: Instant) -> u64 {
    u64::try_from(
        deadline
            .saturating_duration_since(Instant::now())
            .as_millis(),
    )
    .unwrap_or(u64::MAX)
}

impl RocketProducer {
    /// Sends messages of which at least one has a sharding key; one outcome per message, in
    /// order. Keyless messages take the unsharded path at the same time. Keyed messages are
    /// grouped by their queue: a group of two or more undelayed messages is one broker batch
    /// (stored at consecutive offsets, so in call order), anything else goes one by one in
    /// call order. Groups (distinct queues) are sent concurrently.
    async fn send_sharded(&self, msgs: Vec<OutMessage>, timeout_ms: u64) -> Vec<SendOutcome> {
        let deadline = Instant::now() + Duration::from_millis(timeout_ms);
        let n = msgs.len();
        let mut outcomes: Vec<Option<SendOutcome>> = vec![None; n];
        let mut keyless_index = Vec::new();
        let mut keyless = Vec::new();
        let mut groups: Vec<(MessageQueue, Vec<Routed>)> = Vec::new();
        let mut broken: HashMap<(String, String), &'static str> = HashMap::new();
        let mut route_errors: HashMap<String, SendOutcome> = HashMap::new();

        for (index, m) in msgs.into_iter().enumerate() {
            let Some(key) = m.sharding_key.clone() else {
                keyless_index.push(index);
                keyless.push(m);
                continue;
            };
            let stream = (m.topic.clone(), key);
            if let Some(why) = broken.get(&stream) {
                outcomes[index] = Some(not_sent(&stream, why));
                continue;
            }
            let delayed = m.deliver_time_ms.is_some();
            let mut msg = match to_message(m, true) {
                Ok(msg) => msg,
                Err(e) => {
                    outcomes[index] = Some(outcome_from_error(&e));
                    broken.insert(stream, "an earlier message failed");
                    continue;
                }
            };
            let outcome = match route_errors.get(&stream.0) {
                Some(failed) => Err(failed.clone()),
                None => self.select_queue(&mut msg, &stream, deadline).await,
            };
            match outcome {
                Ok(mq) => {
                    let routed = Routed {
                        index,
                        stream,
                        delayed,
                        msg,
                    };
                    match groups.iter_mut().find(|(q, _)| *q == mq) {
                        Some((_, group)) => group.push(routed),
                        None => groups.push((mq, vec![routed])),
                    }
                }
                Err(failed) => {
                    route_errors.insert(stream.0.clone(), failed.clone());
                    outcomes[index] = Some(failed);
                    broken.insert(stream, "no queue could be chosen");
                }
            }
        }

        let keyless_sends = async {
            if keyless.is_empty() {
                Vec::new()
            } else {
                self.send_unsharded_batch(keyless, remaining_ms(deadline).max(1))
                    .await
            }
        };
        let group_sends = futures::future::join_all(
            groups
                .into_iter()
                .map(|(mq, group)| self.send_queue_group(mq, group, deadline)),
        );
        let (keyless_outcomes, group_outcomes) = tokio::join!(keyless_sends, group_sends);
        for (index, outcome) in keyless_index.into_iter().zip(keyless_outcomes) {
            outcomes[index] = Some(outcome);
        }
        for (index, outcome) in group_outcomes.into_iter().flatten() {
            outcomes[index] = Some(outcome);
        }
        outcomes
            .into_iter()
            .map(|o| {
                o.unwrap_or_else(|| SendOutcome::Unknown {
                    error: "internal: message left without an outcome; not sent".to_owned(),
                })
            })
            .collect()
    }

    /// The queue of the message's key, from the producer's cached route (fetched from the name
    /// server on first use of the topic). An error is the message's outcome: nothing was sent.
    async fn select_queue(
        &self,
        msg: &mut Message,
        stream: &(String, String),
        deadline: Instant,
    ) -> Result<MessageQueue, SendOutcome> {
        let imp = self
            .producer
            .get_default_mq_producer_impl()
            .ok_or_else(|| SendOutcome::Unknown {
                error: "client.lifecycle.not_started: producer not started".to_owned(),
            })?;
        let selector =
            |queues: &[MessageQueue], _: &Message, key: &String| shard_queue(queues, key);
        match imp
            .invoke_message_queue_selector(msg, selector, &stream.1, remaining_ms(deadline))
            .await
        {
            Ok(mq) => Ok(mq),
            Err(e) => Err(self.route_failure(&stream.0, &e).await),
        }
    }

    /// Classifies a failed queue choice. The client only says "no queue", whether the topic
    /// does not exist (definite) or the name server could not be asked (unknown); one direct
    /// route lookup tells the two apart.
    async fn route_failure(&self, topic: &str, select_err: &ClientError) -> SendOutcome {
        let Some(imp) = self.producer.get_default_mq_producer_impl() else {
            return outcome_from_error(select_err);
        };
        match imp
            .fetch_publish_message_queues(&CheetahString::from(topic.to_owned()))
            .await
        {
            // The route appeared in between: nothing was sent, a retry will find it.
            Ok(queues) if !queues.is_empty() => SendOutcome::Unknown {
                error: format!("no queue chosen for {topic} ({select_err}); route now available"),
            },
            Ok(_) => SendOutcome::DefiniteFailure {
                error: format!("route.topic.not_found: topic {topic} has no writable queue"),
            },
            Err(e) => match e
                .source_ref::<MQClientException>()
                .map(|x| x.response_code())
            {
                // The name server answered without a usable route (the client folds "topic
                // does not exist" into this code-less exception).
                Some(-1) => SendOutcome::DefiniteFailure {
                    error: format!("route.topic.not_found: no route for topic {topic}: {e}"),
                },
                // Transport trouble or a coded name-server answer: the usual classification.
                _ => outcome_from_error(&e),
            },
        }
    }

    /// Sends the messages of one queue, keeping their order; returns (index, outcome) pairs.
    async fn send_queue_group(
        &self,
        mq: MessageQueue,
        group: Vec<Routed>,
        deadline: Instant,
    ) -> Vec<(usize, SendOutcome)> {
        if group.len() > 1 && group.iter().all(|r| !r.delayed) {
            let msgs: Vec<Message> = group.iter().map(|r| r.msg.clone()).collect();
            let n = msgs.len();
            let result = self
                .producer
                .send_batch_to_queue_with_timeout(msgs, mq.clone(), remaining_ms(deadline).max(1))
                .await;
            match result {
                Ok(r) => {
                    let outcomes = batch_outcomes(r, n);
                    return group.iter().map(|r| r.index).zip(outcomes).collect();
                }
                Err(e) => match outcome_from_error(&e) {
                    // Nothing is stored; find the culprit with single sends (in order).
                    SendOutcome::DefiniteFailure { .. } => {}
                    other => return group.iter().map(|r| (r.index, other.clone())).collect(),
                },
            }
        }
        let mut out = Vec::with_capacity(group.len());
        let mut broken: HashMap<(String, String), &'static str> = HashMap::new();
        for r in group {
            if let Some(why) = broken.get(&r.stream) {
                out.push((r.index, not_sent(&r.stream, why)));
                continue;
            }
            let left = remaining_ms(deadline);
            if left == 0 {
                out.push((r.index, not_sent(&r.stream, "call deadline reached")));
                broken.insert(r.stream, "call deadline reached");
                continue;
            }
            let outcome = outcome_from_result(
                self.producer
                    .send_to_queue_with_timeout(r.msg, mq.clone(), left)
                    .await,
            );
            if !matches!(outcome, SendOutcome::Confirmed { .. }) {
                broken.insert(r.stream, "an earlier message was not confirmed");
            }
            out.push((r.index, outcome));
        }
        out
    }
}

#[async_trait::async_trait]
impl Publisher for RocketProducer {
    async fn send(&self, msg: OutMessage, timeout_ms: u64) -> SendOutcome {
        if msg.sharding_key.is_none() {
            return self.send_one(msg, timeout_ms).await;
        }
        self.send_sharded(vec![msg], timeout_ms)
            .await
            .pop()
            .unwrap_or_else(|| SendOutcome::Unknown {
                error: "internal: no outcome for the message; not sent".to_owned(),
            })
    }

    /// With sharding keys (see "Ordered (sharded) sends" above): keyed messages are grouped by
    /// queue into per-queue batches, never sent concurrently with another message of their key;
    /// keyless ones go out as an unkeyed batch at the same time.
    async fn send_batch(&self, msgs: Vec<OutMessage>, timeout_ms: u64) -> Vec<SendOutcome> {
        if msgs.iter().any(|m| m.sharding_key.is_some()) {
            return self.send_sharded(msgs, timeout_ms).await;
        }
        self.send_unsharded_batch(msgs, timeout_ms).await
    }
}

// ---------------------------------------------------------------------------------------------
// Push consumer
// ---------------------------------------------------------------------------------------------

/// Where a consumer group without a committed offset starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ConsumeFrom {
    /// Everything still in the queue (the safe choice for a pipeline).
    #[default]
    FirstOffset,
    /// Only messages arriving after the group first starts.
    LastOffset,
}

/// How often a push consumer commits its offsets to the broker (the client's default is 5 s,
/// its minimum 1 s). Lag readings see only committed offsets, so at the end of a burst they
/// trail real consumption by up to this much (the client's first commit comes 10 s after
/// start, a fixed delay). One small request per queue per interval.
const OFFSET_COMMIT_INTERVAL_MS: u32 = 1_000;

/// Settings of one push consumer.
#[derive(Debug, Clone)]
pub struct ConsumerOptions {
    /// Max messages per handler call (the client delivers up to 32 per call).
    pub batch_size: u32,
    /// Handler calls in flight at once for this consumer; reserved from
    /// [`MqRuntimeConfig::listener_slots`].
    pub consume_threads: u32,
    /// Redeliveries before a message goes to `%DLQ%<group>`.
    pub max_reconsume_times: i32,
    pub consume_from: ConsumeFrom,
    /// How long `shutdown` waits for in-flight handler calls.
    pub shutdown_timeout: Duration,
}

impl Default for ConsumerOptions {
    fn default() -> Self {
        Self {
            batch_size: 32,
            consume_threads: 8,
            max_reconsume_times: 16,
            consume_from: ConsumeFrom::FirstOffset,
            shutdown_timeout: Duration::from_secs(30),
        }
    }
}

/// Counts listener calls in progress so shutdown can wait for them.
#[derive(Default)]
struct InFlight {
    count: AtomicUsize,
    idle: Notify,
}

struct InFlightGuard<'a>(&'a InFlight);

impl InFlight {
    fn enter(&self) -> InFlightGuard<'_> {
        self.count.fetch_add(1, Ordering::AcqRel);
        InFlightGuard(self)
    }

    async fn wait_idle(&self) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            // Register before checking, so a guard dropped in between still wakes us.
            notified.as_mut().enable();
            if self.count.load(Ordering::Acquire) == 0 {
                return;
            }
            notified.await;
        }
    }
}

impl Drop for InFlightGuard<'_> {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// The synchronous listener the client calls on its blocking lane.
struct BridgeListener {
    handler: SharedHandler,
    /// Runtime of the caller of `start_push_consumer`: handlers run there, never on the
    /// client's own runtime, so a handler that sends messages cannot starve the client.
    app: tokio::runtime::Handle,
    in_flight: Arc<InFlight>,
}

impl MessageListenerConcurrently for BridgeListener {
    fn consume_message(
        &self,
        msgs: &[&MessageExt],
        _context: &ConsumeConcurrentlyContext,
    ) -> ClientResult<ConsumeConcurrentlyStatus> {
        let _guard = self.in_flight.enter();
        let batch: Vec<Delivery> = msgs.iter().map(|m| to_delivery(m)).collect();
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let handler = Arc::clone(&self.handler);
        // This thread is a blocking-pool thread (not a runtime worker), so waiting on a std
        // channel here cannot stall any executor. If the task panics or the app runtime is
        // gone, the sender is dropped and recv() fails: the batch is redelivered.
        self.app.spawn(async move {
            let decision = handler.handle(batch).await;
            let _ = tx.send(decision);
        });
        let decision = rx.recv().unwrap_or_else(|_| {
            tracing::warn!(
                "batch handler ended without a decision (panic or shutdown); retrying batch"
            );
            ConsumeDecision::Retry
        });
        Ok(match decision {
            ConsumeDecision::Ack => ConsumeConcurrentlyStatus::ConsumeSuccess,
            ConsumeDecision::Retry => ConsumeConcurrentlyStatus::ReconsumeLater,
        })
    }
}

fn to_delivery(m: &MessageExt) -> Delivery {
    let properties: HashMap<String, String> = m
        .properties()
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let raw_topic = m.topic().as_str();
    // The client already restores the original topic of retried messages; this covers any
    // path that does not.
    let topic = if raw_topic.starts_with(RETRY_TOPIC_PREFIX) {
        properties
            .get(MessageConst::PROPERTY_RETRY_TOPIC)
            .cloned()
            .unwrap_or_else(|| raw_topic.to_owned())
    } else {
        raw_topic.to_owned()
    };
    Delivery {
        topic,
        tags: properties
            .get(MessageConst::PROPERTY_TAGS)
            .cloned()
            .unwrap_or_default(),
        keys: properties
            .get(MessageConst::PROPERTY_KEYS)
            .cloned()
            .unwrap_or_default(),
        body: m.body().map(|b| b.to_vec()).unwrap_or_default(),
        reconsume_times: m.reconsume_times(),
        queue_id: m.queue_id(),
        queue_offset: m.queue_offset(),
        store_timestamp_ms: m.store_timestamp(),
        broker_msg_id: m.msg_id().to_string(),
        properties,
    }
}

/// A running push consumer.
pub struct ConsumerHandle {
    consumer: DefaultMQPushConsumer,
    in_flight: Arc<InFlight>,
    shutdown_timeout: Duration,
    group: String,
    _slots: SlotReservation,
}

impl ConsumerHandle {
    /// Handler calls running right now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.count.load(Ordering::Acquire)
    }

    /// Messages the client has pulled for this consumer and holds in its process queues
    /// (waiting for a worker or inside a handler call), i.e. not yet ACKed.
    pub async fn cached_messages(&self) -> anyhow::Result<u64> {
        let info = self
            .consumer
            .consumer_running_info()
            .await
            .map_err(|e| anyhow!("reading the running info of {}: {e}", self.group))?;
        Ok(info
            .mq_table
            .values()
            .map(|q| u64::from(q.cached_msg_count))
            .sum())
    }

    /// Stops pulling, lets running handler calls finish and commits their offsets.
    /// Returns `false` if calls were still running after `shutdown_timeout` (their messages
    /// are then redelivered later, which the handlers must tolerate anyway).
    pub async fn shutdown(mut self) -> bool {
        // The client waits up to its await-termination bound for running consume requests,
        // then persists offsets.
        self.consumer.shutdown().await;
        let drained = tokio::time::timeout(self.shutdown_timeout, self.in_flight.wait_idle())
            .await
            .is_ok();
        if !drained {
            tracing::warn!(group = %self.group, in_flight = self.in_flight(),
                "consumer shutdown: handler calls still running after the timeout");
        }
        drained
    }
}

/// Starts a clustering push consumer of `group` on `topic` (tag expression `tag_expr`, e.g.
/// `*`). Must be called inside the Tokio runtime on which `handler` should run.
pub async fn start_push_consumer(
    runtime: &MqRuntime,
    name_srv: &str,
    group: &str,
    topic: &str,
    tag_expr: &str,
    handler: SharedHandler,
    opts: ConsumerOptions,
) -> anyhow::Result<ConsumerHandle> {
    let app = tokio::runtime::Handle::try_current()
        .context("start_push_consumer must run inside a Tokio runtime")?;
    let threads = opts.consume_threads.max(1);
    let slots = runtime.reserve_slots(threads as usize)?;
    let consume_from = match opts.consume_from {
        ConsumeFrom::FirstOffset => ConsumeFromWhere::ConsumeFromFirstOffset,
        ConsumeFrom::LastOffset => ConsumeFromWhere::ConsumeFromLastOffset,
    };
    let batch = opts.batch_size.clamp(1, 1024);
    let mut client_config = ClientConfig::default();
    client_config.set_persist_consumer_offset_interval(OFFSET_COMMIT_INTERVAL_MS);
    let mut consumer = DefaultMQPushConsumer::builder(runtime.client_runtime())
        // Before name_server_addr: client_config replaces the whole client configuration.
        .client_config(client_config)
        .consumer_group(group.to_owned())
        .name_server_addr(name_srv.to_owned())
        .consume_from_where(consume_from)
        .consume_message_batch_max_size(batch)
        .pull_batch_size(batch.max(32))
        .consume_thread_min(threads)
        .consume_thread_max(threads)
        .max_reconsume_times(opts.max_reconsume_times)
        .await_termination_millis_when_shutdown(
            u64::try_from(opts.shutdown_timeout.as_millis()).unwrap_or(u64::MAX),
        )
        .build();
    consumer
        .subscribe(topic, tag_expr)
        .await
        .map_err(|e| anyhow!("subscribing {group} to {topic}: {e}"))?;
    let in_flight = Arc::new(InFlight::default());
    consumer.register_message_listener_concurrently(BridgeListener {
        handler,
        app,
        in_flight: Arc::clone(&in_flight),
    });
    consumer
        .start()
        .await
        .map_err(|e| anyhow!("starting consumer {group} against {name_srv}: {e}"))?;
    Ok(ConsumerHandle {
        consumer,
        in_flight,
        shutdown_timeout: opts.shutdown_timeout,
        group: group.to_owned(),
        _slots: slots,
    })
}

// ---------------------------------------------------------------------------------------------
// Consumer lag
// ---------------------------------------------------------------------------------------------

/// How long a topic's broker list is reused before the name server is asked again.
const LAG_ROUTE_TTL: Duration = Duration::from_secs(30);

/// Bound of each admin call of a lag reading.
const LAG_RPC_TIMEOUT_MS: u64 = 3_000;

/// Backlog of a consumer group on one topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Lag {
    /// Sum over the topic's queues of (broker max offset − group's committed offset); a group
    /// that never committed counts from offset 0, i.e. every message in the queue.
    pub messages: i64,
    /// Now − store time of the oldest message not yet consumed; `None` when `messages` is 0.
    pub oldest_unconsumed_age_ms: Option<i64>,
}

/// Per-queue facts a lag reading combines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueLagFacts {
    /// Broker's max offset of the queue.
    pub broker_offset: i64,
    /// Group's committed offset (the broker reports 0 for a group that never committed).
    pub consumer_offset: i64,
    /// Broker-computed now − store time of the message at `consumer_offset` (0 when the
    /// broker has none, e.g. no committed offset).
    pub delay_ms: i64,
    /// Store time of the earliest message still in the queue (0 if unknown).
    pub min_store_ms: i64,
}

/// Combines per-queue facts into a [`Lag`] (pure). Errors if a queue with a backlog has no
/// usable store time: "unknown" must not read as "fresh" for fail-closed admission.
pub fn combine_lag(queues: &[QueueLagFacts], now_ms: i64) -> anyhow::Result<Lag> {
    let mut messages = 0i64;
    let mut age: Option<i64> = None;
    for q in queues {
        let behind = (q.broker_offset - q.consumer_offset).max(0);
        if behind == 0 {
            continue;
        }
        messages += behind;
        // Offset 0 means "never committed" as often as "nothing consumed yet": either way the
        // oldest unconsumed message is the earliest one still stored. Otherwise the broker's
        // delay at the committed offset is exactly that message's age.
        let queue_age = if q.consumer_offset == 0 {
            if q.min_store_ms <= 0 {
                bail!("queue with {behind} unconsumed messages has no earliest store time");
            }
            (now_ms - q.min_store_ms).max(0)
        } else {
            q.delay_ms.max(0)
        };
        age = Some(age.map_or(queue_age, |a| a.max(queue_age)));
    }
    Ok(Lag {
        messages,
        oldest_unconsumed_age_ms: if messages > 0 { age } else { None },
    })
}

/// topic → (fetched at, master broker addresses).
type BrokerCache = HashMap<String, (Instant, Arc<[CheetahString]>)>;

/// Reads consumer lag through one long-lived admin client: one broker call per broker when
/// the group is caught up, plus one name-server and one broker call per broker when it is
/// not (the store times). Share it (`Arc<LagProbe>`); calls may overlap.
pub struct LagProbe {
    admin: DefaultMQAdminExt,
    brokers: Mutex<BrokerCache>,
    _runtime: MqRuntime,
}

/// An admin client of the process's runtime, started against `name_srv`.
async fn start_admin(runtime: &MqRuntime, name_srv: &str) -> anyhow::Result<DefaultMQAdminExt> {
    let mut admin = DefaultMQAdminExt::new(runtime.client_runtime());
    admin.set_namesrv_addr(name_srv);
    admin
        .start()
        .await
        .map_err(|e| anyhow!("starting admin client against {name_srv}: {e}"))?;
    Ok(admin)
}

impl LagProbe {
    /// Starts the admin client against `name_srv`.
    pub async fn new(runtime: &MqRuntime, name_srv: &str) -> anyhow::Result<Self> {
        let admin = start_admin(runtime, name_srv).await?;
        Ok(Self {
            admin,
            brokers: Mutex::new(HashMap::new()),
            _runtime: runtime.clone(),
        })
    }

    /// Current lag of `group` on `topic` (the topic only, not the group's retry topic).
    pub async fn lag(&self, group: &str, topic: &str) -> anyhow::Result<Lag> {
        let brokers = self.topic_brokers(topic).await?;
        let result = self.read_lag(&brokers, group, topic).await;
        if result.is_err() {
            // A broker may have moved: look the route up again next time.
            self.lock_brokers().remove(topic);
        }
        result
    }

    /// Stops the admin client.
    pub async fn shutdown(mut self) {
        self.admin.shutdown().await;
    }

    async fn read_lag(
        &self,
        brokers: &[CheetahString],
        group: &str,
        topic: &str,
    ) -> anyhow::Result<Lag> {
        let group_cs = CheetahString::from(group.to_owned());
        let topic_cs = CheetahString::from(topic.to_owned());
        let mut offsets: Vec<(MessageQueue, i64, i64)> = Vec::new();
        for addr in brokers {
            let stats = self
                .admin
                .examine_consume_stats(
                    group_cs.clone(),
                    Some(topic_cs.clone()),
                    None,
                    Some(addr.clone()),
                    Some(LAG_RPC_TIMEOUT_MS),
                )
                .await
                .map_err(|e| anyhow!("consume stats of {group} on {topic} at {addr}: {e}"))?;
            offsets.extend(
                stats
                    .offset_table
                    .into_iter()
                    .map(|(mq, o)| (mq, o.get_broker_offset(), o.get_consumer_offset())),
            );
        }
        if offsets.is_empty() {
            // The broker skips a topic it does not have, or one the group (online with other
            // subscriptions) does not subscribe to: a wrong pair must not read as "no lag".
            bail!("brokers report no queues of {topic} for group {group}");
        }
        if offsets
            .iter()
            .all(|(_, broker, consumer)| broker <= consumer)
        {
            return Ok(Lag::default());
        }
        // Only a backlog needs store times (one more call per broker).
        let spans = self
            .admin
            .query_consume_time_span(topic_cs, group_cs)
            .await
            .map_err(|e| anyhow!("consume time span of {group} on {topic}: {e}"))?;
        let now = now_epoch_ms();
        let span_of: HashMap<(String, i32), (i64, i64)> = spans
            .iter()
            .filter_map(|s| {
                let mq = s.message_queue.as_ref()?;
                Some((
                    (mq.broker_name().to_string(), mq.queue_id()),
                    (s.delay_time, s.min_time_stamp),
                ))
            })
            .collect();
        let facts: Vec<QueueLagFacts> = offsets
            .iter()
            .map(|(mq, broker_offset, consumer_offset)| {
                let (delay_ms, min_store_ms) = span_of
                    .get(&(mq.broker_name().to_string(), mq.queue_id()))
                    .copied()
                    .unwrap_or((0, 0));
                QueueLagFacts {
                    broker_offset: *broker_offset,
                    consumer_offset: *consumer_offset,
                    delay_ms,
                    min_store_ms,
                }
            })
            .collect();
        combine_lag(&facts, now).with_context(|| format!("lag of {group} on {topic}"))
    }

    /// Master addresses of the brokers serving `topic`, cached for [`LAG_ROUTE_TTL`].
    async fn topic_brokers(&self, topic: &str) -> anyhow::Result<Arc<[CheetahString]>> {
        if let Some((at, addrs)) = self.lock_brokers().get(topic) {
            if at.elapsed() < LAG_ROUTE_TTL {
                return Ok(Arc::clone(addrs));
            }
        }
        let route = self
            .admin
            .examine_topic_route_info(CheetahString::from(topic.to_owned()))
            .await
            .map_err(|e| anyhow!("route of {topic}: {e}"))?
            .ok_or_else(|| anyhow!("topic {topic} has no route"))?;
        let addrs: Arc<[CheetahString]> = route
            .broker_datas
            .iter()
            .filter_map(|b| b.broker_addrs().get(&0).cloned())
            .collect();
        if addrs.is_empty() {
            bail!("topic {topic} has no master broker");
        }
        self.lock_brokers()
            .insert(topic.to_owned(), (Instant::now(), Arc::clone(&addrs)));
        Ok(addrs)
    }

    fn lock_brokers(&self) -> std::sync::MutexGuard<'_, BrokerCache> {
        // The map holds only cache entries: a panic elsewhere cannot leave it inconsistent.
        self.brokers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// One-off lag reading. Starts and stops an admin client each time (tens of ms); anything
/// polling should keep a [`LagProbe`].
pub async fn consumer_lag(
    runtime: &MqRuntime,
    name_srv: &str,
    group: &str,
    topic: &str,
) -> anyhow::Result<Lag> {
    let probe = LagProbe::new(runtime, name_srv).await?;
    let lag = probe.lag(group, topic).await;
    probe.shutdown().await;
    lag
}

fn now_epoch_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

// ---------------------------------------------------------------------------------------------
// Topics
// ---------------------------------------------------------------------------------------------

/// How long `create_topics` waits for the name server to serve a new topic's route.
const ROUTE_WAIT: Duration = Duration::from_secs(15);

/// Creates (or updates to the same settings) each `(topic, queues)` on `broker_addr`, or on
/// every master of `cluster` when `broker_addr` is `None`, then waits until the name server
/// returns a route for each. Idempotent.
pub async fn create_topics(
    runtime: &MqRuntime,
    name_srv: &str,
    broker_addr: Option<&str>,
    cluster: &str,
    topics: &[(String, u32)],
) -> anyhow::Result<()> {
    let mut admin = start_admin(runtime, name_srv).await?;
    let result = create_topics_with(&admin, broker_addr, cluster, topics).await;
    admin.shutdown().await;
    result
}

async fn create_topics_with(
    admin: &DefaultMQAdminExt,
    broker_addr: Option<&str>,
    cluster: &str,
    topics: &[(String, u32)],
) -> anyhow::Result<()> {
    let brokers = match broker_addr {
        Some(addr) => vec![CheetahString::from(addr.to_owned())],
        None => cluster_masters(admin, cluster).await?,
    };
    for (topic, queues) in topics {
        if *queues == 0 {
            bail!("topic {topic}: queue count must be positive");
        }
        for addr in &brokers {
            let config = TopicConfig::with_queues(topic.clone(), *queues, *queues);
            admin
                .create_and_update_topic_config(addr.clone(), config)
                .await
                .map_err(|e| anyhow!("creating topic {topic} on {addr}: {e}"))?;
        }
    }
    let deadline = Instant::now() + ROUTE_WAIT;
    for (topic, _) in topics {
        loop {
            let routed = matches!(
                admin.examine_topic_route_info(CheetahString::from(topic.clone())).await,
                Ok(Some(route)) if !route.queue_datas.is_empty()
            );
            if routed {
                break;
            }
            if Instant::now() >= deadline {
                bail!("topic {topic} created but the name server serves no route after {ROUTE_WAIT:?}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    Ok(())
}

/// Addresses of the master (id 0) of every broker of `cluster`.
async fn cluster_masters(
    admin: &DefaultMQAdminExt,
    cluster: &str,
) -> anyhow::Result<Vec<CheetahString>> {
    let info = admin
        .examine_broker_cluster_info()
        .await
        .map_err(|e| anyhow!("reading cluster info: {e}"))?;
    let names = info
        .cluster_addr_table
        .as_ref()
        .and_then(|t| t.get(cluster))
        .ok_or_else(|| anyhow!("cluster {cluster} is not registered with the name server"))?;
    let table = info.broker_addr_table.as_ref();
    let masters: Vec<CheetahString> = names
        .iter()
        .filter_map(|name| table.and_then(|t| t.get(name)))
        .filter_map(|data| data.broker_addrs().get(&0).cloned())
        .collect();
    if masters.is_empty() {
        bail!("cluster {cluster} has no master broker");
    }
    Ok(masters)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(
        code: &'static str,
        condition: &'static str,
        broker_code: Option<i32>,
        client_code: Option<i32>,
    ) -> ErrorFacts<'static> {
        ErrorFacts {
            code,
            condition,
            broker_code,
            client_code,
        }
    }

    use SendErrorClass::{DefiniteFailure, Unknown};

    #[test]
    fn hung_or_dead_broker_is_unknown() {
        for code in [
            "transport.response.timeout",
            "transport.write.timeout",
            "transport.connection.failed",
            "transport.dns.failed",
            "core.operation.timed_out",
            "client.lifecycle.not_started",
            "core.internal.failure",
        ] {
            let f = facts(code, "deadline_exceeded", None, None);
            assert_eq!(classify_send_error(&f), Unknown, "{code}");
        }
    }

    #[test]
    fn missing_topic_is_definite_both_ways() {
        // Name server: no route (client code 17); broker: TOPIC_NOT_EXIST (17).
        let ns = facts("core.argument.invalid", "invalid_argument", None, Some(17));
        let br = facts("broker.operation.failed", "internal", Some(17), None);
        assert_eq!(classify_send_error(&ns), DefiniteFailure);
        assert_eq!(classify_send_error(&br), DefiniteFailure);
        let nf = facts(
            "core.argument.invalid",
            "invalid_argument",
            None,
            Some(10005),
        );
        assert_eq!(classify_send_error(&nf), DefiniteFailure);
        let route = facts("route.topic.not_found", "not_found", None, None);
        assert_eq!(classify_send_error(&route), DefiniteFailure);
    }

    #[test]
    fn bad_message_and_permission_are_definite() {
        for code in [13, 16, 29] {
            let b = facts("broker.operation.failed", "internal", Some(code), None);
            assert_eq!(classify_send_error(&b), DefiniteFailure, "broker {code}");
            let c = facts(
                "core.argument.invalid",
                "invalid_argument",
                None,
                Some(code),
            );
            assert_eq!(classify_send_error(&c), DefiniteFailure, "client {code}");
        }
        let prop = facts(
            "protocol.message.property.invalid",
            "invalid_argument",
            None,
            None,
        );
        assert_eq!(classify_send_error(&prop), DefiniteFailure);
        let big = facts("broker.message.too_large", "resource_exhausted", None, None);
        assert_eq!(classify_send_error(&big), DefiniteFailure);
        let denied = facts("auth.operation.failed", "permission_denied", None, None);
        assert_eq!(classify_send_error(&denied), DefiniteFailure);
        // A typed argument error without a wrapped client exception (e.g. a batch the
        // client refuses) is a real bad argument.
        let typed = facts("core.argument.invalid", "invalid_argument", None, None);
        assert_eq!(classify_send_error(&typed), DefiniteFailure);
    }

    #[test]
    fn transient_broker_codes_are_unknown() {
        // SYSTEM_ERROR, SYSTEM_BUSY, SERVICE_NOT_AVAILABLE, FLOW_CONTROL, RPC timeout.
        for code in [1, 2, 14, 215, -1006] {
            let f = facts("broker.operation.failed", "internal", Some(code), None);
            assert_eq!(classify_send_error(&f), Unknown, "broker {code}");
        }
    }

    #[test]
    fn generic_client_exception_is_unknown() {
        // "Send [1] times, still failed", "producer not running": code -1.
        let f = facts("core.argument.invalid", "invalid_argument", None, Some(-1));
        assert_eq!(classify_send_error(&f), Unknown);
        // 10003 "No route available" (broker gone from the route), 10001 connect, 10006 timeout.
        for code in [10001, 10002, 10003, 10006] {
            let f = facts(
                "core.argument.invalid",
                "invalid_argument",
                None,
                Some(code),
            );
            assert_eq!(classify_send_error(&f), Unknown, "client {code}");
        }
    }

    #[test]
    fn broker_code_wins_over_descriptor() {
        let f = facts("broker.topic.not_found", "not_found", Some(2), None);
        assert_eq!(classify_send_error(&f), Unknown);
    }

    #[test]
    fn real_client_errors_classify() {
        let e = ClientError::route_not_found("nope");
        assert!(matches!(
            outcome_from_error(&e),
            SendOutcome::DefiniteFailure { .. }
        ));
        let e = ClientError::broker_operation_failed("SEND", 17, "topic not exist");
        assert!(matches!(
            outcome_from_error(&e),
            SendOutcome::DefiniteFailure { .. }
        ));
        let e = ClientError::broker_operation_failed("SEND", 2, "busy");
        assert!(matches!(
            outcome_from_error(&e),
            SendOutcome::Unknown { .. }
        ));
        let e = ClientError::from(MQClientException::new_with_code(17, "No route info"));
        assert!(matches!(
            outcome_from_error(&e),
            SendOutcome::DefiniteFailure { .. }
        ));
        let e = ClientError::from(MQClientException::new("Send [1] times, still failed"));
        assert!(matches!(
            outcome_from_error(&e),
            SendOutcome::Unknown { .. }
        ));
        let e = ClientError::timeout("send", 100);
        assert!(matches!(
            outcome_from_error(&e),
            SendOutcome::Unknown { .. }
        ));
    }

    #[test]
    fn reserved_property_is_a_definite_failure() {
        let msg = OutMessage {
            topic: "t".into(),
            properties: vec![("KEYS".into(), "x".into())],
            ..Default::default()
        };
        let err = to_message(msg, true).err();
        assert!(err.is_some());
        let outcome = err.map(|e| outcome_from_error(&e));
        assert!(matches!(outcome, Some(SendOutcome::DefiniteFailure { .. })));
    }

    #[test]
    fn delivery_restores_retry_topic() {
        use rocketmq_model::common::message::MessageTrait as _;
        let mut inner = Message::builder()
            .topic("%RETRY%g")
            .body_slice(b"x")
            .tags("T")
            .keys(vec!["k1".into(), "k2".into()])
            .raw_property("message_id", "m1")
            .and_then(|b| b.build())
            .expect("message builds");
        // RETRY_TOPIC is reserved for the broker, so set it the way the broker does.
        inner.put_property(
            CheetahString::from_static_str(MessageConst::PROPERTY_RETRY_TOPIC),
            CheetahString::from_static_str("orders"),
        );
        let mut m = MessageExt::default();
        m.set_message_inner(inner);
        m.set_reconsume_times(1);
        let d = to_delivery(&m);
        assert_eq!(d.topic, "orders");
        assert_eq!(d.tags, "T");
        assert_eq!(d.keys, "k1 k2");
        assert_eq!(
            d.properties.get("message_id").map(String::as_str),
            Some("m1")
        );
        assert_eq!(d.reconsume_times, 1);
        assert_eq!(d.body, b"x");
    }

    #[test]
    fn fnv1a_matches_the_published_vectors() {
        // http://www.isthe.com/chongo/tech/comp/fnv/ test vectors: the hash is a contract.
        assert_eq!(fnv1a_64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a_64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a_64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn shard_index_is_stable_and_in_range() {
        assert_eq!(shard_index("ord_1", 0), None);
        assert_eq!(shard_index("ord_1", 1), Some(0));
        // Pinned values: a change here moves live orders to other queues.
        assert_eq!(
            shard_index("a", 4),
            Some((0xaf63_dc4c_8601_ec8c_u64 % 4) as usize)
        );
        assert_eq!(
            shard_index("foobar", 7),
            Some((0x8594_4171_f739_67e8_u64 % 7) as usize)
        );
        for n in 1..=16 {
            for i in 0..200 {
                let key = format!("ord_{i}");
                let a = shard_index(&key, n);
                assert_eq!(a, shard_index(&key, n));
                assert!(a.is_some_and(|x| x < n));
            }
        }
    }

    #[test]
    fn shard_index_spreads_keys() {
        let mut counts = [0usize; 8];
        for i in 0..8_000 {
            if let Some(q) = shard_index(&format!("01J{i:023}"), 8) {
                counts[q] += 1;
            }
        }
        // 1,000 expected per queue; a sound hash stays well inside ±20 %.
        assert!(
            counts.iter().all(|c| (800..=1200).contains(c)),
            "{counts:?}"
        );
    }

    #[test]
    fn shard_queue_ignores_the_order_of_the_route() {
        let queues: Vec<MessageQueue> = ["broker-b", "broker-a"]
            .iter()
            .flat_map(|b| (0..4).map(move |q| MessageQueue::from_parts("t", *b, q)))
            .collect();
        let mut reversed = queues.clone();
        reversed.reverse();
        for i in 0..100 {
            let key = format!("ord_{i}");
            let picked = shard_queue(&queues, &key);
            assert_eq!(picked, shard_queue(&reversed, &key));
            // Rank: broker-a 0..3, then broker-b 0..3.
            let idx = shard_index(&key, 8).unwrap_or_default();
            let expected = MessageQueue::from_parts(
                "t",
                if idx < 4 { "broker-a" } else { "broker-b" },
                (idx % 4) as i32,
            );
            assert_eq!(picked, Some(expected));
        }
        assert_eq!(shard_queue(&[], "k"), None);
    }

    fn q(broker: i64, consumer: i64, delay: i64, min_store: i64) -> QueueLagFacts {
        QueueLagFacts {
            broker_offset: broker,
            consumer_offset: consumer,
            delay_ms: delay,
            min_store_ms: min_store,
        }
    }

    #[test]
    fn caught_up_group_has_no_lag_and_no_age() {
        let lag = combine_lag(&[q(10, 10, 0, 1_000), q(0, 0, 0, 0)], 5_000).ok();
        assert_eq!(
            lag,
            Some(Lag {
                messages: 0,
                oldest_unconsumed_age_ms: None
            })
        );
        assert_eq!(combine_lag(&[], 5_000).ok(), Some(Lag::default()));
    }

    #[test]
    fn lag_sums_queues_and_takes_the_oldest_age() {
        // Queue 0: committed at 4 of 10, broker says the message at 4 is 700 ms old.
        // Queue 1: never committed, earliest message stored at 1,000 -> 4,000 ms old.
        let lag = combine_lag(
            &[q(10, 4, 700, 500), q(3, 0, 0, 1_000), q(5, 5, 0, 0)],
            5_000,
        );
        assert_eq!(
            lag.ok(),
            Some(Lag {
                messages: 9,
                oldest_unconsumed_age_ms: Some(4_000)
            })
        );
        // A consumer offset ahead of the broker's (a race between the two reads) is no lag.
        let lag = combine_lag(&[q(10, 12, 0, 0), q(10, 9, 20, 0)], 5_000);
        assert_eq!(
            lag.ok(),
            Some(Lag {
                messages: 1,
                oldest_unconsumed_age_ms: Some(20)
            })
        );
    }

    #[test]
    fn backlog_without_a_store_time_is_an_error() {
        assert!(combine_lag(&[q(3, 0, 0, 0)], 5_000).is_err());
    }
}
