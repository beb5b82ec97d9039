//! Consumer groups created explicitly (docs/architecture/messages.md#consumer-groups): the shipped
//! broker config turns auto-creation off (`autoCreateSubscriptionGroup = false`), so a consumer
//! whose group nobody created (a typo, a stale deployment) is refused by the broker instead of
//! silently starting a new group; `seckill topics create` creates every group of the pipeline
//! with its retry and dead-letter settings.

use anyhow::{anyhow, Context};
use cheetah_string::CheetahString;
use rocketmq_client_rust::{BrokerAdmin, ConsumerAdmin};
use rocketmq_protocol::protocol::subscription::subscription_group_config::SubscriptionGroupConfig;

use super::admin::{cluster_masters, start_admin};
use super::MqRuntime;

/// One consumer group as the broker should hold it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupSpec {
    pub name: String,
    /// Deliveries a failing message gets before it goes to `%DLQ%<group>`.
    pub retry_max_times: i32,
}

/// What the broker holds for a group, as far as this project sets it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupFacts {
    pub retry_max_times: i32,
    pub retry_queue_nums: i32,
    pub broadcast: bool,
    pub consume_enable: bool,
}

impl GroupSpec {
    fn config(&self) -> SubscriptionGroupConfig {
        let mut c = SubscriptionGroupConfig::new(CheetahString::from(self.name.clone()));
        c.set_consume_enable(true);
        // Clustering: each message to one member of the group.
        c.set_consume_broadcast_enable(false);
        c.set_consume_from_min_enable(true);
        // One retry queue: ReconsumeLater goes through %RETRY%<group>, the rest to the DLQ.
        c.set_retry_queue_nums(1);
        c.set_retry_max_times(self.retry_max_times);
        c
    }
}

/// Creates (or updates) `groups` on every broker address given, or on every master of
/// `cluster` when none is (idempotent).
pub async fn create_groups(
    runtime: &MqRuntime,
    name_srv: &str,
    brokers: &[&str],
    cluster: &str,
    groups: &[GroupSpec],
) -> anyhow::Result<()> {
    let mut admin = start_admin(runtime, name_srv).await?;
    let result = async {
        let brokers = if brokers.is_empty() {
            cluster_masters(&admin, cluster).await?
        } else {
            brokers.iter().map(|a| CheetahString::from(*a)).collect()
        };
        for group in groups {
            for addr in &brokers {
                admin
                    .create_and_update_subscription_group_config(addr.clone(), group.config())
                    .await
                    .map_err(|e| {
                        anyhow!("creating consumer group {} on {addr}: {e}", group.name)
                    })?;
            }
        }
        Ok(())
    }
    .await;
    admin.shutdown().await;
    result
}

/// Deletes `groups` and their consumer offsets from every master of `cluster`; a group that
/// does not exist is not an error.
pub async fn delete_groups(
    runtime: &MqRuntime,
    name_srv: &str,
    cluster: &str,
    groups: &[String],
) -> anyhow::Result<()> {
    let mut admin = start_admin(runtime, name_srv).await?;
    let result = async {
        for addr in cluster_masters(&admin, cluster).await? {
            let names = groups
                .iter()
                .map(|g| CheetahString::from(g.as_str()))
                .collect();
            admin
                .delete_subscription_group_list(addr.clone(), names, true)
                .await
                .map_err(|e| anyhow!("deleting consumer groups on {addr}: {e}"))?;
        }
        Ok(())
    }
    .await;
    admin.shutdown().await;
    result
}

/// The broker's record of `group` (`None`: it has none).
pub async fn group_facts(
    runtime: &MqRuntime,
    name_srv: &str,
    broker: &str,
    group: &str,
) -> anyhow::Result<Option<GroupFacts>> {
    let mut admin = start_admin(runtime, name_srv).await?;
    let read = admin
        .examine_subscription_group_config(CheetahString::from(broker), CheetahString::from(group))
        .await;
    admin.shutdown().await;
    match read {
        Ok(c) => Ok(Some(GroupFacts {
            retry_max_times: c.retry_max_times(),
            retry_queue_nums: c.retry_queue_nums(),
            broadcast: c.consume_broadcast_enable(),
            consume_enable: c.consume_enable(),
        })),
        // SUBSCRIPTION_GROUP_NOT_EXIST.
        Err(e) if super::classify::response_code(&e) == Some(26) => Ok(None),
        Err(e) => Err(anyhow!("{e}")).with_context(|| format!("reading group {group} on {broker}")),
    }
}

/// One key of a broker's running configuration (`None`: the broker does not report it).
pub async fn broker_config_value(
    runtime: &MqRuntime,
    name_srv: &str,
    broker: &str,
    key: &str,
) -> anyhow::Result<Option<String>> {
    let mut admin = start_admin(runtime, name_srv).await?;
    let read = admin.get_broker_config(CheetahString::from(broker)).await;
    admin.shutdown().await;
    let config = read.map_err(|e| anyhow!("reading {broker}'s configuration: {e}"))?;
    Ok(config
        .iter()
        .find(|(k, _)| k.as_str() == key)
        .map(|(_, v)| v.to_string()))
}
