//! The push consumer: the client's synchronous listener bridged to an async
//! [`crate::mq::BatchHandler`], with bounded in-flight work and a graceful shutdown.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, Context as _};
use rocketmq_client_rust::{
    ClientConfig, ClientResult, ConsumeConcurrentlyContext, ConsumeConcurrentlyStatus,
    DefaultMQPushConsumer, MQPushConsumer, MessageListenerConcurrently,
};
use rocketmq_model::common::consumer::consume_from_where::ConsumeFromWhere;
use rocketmq_model::common::message::message_ext::MessageExt;
use rocketmq_model::common::message::MessageConst;
use tokio::sync::Notify;

use crate::mq::{ConsumeDecision, Delivery, Properties, SharedHandler};

use super::runtime::SlotReservation;
use super::*;

// Push consumer

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
    /// The topic's short name for metrics (`crate::mq::topic_label`).
    label: &'static str,
}

/// A message whose delivery fails for this many times in a row is counted
/// (`mq_consume_repeated_failure_total`): stuck work shows up within minutes, long before the
/// broker gives up on it (`consumer.max_reconsume_times`, hours on the standard schedule).
pub const REPEATED_FAILURE_AFTER: i32 = 3;

impl MessageListenerConcurrently for BridgeListener {
    fn consume_message(
        &self,
        msgs: &[&MessageExt],
        _context: &ConsumeConcurrentlyContext,
    ) -> ClientResult<ConsumeConcurrentlyStatus> {
        let _guard = self.in_flight.enter();
        let batch: Vec<Delivery> = msgs.iter().map(|m| to_delivery(m)).collect();
        let attempts: Vec<i32> = batch.iter().map(|d| d.reconsume_times).collect();
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
            ConsumeDecision::Retry => {
                // This delivery failed: the (reconsume_times + 1)-th failure in a row.
                let repeated = attempts
                    .iter()
                    .filter(|&&a| a + 1 >= REPEATED_FAILURE_AFTER)
                    .count();
                if repeated > 0 {
                    metrics::counter!("mq_consume_repeated_failure_total", "topic" => self.label)
                        .increment(repeated as u64);
                }
                ConsumeConcurrentlyStatus::ReconsumeLater
            }
        })
    }
}

/// A delivery as the handlers see it, from the client's message (shared by every intake).
pub fn to_delivery(m: &MessageExt) -> Delivery {
    // The client's strings, shared (crate::mq::Properties): no key or value copied.
    let properties: Properties = m
        .properties()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let raw_topic = m.topic().as_str();
    // The client already restores the original topic of retried messages; this covers any
    // path that does not.
    let topic = match properties.get(MessageConst::PROPERTY_RETRY_TOPIC) {
        Some(original) if raw_topic.starts_with(RETRY_TOPIC_PREFIX) => original.to_owned(),
        _ => raw_topic.to_owned(),
    };
    let text = |key: &str| properties.get(key).unwrap_or_default().to_owned();
    Delivery {
        topic,
        tags: text(MessageConst::PROPERTY_TAGS),
        keys: text(MessageConst::PROPERTY_KEYS),
        body: m.body().map(|b| b.to_vec()).unwrap_or_default(),
        reconsume_times: m.reconsume_times(),
        queue_id: m.queue_id(),
        queue_offset: m.queue_offset(),
        store_timestamp_ms: m.store_timestamp(),
        broker_msg_id: m.msg_id().to_string(),
        broker_name: m.broker_name().to_string(),
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
        label: crate::mq::topic_label(topic),
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

#[cfg(test)]
mod tests {
    use super::*;
    use cheetah_string::CheetahString;
    use rocketmq_model::common::message::message_single::Message;

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
        assert_eq!(d.properties.get("message_id"), Some("m1"));
        assert_eq!(d.reconsume_times, 1);
        assert_eq!(d.body, b"x");
    }
}
