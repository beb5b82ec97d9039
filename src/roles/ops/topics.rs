//! `seckill topics create`: creates the pipeline's topics with their queue counts on the
//! broker (idempotent). A consumer started before its topic exists waits ~18 s for its first
//! message, so set-up creates them explicitly.

use tracing::info;

use crate::config::Settings;

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
        plan.push((crate::config::Names::dlq_topic(&group), 1));
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
