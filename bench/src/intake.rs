//! `seckill-bench intake`: what the RocketMQ client costs per message on the order consumer's
//! intake, measured with a handler that does nothing, on the two intakes the client offers:
//!
//! - **push**: the consumer as `seckill consume` runs it (`mq::start_consumer`: the client's
//!   synchronous listener on its blocking lane, the handler on the app runtime, a channel back);
//! - **pull**: the client's lite pull consumer polled from the app runtime, each polled batch
//!   handed to the handler in a task of its own (at most `consumer.listener_calls` at once),
//!   the offsets committed at the end.
//!
//! The same messages (order-create messages as the API sends them, on a topic with
//! `mq.order_create_queues` queues), the same decoding (`to_delivery`) and the same handler;
//! the rounds alternate push and pull, each with a fresh consumer group reading the topic from
//! its first offset. CPU per message, from `/proc`, of this process and of each `--cpu`
//! target (the broker), between the first message handled and the last: start-up left out.
//! The topic and the groups it creates are deleted at the end, also when interrupted;
//! `--delete NAME...` deletes what a killed run left.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context as _};
use chrono::Utc;
use clap::{Args, ValueEnum};
use rocketmq_client_rust::DefaultLitePullConsumer;
use rocketmq_model::common::consumer::consume_from_where::ConsumeFromWhere;
use rocketmq_model::common::message::message_queue::MessageQueue;
use seckill::config::Settings;
use seckill::domain::{
    OrderCreateRequested, TraceContext, EVENT_ORDER_CREATE_REQUESTED, SCHEMA_VERSION,
};
use seckill::mq::{BatchHandler, ConsumeDecision, Delivery, SharedHandler};
use tokio::sync::{Notify, Semaphore};

use crate::cpu::{cpu_between, cpu_snapshot, parse_cpu_target, CpuSnapshot, CpuTarget};

#[derive(Debug, Clone, Args)]
pub struct IntakeArgs {
    /// Messages on the topic; each round drains them all.
    #[arg(long, default_value_t = 30_000)]
    pub messages: usize,
    /// Rounds; each runs every intake of `--intakes` once, in turn.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// The intakes measured, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "push,pull")]
    pub intakes: Vec<Intake>,
    /// Other processes whose CPU per message is reported: `name=pid[+pid...]`, e.g.
    /// `--cpu broker=$(pgrep -d+ -f rocketmq-broker-rust)` (reported as `broker_us_per_msg`).
    #[arg(long = "cpu", value_parser = parse_cpu_target)]
    pub cpu: Vec<CpuTarget>,
    /// Measure nothing: delete these topics and consumer groups (with their retry and
    /// dead-letter topics), what a killed run left.
    #[arg(long, num_args = 1..)]
    pub delete: Vec<String>,
}

/// One of the client's two intakes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Intake {
    Push,
    Pull,
}

impl Intake {
    fn name(self) -> &'static str {
        match self {
            Intake::Push => "push",
            Intake::Pull => "pull",
        }
    }
}

/// Counts what it is handed and ACKs it; wakes the drain once `target` messages came.
struct Count {
    seen: AtomicUsize,
    target: usize,
    done: Notify,
}

#[async_trait::async_trait]
impl BatchHandler for Count {
    async fn handle(&self, batch: Vec<Delivery>) -> ConsumeDecision {
        let n = batch.len();
        if self.seen.fetch_add(n, Ordering::AcqRel) + n >= self.target {
            self.done.notify_one();
        }
        ConsumeDecision::Ack
    }
}

fn event(i: usize) -> OrderCreateRequested {
    let now = Utc::now();
    let id = |prefix: &str| format!("{prefix}_{:026}", i);
    OrderCreateRequested {
        schema_version: SCHEMA_VERSION,
        event_type: EVENT_ORDER_CREATE_REQUESTED.into(),
        message_id: id("evt"),
        message_key: id("rsv"),
        request_id: id("req"),
        reservation_id: id("rsv"),
        order_id: id("ord"),
        activity_id: 1,
        sku_id: 1,
        user_id: i as i64 + 1,
        quantity: 1,
        reservation_created_at: now,
        reservation_valid_until: now + chrono::Duration::minutes(15),
        created_at: now,
        retry_count: 0,
        replay_count: 0,
        producer: "intake-cost".into(),
        trace: TraceContext {
            trace_id: "0af7651916cd43dd8448eb211c80319c".into(),
            span_id: "b7ad6b7169203331".into(),
            traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
        },
        channel: None,
    }
}

async fn fill(settings: &Settings, topic: &str, messages: usize) -> anyhow::Result<()> {
    let publisher = seckill::mq::connect_publisher(settings).await?;
    let events: Vec<usize> = (0..messages).collect();
    for chunk in events.chunks(32) {
        let batch = chunk
            .iter()
            .map(|&i| seckill::mq::order_create_message(topic, &event(i)))
            .collect();
        let outcomes = publisher.send_batch(batch, 3_000).await;
        if let Some(bad) = outcomes.iter().find(|o| o.label() != "confirmed") {
            return Err(anyhow!("filling {topic}: {bad:?}"));
        }
    }
    Ok(())
}

async fn drain_push(
    settings: &Settings,
    group: &str,
    topic: &str,
    count: Arc<Count>,
) -> anyhow::Result<()> {
    let handler: SharedHandler = count.clone();
    let consumer = seckill::mq::start_consumer(
        settings,
        group,
        topic,
        handler,
        settings.consumer.listener_calls,
        settings.consumer.batch_size,
    )
    .await?;
    count.done.notified().await;
    consumer.shutdown().await;
    Ok(())
}

async fn drain_pull(
    settings: &Settings,
    group: &str,
    topic: &str,
    count: Arc<Count>,
) -> anyhow::Result<()> {
    let rt = seckill::mq::runtime()?;
    let consumer = DefaultLitePullConsumer::builder(rt.client_runtime())
        .name_server_addr(settings.mq.name_server_list())
        .consumer_group(group.to_owned())
        .consume_from_where(ConsumeFromWhere::ConsumeFromFirstOffset)
        .pull_batch_size(settings.consumer.batch_size as i32)
        .auto_commit(false)
        .build()
        .map_err(|e| anyhow!("building the pull consumer: {e}"))?;
    consumer
        .subscribe(topic)
        .await
        .map_err(|e| anyhow!("subscribing {group} to {topic}: {e}"))?;
    consumer
        .start()
        .await
        .map_err(|e| anyhow!("starting the pull consumer: {e}"))?;
    let slots = Arc::new(Semaphore::new(settings.consumer.listener_calls));
    let next: Arc<Mutex<HashMap<MessageQueue, i64>>> = Arc::default();
    let handler: SharedHandler = count.clone();
    let done = count.done.notified();
    tokio::pin!(done);
    loop {
        let msgs = tokio::select! {
            _ = &mut done => break,
            msgs = consumer.poll_with_timeout_zero_copy(100) => msgs,
        };
        if msgs.is_empty() {
            continue;
        }
        let permit = Arc::clone(&slots).acquire_owned().await?;
        let handler = Arc::clone(&handler);
        let next = Arc::clone(&next);
        tokio::spawn(async move {
            let batch: Vec<Delivery> = msgs
                .iter()
                .map(|m| seckill::mq::rocketmq::to_delivery(m))
                .collect();
            let decision = handler.handle(batch).await;
            drop(permit);
            if decision == ConsumeDecision::Ack {
                let mut next = next.lock().unwrap_or_else(|p| p.into_inner());
                for m in &msgs {
                    let q = MessageQueue::from_parts(m.topic(), m.broker_name(), m.queue_id());
                    let at = next.entry(q).or_insert(0);
                    *at = (*at).max(m.queue_offset() + 1);
                }
            }
        });
    }
    let offsets = next.lock().unwrap_or_else(|p| p.into_inner()).clone();
    consumer.commit_with_map(offsets, true).await;
    consumer.shutdown().await;
    Ok(())
}

/// The CPU of the measured processes and the messages handled, at one instant.
struct Mark {
    cpu: CpuSnapshot,
    at: Instant,
    seen: usize,
}

fn mark(targets: &[CpuTarget], seen: usize) -> Mark {
    Mark {
        cpu: cpu_snapshot(targets),
        at: Instant::now(),
        seen,
    }
}

/// Watches the count every 5 ms: the marks at the first message and at the last, and the
/// longest time without a message in between.
async fn watch(count: Arc<Count>, targets: Vec<CpuTarget>) -> (Mark, Mark, Duration) {
    let mut first = None;
    let (mut seen, mut progress, mut stall) = (0, Instant::now(), Duration::ZERO);
    loop {
        tokio::time::sleep(Duration::from_millis(5)).await;
        let now = count.seen.load(Ordering::Acquire);
        if now == seen {
            continue;
        }
        if first.is_none() {
            first = Some(mark(&targets, now));
        } else {
            stall = stall.max(progress.elapsed());
        }
        (seen, progress) = (now, Instant::now());
        if now >= count.target {
            let last = mark(&targets, now);
            return (first.unwrap_or_else(|| mark(&targets, now)), last, stall);
        }
    }
}

/// One drain of the topic by a fresh group through `intake`; prints its `INTAKE` line.
async fn round(
    settings: &Settings,
    args: &IntakeArgs,
    intake: Intake,
    group: &str,
    topic: &str,
) -> anyhow::Result<()> {
    let count = Arc::new(Count {
        seen: AtomicUsize::new(0),
        target: args.messages,
        done: Notify::new(),
    });
    // This process (the consumer under test) first, then the `--cpu` targets.
    let mut targets = vec![CpuTarget {
        name: "consumer".into(),
        pids: vec![std::process::id()],
    }];
    targets.extend(args.cpu.iter().cloned());
    let started = Instant::now();
    let watcher = tokio::spawn(watch(Arc::clone(&count), targets.clone()));
    let drained = async {
        match intake {
            Intake::Push => drain_push(settings, group, topic, Arc::clone(&count)).await,
            Intake::Pull => drain_pull(settings, group, topic, Arc::clone(&count)).await,
        }
    };
    tokio::time::timeout(Duration::from_secs(120), drained)
        .await
        .context("drain took over 120 s")??;
    let (first, last, stall) = watcher.await?;
    // From the first message to the last: the drain itself, start-up left out.
    let n = (last.seen - first.seen).max(1) as f64;
    let secs = (last.at - first.at).as_secs_f64();
    let mut line = format!(
        "INTAKE {} messages={} first_after_s={:.2} drain_s={secs:.2} msgs_per_s={:.0} \
         longest_stall_s={:.2}",
        intake.name(),
        last.seen,
        (first.at - started).as_secs_f64(),
        n / secs.max(1e-3),
        stall.as_secs_f64(),
    );
    // Between the two marks only: not the consumer's start, not its shutdown.
    for used in cpu_between(&targets, &first.cpu, &last.cpu, last.at - first.at) {
        line.push_str(&format!(
            " {}_us_per_msg={:.1}",
            used.name,
            used.cpu_secs * 1e6 / n
        ));
    }
    println!("{line}");
    Ok(())
}

/// The rounds, on a topic already filled; every group used is pushed to `groups`.
async fn rounds(
    settings: &Settings,
    args: &IntakeArgs,
    topic: &str,
    groups: &mut Vec<String>,
) -> anyhow::Result<()> {
    for r in 1..=args.rounds {
        for &intake in &args.intakes {
            let group = format!("{topic}_{}_{r}", intake.name());
            groups.push(group.clone());
            // The broker serves only the groups it was told of (as `seckill topics create` does).
            let spec = seckill::roles::ops::topics::tool_group(settings, &group);
            seckill::mq::create_groups(settings, &[spec]).await?;
            round(settings, args, intake, &group, topic).await?;
        }
    }
    Ok(())
}

/// Deletes `topics`, `groups` and the retry and dead-letter topics the broker made for them.
async fn clean_up(settings: &Settings, topics: &[String], groups: &[String]) -> anyhow::Result<()> {
    let mut all = topics.to_vec();
    for g in groups {
        all.extend([format!("%RETRY%{g}"), format!("%DLQ%{g}")]);
    }
    seckill::mq::delete_groups(settings, groups).await?;
    seckill::mq::delete_topics(settings, &all).await
}

/// Fills a topic of its own, runs the rounds, deletes the topic and the groups.
pub async fn run(settings: Settings, args: IntakeArgs) -> anyhow::Result<bool> {
    if !args.delete.is_empty() {
        clean_up(&settings, &args.delete, &args.delete).await?;
        return Ok(true);
    }
    anyhow::ensure!(args.messages > 0, "--messages must be at least 1");
    let topic = format!("seckill_intake_cost_{}", std::process::id());
    let mut groups = Vec::new();
    let measure = async {
        seckill::mq::create_topics(
            &settings,
            &[(topic.clone(), settings.mq.order_create_queues)],
        )
        .await?;
        fill(&settings, &topic, args.messages).await?;
        rounds(&settings, &args, &topic, &mut groups).await
    };
    // Interrupted or not, the topic and the groups go (the messages with them).
    let result = tokio::select! {
        r = measure => r,
        _ = seckill::shutdown::shutdown_signal() => Err(anyhow!("interrupted")),
    };
    let cleaned = clean_up(&settings, &[topic], &groups).await;
    result.and(cleaned).map(|()| true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: IntakeArgs,
    }

    fn intakes(argv: &[&str]) -> Result<Vec<Intake>, clap::Error> {
        Cli::try_parse_from([&["intake"], argv].concat()).map(|c| c.args.intakes)
    }

    #[test]
    fn intakes_are_named_comma_separated_and_default_to_both() {
        assert_eq!(intakes(&[]).unwrap(), vec![Intake::Push, Intake::Pull]);
        assert_eq!(intakes(&["--intakes", "pull"]).unwrap(), vec![Intake::Pull]);
        assert_eq!(
            intakes(&["--intakes", "pull,push"]).unwrap(),
            vec![Intake::Pull, Intake::Push]
        );
        assert!(intakes(&["--intakes", "push,poll"]).is_err());
    }
}
