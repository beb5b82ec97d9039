//! `seckill topics create`: creates the pipeline's topics with their queue counts, and its
//! consumer groups with their retry and dead-letter settings, on the broker (idempotent). A
//! consumer started before its topic exists waits ~18 s for its first message, and the shipped
//! broker config creates no group by itself (docs/architecture/messages.md#consumer-groups), so
//! set-up creates both explicitly. `seckill topics delete --confirm <env>` removes a scratch
//! environment's topics and groups.

use tracing::info;

use crate::config::Settings;
use crate::mq::GroupSpec;

/// `(topic, queues)` of every topic the pipeline uses.
pub fn topic_plan(settings: &Settings) -> Vec<(String, u32)> {
    let n = settings.names();
    let mut plan = vec![
        (
            n.order_create_topic.clone(),
            settings.mq.order_create_queues,
        ),
        (n.order_timeout_topic.clone(), settings.mq.other_queues),
        (n.order_event_topic.clone(), settings.mq.other_queues),
        (n.compensate_topic.clone(), settings.mq.other_queues),
    ];
    // Dead-letter topics exist (readable) before the first message dies, so the DLQ intake
    // can subscribe at start-up; the broker would otherwise create them write-only.
    for (group, _) in n.dead_letter_sources() {
        plan.push((crate::mq::Names::dlq_topic(&group), 1));
    }
    plan
}

/// Every consumer group the pipeline runs: the five source groups (the audit stream's among
/// them) and the group that takes each one's dead letters in, each retried
/// `consumer.max_reconsume_times` times before its dead letter (`%DLQ%<group>`), and the group
/// replays read source topics through.
pub fn group_plan(settings: &Settings) -> Vec<GroupSpec> {
    let n = settings.names();
    let spec = |name: String| GroupSpec {
        name,
        retry_max_times: settings.consumer.max_reconsume_times,
    };
    let mut plan = Vec::new();
    for (group, _) in n.dead_letter_sources() {
        plan.push(spec(n.dlq_intake_group_of(&group)));
        plan.push(spec(group));
    }
    plan.push(spec(n.replay_group.clone()));
    plan.sort_by(|a, b| a.name.cmp(&b.name));
    plan
}

/// A consumer group of a tool (a bench's or a test's collector), retried like the roles' own.
pub fn tool_group(settings: &Settings, name: &str) -> GroupSpec {
    GroupSpec {
        name: name.to_string(),
        retry_max_times: settings.consumer.max_reconsume_times,
    }
}

/// Creates the topics of [`topic_plan`], then the groups of [`group_plan`].
pub async fn create_all(
    settings: &Settings,
) -> anyhow::Result<(Vec<(String, u32)>, Vec<GroupSpec>)> {
    let topics = topic_plan(settings);
    crate::mq::create_topics(settings, &topics).await?;
    let groups = group_plan(settings);
    crate::mq::create_groups(settings, &groups).await?;
    Ok((topics, groups))
}

pub async fn run(settings: Settings) -> anyhow::Result<()> {
    let (topics, groups) = create_all(&settings).await?;
    for (topic, queues) in &topics {
        info!(%topic, queues, "topic ready");
        println!("topic {topic}: {queues} queues");
    }
    for g in &groups {
        info!(group = %g.name, retry_max_times = g.retry_max_times, "consumer group ready");
        println!(
            "group {}: {} deliveries, then %DLQ%{}",
            g.name, g.retry_max_times, g.name
        );
    }
    Ok(())
}

/// Every topic of this environment: the plan's, and the consumer groups' retry topics.
pub fn environment_topics(settings: &Settings) -> Vec<String> {
    let n = settings.names();
    let mut topics: Vec<String> = topic_plan(settings).into_iter().map(|(t, _)| t).collect();
    // The retry topics the broker made for every group of the environment: its own groups
    // and the groups that take their dead letters in.
    for (group, _) in n.dead_letter_sources() {
        topics.push(crate::mq::lag::retry_topic(&group));
        topics.push(crate::mq::lag::retry_topic(&n.dlq_intake_group_of(&group)));
    }
    topics
}

/// `seckill topics delete --confirm <env>`: refuses unless `confirm` repeats the environment's
/// name, and never deletes `PROD`'s.
pub async fn delete(settings: Settings, confirm: &str) -> anyhow::Result<bool> {
    if confirm != settings.env {
        eprintln!(
            "refused: --confirm must repeat this environment's name ({})",
            settings.env
        );
        return Ok(false);
    }
    if settings.env == "PROD" {
        eprintln!("refused: the PROD environment's topics are never deleted by this command");
        return Ok(false);
    }
    let topics = environment_topics(&settings);
    crate::mq::delete_topics(&settings, &topics).await?;
    for topic in &topics {
        info!(%topic, "topic deleted");
        println!("topic {topic}: deleted");
    }
    let groups: Vec<String> = group_plan(&settings).into_iter().map(|g| g.name).collect();
    crate::mq::delete_groups(&settings, &groups).await?;
    for group in &groups {
        info!(%group, "consumer group deleted");
        println!("group {group}: deleted");
    }
    Ok(true)
}
