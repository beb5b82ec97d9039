//! `seckill-bench broker`: the broker's raw send rate on this machine, one message per call,
//! in batches, or as timer messages, through the same producer the pipeline uses. It writes to
//! a topic of its own (`<env>_SECKILL_BENCH_RAW_V1`) that nothing consumes (timer messages
//! arrive there when they are due).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;

use seckill::config::Settings;
use seckill::mq::{OutMessage, SendOutcome};

#[derive(Debug, Clone, Args)]
pub struct BrokerArgs {
    /// Concurrent senders.
    #[arg(long, default_value_t = 16)]
    pub senders: usize,
    /// Messages per broker call (1 = one send per message).
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// How long to send.
    #[arg(long, default_value_t = 5.0)]
    pub seconds: f64,
    /// Body size in bytes (an ORDER_CREATE_REQUESTED body is about 700).
    #[arg(long, default_value_t = 700)]
    pub body_bytes: usize,
    /// Send timer messages delivered this many seconds later (like the CANCEL_IF_UNPAID
    /// timers), one per call; 0 sends ordinary messages.
    #[arg(long, default_value_t = 0)]
    pub timer_delay_secs: u64,
    /// Bound of each send (the pipeline's is `mq.send_timeout_ms`): past it the outcome is
    /// UNKNOWN. The report counts the outcomes, so a table of UNKNOWN rate against timeout
    /// comes from a few runs.
    #[arg(long, default_value_t = 3000)]
    pub timeout_ms: u64,
    /// Client retries of a refused or unsent attempt (default: `mq.send_retries`).
    #[arg(long)]
    pub retries: Option<u32>,
}

pub async fn run(mut settings: Settings, args: BrokerArgs) -> anyhow::Result<bool> {
    anyhow::ensure!(
        args.senders > 0 && args.batch > 0,
        "--senders and --batch must be positive"
    );
    anyhow::ensure!(
        args.timer_delay_secs == 0 || args.batch == 1,
        "the broker takes timer messages one per call: --timer-delay-secs needs --batch 1"
    );
    let topic = format!("{}_SECKILL_BENCH_RAW_V1", settings.env);
    seckill::mq::create_topics(
        &settings,
        &[(topic.clone(), settings.mq.order_create_queues)],
    )
    .await?;
    settings.mq.send_timeout_ms = args.timeout_ms;
    if let Some(r) = args.retries {
        settings.mq.send_retries = r;
    }
    let publisher = seckill::mq::connect_publisher(&settings).await?;
    let body = vec![b'x'; args.body_bytes];
    let confirmed = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let unknown = Arc::new(AtomicU64::new(0));
    let latency = Arc::new(std::sync::Mutex::new(
        hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?,
    ));
    let calls = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs_f64(args.seconds);
    let started = Instant::now();
    let mut senders = tokio::task::JoinSet::new();
    for s in 0..args.senders {
        let (publisher, topic, body) = (publisher.clone(), topic.clone(), body.clone());
        let (confirmed, failed, calls) = (confirmed.clone(), failed.clone(), calls.clone());
        let (unknown, latency) = (unknown.clone(), latency.clone());
        let timeout_ms = args.timeout_ms;
        let batch = args.batch;
        let delay_ms = i64::try_from(args.timer_delay_secs.saturating_mul(1000))?;
        senders.spawn(async move {
            let mut n = 0u64;
            while Instant::now() < deadline {
                let msgs: Vec<OutMessage> = (0..batch)
                    .map(|i| OutMessage {
                        topic: topic.clone(),
                        tag: "BENCH".into(),
                        keys: vec![format!("s{s}-{n}-{i}")],
                        properties: vec![("message_id".into(), format!("raw-{s}-{n}-{i}"))],
                        body: body.clone(),
                        deliver_time_ms: (delay_ms > 0)
                            .then(|| chrono::Utc::now().timestamp_millis() + delay_ms),
                        ..Default::default()
                    })
                    .collect();
                n += 1;
                let sent = Instant::now();
                let outcomes = if batch == 1 {
                    let m = msgs.into_iter().next().expect("one message");
                    vec![publisher.send(m, timeout_ms).await]
                } else {
                    publisher.send_batch(msgs, timeout_ms).await
                };
                let us = sent.elapsed().as_micros().max(1) as u64;
                if let Ok(mut h) = latency.lock() {
                    let _ = h.record(us.min(60_000_000));
                }
                calls.fetch_add(1, Ordering::Relaxed);
                for o in outcomes {
                    match o {
                        SendOutcome::Confirmed { .. } => {
                            confirmed.fetch_add(1, Ordering::Relaxed);
                        }
                        SendOutcome::Unknown { .. } => {
                            unknown.fetch_add(1, Ordering::Relaxed);
                            failed.fetch_add(1, Ordering::Relaxed);
                        }
                        SendOutcome::DefiniteFailure { .. } => {
                            failed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }
        });
    }
    while senders.join_next().await.is_some() {}
    let secs = started.elapsed().as_secs_f64();
    let ok_msgs = confirmed.load(Ordering::Relaxed);
    let bad = failed.load(Ordering::Relaxed);
    let unknown = unknown.load(Ordering::Relaxed);
    let (p50, p99, p999, max) = latency
        .lock()
        .map(|h| {
            let ms = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
            (ms(0.5), ms(0.99), ms(0.999), h.max() as f64 / 1000.0)
        })
        .unwrap_or_default();
    println!(
        "BROKER batch={} senders={} timer_delay_s={} timeout_ms={} retries={} msgs_per_s={:.0} calls_per_s={:.0} confirmed={ok_msgs} failed={bad} unknown={unknown} unknown_pct={:.3} call_p50_ms={p50:.2} call_p99_ms={p99:.2} call_p999_ms={p999:.2} call_max_ms={max:.2} seconds={secs:.2}",
        args.batch,
        args.senders,
        args.timer_delay_secs,
        args.timeout_ms,
        settings.mq.send_retries,
        ok_msgs as f64 / secs,
        calls.load(Ordering::Relaxed) as f64 / secs,
        100.0 * unknown as f64 / (ok_msgs + bad).max(1) as f64,
    );
    Ok(bad == 0)
}
