//! What the RocketMQ client costs per message on the order consumer's intake, measured with a
//! handler that does nothing, on the two intakes the client offers:
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
//! its first offset. CPU per message is read from `/proc` for this process and the broker,
//! from the consumer's start to its last message (start-up included on both sides).
//!
//! `cargo run --release --example intake_cost -- [messages (30000)] [rounds (3)] [push,pull]`,
//! with the services of `make services-up`; the topic and groups it creates are deleted at the
//! end, also when interrupted (`-- --delete NAME...` deletes what a killed run left).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context as _};
use chrono::Utc;
use rocketmq_client_rust::DefaultLitePullConsumer;
use rocketmq_model::common::consumer::consume_from_where::ConsumeFromWhere;
use rocketmq_model::common::message::message_queue::MessageQueue;
use seckill::config::Settings;
use seckill::domain::{
    OrderCreateRequested, TraceContext, EVENT_ORDER_CREATE_REQUESTED, SCHEMA_VERSION,
};
use seckill::mq::{BatchHandler, ConsumeDecision, Delivery, SharedHandler};
use tokio::sync::{Notify, Semaphore};

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

/// CPU seconds (user + system) of `pid` so far, from `/proc/<pid>/stat`.
fn cpu_secs(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the command name (which may hold spaces), from field 3 on.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15 (indexes 11 and 12 here); 100 ticks a second.
    (ticks(11) + ticks(12)) / 100.0
}

fn broker_pid() -> Option<u32> {
    let out = std::process::Command::new("pgrep")
        .args(["-o", "-f", "rocketmq-broker-rust"])
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
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

#[derive(Clone, Copy)]
enum Intake {
    Push,
    Pull,
}

/// This process's and the broker's CPU and the messages handled, at one instant.
#[derive(Clone, Copy)]
struct Mark {
    cpu: f64,
    broker: f64,
    at: Instant,
    seen: usize,
}

fn mark(broker: Option<u32>, seen: usize) -> Mark {
    Mark {
        cpu: cpu_secs(std::process::id()),
        broker: broker.map(cpu_secs).unwrap_or(0.0),
        at: Instant::now(),
        seen,
    }
}

/// Watches the count every 5 ms: the marks at the first message and at the last, and the
/// longest time without a message in between.
async fn watch(count: Arc<Count>, broker: Option<u32>) -> (Mark, Mark, Duration) {
    let mut first = None;
    let (mut seen, mut progress, mut stall) = (0, Instant::now(), Duration::ZERO);
    loop {
        tokio::time::sleep(Duration::from_millis(5)).await;
        let now = count.seen.load(Ordering::Acquire);
        if now == seen {
            continue;
        }
        if first.is_none() {
            first = Some(mark(broker, now));
        } else {
            stall = stall.max(progress.elapsed());
        }
        (seen, progress) = (now, Instant::now());
        if now >= count.target {
            let last = mark(broker, now);
            return (first.unwrap_or(last), last, stall);
        }
    }
}

async fn round(
    settings: &Settings,
    intake: Intake,
    group: &str,
    topic: &str,
    messages: usize,
    broker: Option<u32>,
) -> anyhow::Result<()> {
    let count = Arc::new(Count {
        seen: AtomicUsize::new(0),
        target: messages,
        done: Notify::new(),
    });
    let start = mark(broker, 0);
    let watcher = tokio::spawn(watch(Arc::clone(&count), broker));
    let (drained, name): (std::pin::Pin<Box<dyn std::future::Future<Output = _>>>, _) = match intake
    {
        Intake::Push => (
            Box::pin(drain_push(settings, group, topic, Arc::clone(&count))),
            "push",
        ),
        Intake::Pull => (
            Box::pin(drain_pull(settings, group, topic, Arc::clone(&count))),
            "pull",
        ),
    };
    tokio::time::timeout(Duration::from_secs(120), drained)
        .await
        .context("drain took over 120 s")??;
    let (first, last, stall) = watcher.await?;
    // From the first message to the last: the drain itself, start-up left out.
    let n = (last.seen - first.seen).max(1) as f64;
    let secs = (last.at - first.at).as_secs_f64();
    println!(
        "INTAKE {name} messages={} first_after_s={:.2} drain_s={secs:.2} msgs_per_s={:.0} \
         longest_stall_s={:.2} consumer_us_per_msg={:.1} broker_us_per_msg={:.1}",
        last.seen,
        (first.at - start.at).as_secs_f64(),
        n / secs.max(1e-3),
        stall.as_secs_f64(),
        (last.cpu - first.cpu) * 1e6 / n,
        (last.broker - first.broker) * 1e6 / n,
    );
    Ok(())
}

/// The rounds, on a topic already filled; every group used is pushed to `groups`.
async fn rounds(
    settings: &Settings,
    topic: &str,
    (messages, rounds, modes): (usize, usize, &str),
    groups: &mut Vec<String>,
) -> anyhow::Result<()> {
    let broker = broker_pid();
    for r in 1..=rounds {
        for (intake, name) in [(Intake::Push, "push"), (Intake::Pull, "pull")] {
            if !modes.split(',').any(|m| m == name) {
                continue;
            }
            let group = format!("{topic}_{name}_{r}");
            groups.push(group.clone());
            // The broker serves only the groups it was told of (as `seckill topics create` does).
            let spec = seckill::roles::ops::topics::tool_group(settings, &group);
            seckill::mq::create_groups(settings, &[spec]).await?;
            round(settings, intake, &group, topic, messages, broker).await?;
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

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // `--delete NAME...`: what an earlier run could not delete (a killed process).
    if std::env::args().nth(1).as_deref() == Some("--delete") {
        let settings = Settings::load()?;
        let names: Vec<String> = std::env::args().skip(2).collect();
        return clean_up(&settings, &names, &names).await;
    }
    let arg = |i: usize, default: usize| -> anyhow::Result<usize> {
        std::env::args()
            .nth(i)
            .map(|v| v.parse().with_context(|| format!("argument {i}: {v}")))
            .transpose()
            .map(|v| v.unwrap_or(default))
    };
    let (messages, rounds_wanted) = (arg(1, 30_000)?, arg(2, 3)?);
    let modes = std::env::args()
        .nth(3)
        .unwrap_or_else(|| "push,pull".into());
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let settings = Settings::load()?;
    let topic = format!("seckill_intake_cost_{}", std::process::id());
    let mut groups = Vec::new();
    let run = async {
        seckill::mq::create_topics(
            &settings,
            &[(topic.clone(), settings.mq.order_create_queues)],
        )
        .await?;
        fill(&settings, &topic, messages).await?;
        let plan = (messages, rounds_wanted, modes.as_str());
        rounds(&settings, &topic, plan, &mut groups).await
    };
    // Interrupted or not, the topic and the groups go (the messages with them).
    let result = tokio::select! {
        r = run => r,
        _ = seckill::shutdown::shutdown_signal() => Err(anyhow!("interrupted")),
    };
    let cleaned = clean_up(&settings, &[topic], &groups).await;
    result.and(cleaned)
}
