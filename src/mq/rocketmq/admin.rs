//! The admin side of the broker: a consumer group's lag on a topic, and topic creation.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _};
use cheetah_string::CheetahString;
use rocketmq_client_rust::{
    BrokerAdmin, ConsumerAdmin, DefaultMQAdminExt, OffsetAdmin, RouteAdmin, TopicAdmin,
};
use rocketmq_model::common::message::message_queue::MessageQueue;
use rocketmq_model::topic::TopicConfig;

use super::*;

// Consumer lag

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

/// One queue's offsets as a broker reports them for a group.
struct QueueOffsets {
    queue: MessageQueue,
    /// The broker's max offset.
    broker: i64,
    /// The group's committed offset.
    consumer: i64,
    /// Store time of the last message the group took there (0 when none).
    last_taken_ms: i64,
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
pub(super) async fn start_admin(
    runtime: &MqRuntime,
    name_srv: &str,
) -> anyhow::Result<DefaultMQAdminExt> {
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

    /// The time before which `group` has taken every message of `topic` stored on the brokers
    /// that answer: per queue with a backlog, the store time of the last message it took (the
    /// next one was stored after it); now when every answering queue is caught up. Brokers
    /// that do not answer (dead, unreachable) are left out; an error only when none answers.
    /// Built on the committed offsets, so it trails the consumers by their commit interval.
    pub async fn taken_until_ms(&self, group: &str, topic: &str) -> anyhow::Result<i64> {
        let brokers = self.topic_brokers(topic).await?;
        let (mut answered, mut until) = (0usize, now_epoch_ms());
        let mut errors = Vec::new();
        for addr in brokers.iter() {
            match self.queue_offsets(group, topic, addr).await {
                // A broker that reports no queue of the topic for the group (it does not
                // know the group, e.g. no consumer ever committed there) says nothing.
                Ok(queues) if queues.is_empty() => {
                    errors.push(format!("{addr}: no queues of the topic for the group"));
                }
                Ok(queues) => {
                    answered += 1;
                    for q in queues.iter().filter(|q| q.broker > q.consumer) {
                        // 0: nothing taken yet on that queue, so nothing is known taken.
                        until = until.min(q.last_taken_ms.max(0));
                    }
                }
                Err(e) => errors.push(format!("{addr}: {e}")),
            }
        }
        if answered == 0 {
            // The route may name a broker that moved: look it up again next time.
            self.lock_brokers().remove(topic);
            bail!(
                "no broker answered for {group} on {topic}: {}",
                errors.join("; ")
            );
        }
        Ok(until)
    }

    /// `group`'s offsets on each queue of `topic` at one broker, bounded by
    /// [`LAG_RPC_TIMEOUT_MS`].
    async fn queue_offsets(
        &self,
        group: &str,
        topic: &str,
        addr: &CheetahString,
    ) -> anyhow::Result<Vec<QueueOffsets>> {
        let stats = self
            .admin
            .examine_consume_stats(
                CheetahString::from(group.to_owned()),
                Some(CheetahString::from(topic.to_owned())),
                None,
                Some(addr.clone()),
                Some(LAG_RPC_TIMEOUT_MS),
            )
            .await
            .map_err(|e| anyhow!("consume stats of {group} on {topic} at {addr}: {e}"))?;
        Ok(stats
            .offset_table
            .into_iter()
            .map(|(queue, o)| QueueOffsets {
                queue,
                broker: o.get_broker_offset(),
                consumer: o.get_consumer_offset(),
                last_taken_ms: o.get_last_timestamp(),
            })
            .collect())
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
            let queues = self.queue_offsets(group, topic, addr).await?;
            offsets.extend(queues.into_iter().map(|q| (q.queue, q.broker, q.consumer)));
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

    /// A broker's runtime table (`getBrokerRuntimeInfo`), as text.
    pub(super) async fn runtime_table(
        &self,
        addr: &CheetahString,
    ) -> anyhow::Result<HashMap<String, String>> {
        let call = self.admin.fetch_broker_runtime_stats(addr.clone());
        let table = tokio::time::timeout(Duration::from_millis(LAG_RPC_TIMEOUT_MS), call)
            .await
            .map_err(|_| anyhow!("runtime stats of {addr}: no answer in {LAG_RPC_TIMEOUT_MS} ms"))?
            .map_err(|e| anyhow!("runtime stats of {addr}: {e}"))?;
        Ok(table
            .table
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect())
    }

    /// Master addresses of the brokers serving `topic`, cached for [`LAG_ROUTE_TTL`].
    pub(super) async fn topic_brokers(&self, topic: &str) -> anyhow::Result<Arc<[CheetahString]>> {
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

fn now_epoch_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

// Topics

/// How long `create_topics` waits for the name server to serve a new topic's route: a name
/// server restarted a moment ago learns the routes at the broker's next registration (every
/// 10 s at the broker's floor; one more period when the first attempt met a dead connection).
const ROUTE_WAIT: Duration = Duration::from_secs(30);

/// Times a topic's creation is asked of one broker before it is an error.
const TOPIC_ATTEMPTS: u32 = 3;

/// Creates (or updates to the same settings) each `(topic, queues)` on each of `brokers`, or on
/// every master of `cluster` when `brokers` is empty, then waits until the name server returns
/// a route through each of them. Idempotent.
pub async fn create_topics(
    runtime: &MqRuntime,
    name_srv: &str,
    brokers: &[&str],
    cluster: &str,
    topics: &[(String, u32)],
) -> anyhow::Result<()> {
    let mut admin = start_admin(runtime, name_srv).await?;
    let result = create_topics_with(&admin, brokers, cluster, topics).await;
    admin.shutdown().await;
    result
}

/// Deletes each topic from every broker of `cluster` and from the name server (what is
/// stored in them is gone). A topic that does not exist is not an error.
pub async fn delete_topics(
    runtime: &MqRuntime,
    name_srv: &str,
    cluster: &str,
    topics: &[String],
) -> anyhow::Result<()> {
    let admin = start_admin(runtime, name_srv).await?;
    let mut result = Ok(());
    for topic in topics {
        if let Err(e) = admin
            .delete_topic(
                CheetahString::from(topic.clone()),
                CheetahString::from(cluster.to_owned()),
            )
            .await
        {
            result = Err(anyhow!("deleting topic {topic}: {e}"));
            break;
        }
    }
    let mut admin = admin;
    admin.shutdown().await;
    result
}

async fn create_topics_with(
    admin: &DefaultMQAdminExt,
    brokers: &[&str],
    cluster: &str,
    topics: &[(String, u32)],
) -> anyhow::Result<()> {
    let brokers = if brokers.is_empty() {
        cluster_masters(admin, cluster).await?
    } else {
        brokers
            .iter()
            .map(|a| CheetahString::from((*a).to_owned()))
            .collect()
    };
    for (topic, configured) in topics {
        if *configured == 0 {
            bail!("topic {topic}: queue count must be positive");
        }
        // Raised, never lowered: the queues above a lower count would keep their messages
        // where no consumer reads them.
        let existing = existing_queues(admin, topic).await?;
        let queues = (*configured).max(existing);
        if existing > *configured {
            tracing::info!(topic = %topic, existing, configured = *configured,
                           "topic keeps its queues: fewer would strand what they hold");
        }
        for addr in &brokers {
            // Idempotent, so a broker that answered too late (busy flushing, a loaded host)
            // is asked again, three times in all.
            let mut attempt = 1;
            loop {
                let config = TopicConfig::with_queues(topic.clone(), queues, queues);
                match admin
                    .create_and_update_topic_config(addr.clone(), config)
                    .await
                {
                    Ok(_) => break,
                    Err(e) if attempt < TOPIC_ATTEMPTS => {
                        tracing::warn!(topic = %topic, broker = %addr, attempt, error = %e,
                                       "creating a topic failed; asking again");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        attempt += 1;
                    }
                    Err(e) => bail!("creating topic {topic} on {addr}: {e} ({attempt} attempts)"),
                }
            }
        }
    }
    let deadline = Instant::now() + ROUTE_WAIT;
    for (topic, _) in topics {
        loop {
            // Routed through every broker it was created on, so the first sends spread.
            let routed = matches!(
                admin.examine_topic_route_info(CheetahString::from(topic.clone())).await,
                Ok(Some(route)) if route.queue_datas.len() >= brokers.len()
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

/// The most queues `topic` has on any broker of the name server's route (0: no such topic).
pub async fn topic_queues(runtime: &MqRuntime, name_srv: &str, topic: &str) -> anyhow::Result<u32> {
    let mut admin = start_admin(runtime, name_srv).await?;
    let result = existing_queues(&admin, topic).await;
    admin.shutdown().await;
    result
}

/// The most queues `topic` has on any broker (0 when the name server has no route for it);
/// an error when the name server cannot say.
async fn existing_queues(admin: &DefaultMQAdminExt, topic: &str) -> anyhow::Result<u32> {
    match admin
        .examine_topic_route_info(CheetahString::from(topic.to_owned()))
        .await
    {
        Ok(route) => Ok(route.map_or(0, |r| {
            r.queue_datas
                .iter()
                .map(|q| q.read_queue_nums.max(q.write_queue_nums))
                .max()
                .unwrap_or(0)
        })),
        // The name server's "no route": the topic does not exist yet.
        Err(e) if super::classify::response_code(&e) == Some(17) => Ok(0),
        Err(e) => bail!("reading the queues topic {topic} has now: {e}"),
    }
}

/// Addresses of the master (id 0) of every broker of `cluster`.
pub(super) async fn cluster_masters(
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
