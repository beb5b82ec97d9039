//! Keyed sends: a message with a sharding key goes to the one queue its key picks, so one key's
//! messages are stored in send order; messages for one queue go as one broker batch.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use cheetah_string::CheetahString;
use rocketmq_client_rust::{ClientError, MQClientException};
use rocketmq_model::common::message::message_queue::MessageQueue;
use rocketmq_model::common::message::message_single::Message;

use crate::mq::{OutMessage, SendOutcome};

use super::classify::outcome_from_error;
use super::producer::{batch_outcomes, outcome_from_result, to_message, RocketProducer};

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

/// A sharded send sorted before anything goes out.
struct ShardedPlan {
    /// Outcomes known before sending (unroutable messages and their streams' later ones).
    outcomes: Vec<Option<SendOutcome>>,
    /// The keyless messages and their places in the call.
    keyless_index: Vec<usize>,
    keyless: Vec<OutMessage>,
    /// Keyed messages by queue, in call order within each.
    groups: Vec<(MessageQueue, Vec<Routed>)>,
}

impl RocketProducer {
    /// Sends messages of which at least one has a sharding key; one outcome per message, in
    /// order. Keyless messages take the unsharded path at the same time. Keyed messages are
    /// grouped by their queue: a group of two or more undelayed messages is one broker batch
    /// (stored at consecutive offsets, so in call order), anything else goes one by one in
    /// call order. Groups (distinct queues) are sent concurrently.
    pub(super) async fn send_sharded(
        &self,
        msgs: Vec<OutMessage>,
        timeout_ms: u64,
    ) -> Vec<SendOutcome> {
        let deadline = Instant::now() + Duration::from_millis(timeout_ms);
        let ShardedPlan {
            mut outcomes,
            keyless_index,
            keyless,
            groups,
        } = self.plan_sharded(msgs, deadline).await;
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

    /// Sorts messages with a sharding key by their queue, and sets aside the keyless ones; a
    /// message that cannot be routed gets its outcome here, and so does every later message of
    /// its stream (it must not overtake the one that failed).
    async fn plan_sharded(&self, msgs: Vec<OutMessage>, deadline: Instant) -> ShardedPlan {
        let mut outcomes: Vec<Option<SendOutcome>> = vec![None; msgs.len()];
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
        ShardedPlan {
            outcomes,
            keyless_index,
            keyless,
            groups,
        }
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

#[cfg(test)]
mod tests {
    use super::*;
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
}
