//! `seckill topics create`: creates the pipeline's topics with their queue counts on the
//! broker (idempotent). A consumer started before its topic exists waits ~18 s for its first
//! message, so set-up creates them explicitly. `seckill topics delete --confirm <env>` removes a
//! scratch environment's topics.

use tracing::info;

use crate::config::Settings;

/// `(topic, queues)` of every topic the pipeline uses.
pub fn topic_plan(settings: &Settings) -> Vec<(String, u32)> {
    let n = crate::mq::Names::of(settings);
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

pub async fn run(settings: Settings) -> anyhow::Result<()> {
    let plan = topic_plan(&settings);
    crate::mq::create_topics(&settings, &plan).await?;
    for (topic, queues) in &plan {
        info!(%topic, queues, "topic ready");
        println!("topic {topic}: {queues} queues");
    }
    Ok(())
}

/// Every topic of this environment: the plan's, and the consumer groups' retry topics.
pub fn environment_topics(settings: &Settings) -> Vec<String> {
    let n = crate::mq::Names::of(settings);
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
    Ok(true)
}
