//! Reading a time window of a topic as the broker stored it, through a consumer group of its
//! own (`seckill dlq replay --from-source`, docs/architecture/recovery.md#dead-letters): a pull
//! consumer that starts each queue at the window's first offset (the broker's index by store
//! time) and reads up to the window's end or the queue's end, committing nothing, so the live
//! groups' offsets are never touched.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{anyhow, bail};
use rocketmq_client_rust::prelude::DefaultLitePullConsumer;
use rocketmq_client_rust::DefaultLitePullConsumerBuilder;
use rocketmq_model::common::message::message_queue::MessageQueue;

use super::consumer::to_delivery;
use super::MqRuntime;
use crate::mq::Delivery;

/// How long one poll waits for messages.
const POLL_MS: u64 = 500;

/// What [`read_window`] read.
#[derive(Debug, Default)]
pub struct Window {
    /// Stored within the window, oldest first per queue.
    pub messages: Vec<Delivery>,
    /// Stored within the window but past `max` (not returned).
    pub left_out: usize,
    /// Queues read.
    pub queues: usize,
}

/// Every message of `topic` the broker stored in `[since_ms, until_ms)`, read through
/// `group` within `deadline`; at most `max` are returned (the rest counted in `left_out`).
pub async fn read_window(
    runtime: &MqRuntime,
    name_srv: &str,
    group: &str,
    topic: &str,
    (since_ms, until_ms): (i64, i64),
    max: usize,
    deadline: Duration,
) -> anyhow::Result<Window> {
    let consumer = DefaultLitePullConsumerBuilder::new(runtime.client_runtime())
        .consumer_group(group.to_owned())
        .name_server_addr(name_srv.to_owned())
        .auto_commit(false)
        .pull_batch_size(32)
        // A pull of a queue read to its end waits this long on the broker for more (20 s by
        // default), and stopping the consumer waits for it.
        .broker_suspend_max_time_millis(500)
        .consumer_timeout_millis_when_suspend(1_500)
        .build()
        .map_err(|e| anyhow!("building the pull consumer of {group}: {e}"))?;
    consumer
        .start()
        .await
        .map_err(|e| anyhow!("starting the pull consumer of {group}: {e}"))?;
    let read = tokio::time::timeout(
        deadline,
        read_queues(&consumer, topic, (since_ms, until_ms), max),
    )
    .await
    .unwrap_or_else(|_| bail!("reading {topic} took longer than {deadline:?}"));
    consumer.shutdown().await;
    read
}

/// Each queue from the first offset stored at or after the window's start to the last one
/// stored before its end (or the queue's end as found when the read began).
async fn read_queues(
    consumer: &DefaultLitePullConsumer,
    topic: &str,
    (since_ms, until_ms): (i64, i64),
    max: usize,
) -> anyhow::Result<Window> {
    let queues = consumer
        .fetch_message_queues(topic)
        .await
        .map_err(|e| anyhow!("queues of {topic}: {e}"))?;
    let mut out = Window {
        queues: queues.len(),
        ..Window::default()
    };
    // (broker, queue id) -> the offset the read stops before, and the queue.
    let mut open: HashMap<(String, i32), (i64, MessageQueue)> = HashMap::new();
    let mut starts = Vec::new();
    for mq in &queues {
        let err = |what: &str, e: rocketmq_client_rust::ClientError| anyhow!("{what} of {mq}: {e}");
        let end = consumer
            .max_offset(mq)
            .await
            .map_err(|e| err("max offset", e))?;
        let start = consumer
            .offset_for_timestamp(mq, since_ms.max(0) as u64)
            .await
            .map_err(|e| err("offset by time", e))?;
        if start < end {
            open.insert(queue_key(mq), (end, mq.clone()));
            starts.push((mq.clone(), start));
        }
    }
    if open.is_empty() {
        return Ok(out);
    }
    consumer
        .assign(starts.iter().map(|(mq, _)| mq.clone()).collect())
        .await
        .map_err(|e| anyhow!("assigning the queues of {topic}: {e}"))?;
    for (mq, start) in &starts {
        consumer
            .seek(mq, *start)
            .await
            .map_err(|e| anyhow!("seeking {mq} to {start}: {e}"))?;
    }
    while !open.is_empty() {
        for m in consumer.poll_with_timeout(POLL_MS).await {
            let key = (m.broker_name().to_string(), m.queue_id());
            let Some(&(end, _)) = open.get(&key) else {
                continue;
            };
            let (offset, stored) = (m.queue_offset(), m.store_timestamp());
            if offset >= end || stored >= until_ms {
                close(consumer, &mut open, &key).await;
                continue;
            }
            if stored >= since_ms {
                if out.messages.len() < max {
                    out.messages.push(to_delivery(&m));
                } else {
                    out.left_out += 1;
                }
            }
            if offset + 1 >= end {
                close(consumer, &mut open, &key).await;
            }
        }
    }
    Ok(out)
}

/// The queue `key` is read: no more pulls of it.
async fn close(
    consumer: &DefaultLitePullConsumer,
    open: &mut HashMap<(String, i32), (i64, MessageQueue)>,
    key: &(String, i32),
) {
    if let Some((_, mq)) = open.remove(key) {
        consumer.pause(vec![mq]).await;
    }
}

fn queue_key(mq: &MessageQueue) -> (String, i32) {
    (mq.broker_name().to_string(), mq.queue_id())
}
