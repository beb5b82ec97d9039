//! The producer: sends one message or a batch and routes keyed messages to one queue per
//! key; every error is classified by `classify`.

use anyhow::anyhow;
use rocketmq_client_rust::{ClientError, ClientResult, DefaultMQProducer, SendResult, SendStatus};
use rocketmq_model::common::message::message_single::Message;

use crate::mq::{OutMessage, Publisher, SendOutcome};

use super::classify::outcome_from_error;
use super::*;

// Producer

/// Settings of a [`RocketProducer`].
#[derive(Debug, Clone)]
pub struct ProducerOptions {
    pub name_srv: String,
    pub group: String,
    /// Default bound of a send (each call of the trait passes its own).
    pub send_timeout_ms: u64,
    /// Client-side retries of a failed attempt. The client (1.0.0, `RetryPolicy`) retries a
    /// send only when it was refused by a response code (busy, not writable, no service) or
    /// failed before the request was written, never after: a retry is not a second copy the
    /// caller does not know about. A timeout stays UNKNOWN for the caller's own retry.
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
    pub(super) producer: DefaultMQProducer,
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
pub(super) fn to_message(msg: OutMessage, with_delay: bool) -> Result<Message, ClientError> {
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

pub(super) fn outcome_from_result(result: ClientResult<Option<SendResult>>) -> SendOutcome {
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
    pub(super) async fn send_unsharded_batch(
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
pub(super) fn batch_outcomes(r: SendResult, n: usize) -> Vec<SendOutcome> {
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

// Ordered (sharded) sends
//
// A message with `sharding_key: Some(k)` goes to the queue `shard_index(k, n)` of the topic's
// n writable queues (ranked by broker name, then queue id), taken from the producer's cached
// route: the same list every send of the process uses. Sends of one key never overlap inside
// a call, and after a message of a key is not confirmed, the later messages of that key in the
// same call are not sent (they come back UNKNOWN, "not sent"): the caller's retry of the
// failed one would otherwise land behind them. Ordering holds while the topic's queue count
// is stable; changing it moves keys to other queues.

/// Fault injection (`--features failpoints`): `mq-send-outcome=return(<message_id>:<mode>)`
/// decides the outcome of single sends of that message. `lost`: not sent, UNKNOWN (the request
/// never reached the broker); `stored-unanswered`: sent and stored, yet UNKNOWN (the answer
/// was lost); `refused`: not sent, DEFINITE_FAILURE.
#[cfg(feature = "failpoints")]
fn forced_outcome(msg: &OutMessage) -> Option<String> {
    let arg = fail::eval("mq-send-outcome", |arg| arg).flatten()?;
    let (id, mode) = arg.rsplit_once(':')?;
    msg.properties
        .iter()
        .any(|(k, v)| k == "message_id" && v == id)
        .then(|| mode.to_owned())
}

#[async_trait::async_trait]
impl Publisher for RocketProducer {
    async fn send(&self, msg: OutMessage, timeout_ms: u64) -> SendOutcome {
        #[cfg(feature = "failpoints")]
        if let Some(mode) = forced_outcome(&msg) {
            let error = format!("injected: {mode}");
            return match mode.as_str() {
                "lost" => SendOutcome::Unknown { error },
                "refused" => SendOutcome::DefiniteFailure { error },
                _ => match self.send_one(msg, timeout_ms).await {
                    SendOutcome::Confirmed { .. } => SendOutcome::Unknown { error },
                    other => other,
                },
            };
        }
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

#[cfg(test)]
mod tests {
    use super::*;
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
}
