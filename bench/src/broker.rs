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
    let tally = Arc::new(Tally {
        confirmed: AtomicU64::new(0),
        failed: AtomicU64::new(0),
        unknown: AtomicU64::new(0),
        calls: AtomicU64::new(0),
        latency: std::sync::Mutex::new(hdrhistogram::Histogram::<u64>::new_with_bounds(
            1, 60_000_000, 3,
        )?),
    });
    let deadline = Instant::now() + Duration::from_secs_f64(args.seconds);
    let delay_ms = i64::try_from(args.timer_delay_secs.saturating_mul(1000))?;
    let started = Instant::now();
    let mut senders = tokio::task::JoinSet::new();
    for s in 0..args.senders {
        let sender = Sender {
            id: s,
            publisher: publisher.clone(),
            topic: topic.clone(),
            body: vec![b'x'; args.body_bytes],
            batch: args.batch,
            timeout_ms: args.timeout_ms,
            delay_ms,
        };
        senders.spawn(sender.until(deadline, tally.clone()));
    }
    while senders.join_next().await.is_some() {}
    let secs = started.elapsed().as_secs_f64();
    let ok_msgs = tally.confirmed.load(Ordering::Relaxed);
    let bad = tally.failed.load(Ordering::Relaxed);
    let unknown = tally.unknown.load(Ordering::Relaxed);
    let (p50, p99, p999, max) = tally
        .latency
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
        tally.calls.load(Ordering::Relaxed) as f64 / secs,
        100.0 * unknown as f64 / (ok_msgs + bad).max(1) as f64,
    );
    Ok(bad == 0)
}

/// What every sender's calls came to.
struct Tally {
    confirmed: AtomicU64,
    /// Refused or unknown.
    failed: AtomicU64,
    unknown: AtomicU64,
    calls: AtomicU64,
    /// Each call's time, µs.
    latency: std::sync::Mutex<hdrhistogram::Histogram<u64>>,
}

/// One sender: calls of `batch` messages (timer messages `delay_ms` ahead when not 0), one
/// after the other.
struct Sender {
    id: usize,
    publisher: Arc<dyn seckill::mq::Publisher>,
    topic: String,
    body: Vec<u8>,
    batch: usize,
    timeout_ms: u64,
    delay_ms: i64,
}

impl Sender {
    async fn until(self, deadline: Instant, tally: Arc<Tally>) {
        let (s, mut n) = (self.id, 0u64);
        while Instant::now() < deadline {
            let msgs: Vec<OutMessage> = (0..self.batch)
                .map(|i| OutMessage {
                    topic: self.topic.clone(),
                    tag: "BENCH".into(),
                    keys: vec![format!("s{s}-{n}-{i}")],
                    properties: vec![("message_id".into(), format!("raw-{s}-{n}-{i}"))],
                    body: self.body.clone(),
                    deliver_time_ms: (self.delay_ms > 0)
                        .then(|| chrono::Utc::now().timestamp_millis() + self.delay_ms),
                    ..Default::default()
                })
                .collect();
            n += 1;
            let sent = Instant::now();
            let outcomes = if self.batch == 1 {
                let m = msgs.into_iter().next().expect("one message");
                vec![self.publisher.send(m, self.timeout_ms).await]
            } else {
                self.publisher.send_batch(msgs, self.timeout_ms).await
            };
            let us = sent.elapsed().as_micros().max(1) as u64;
            if let Ok(mut h) = tally.latency.lock() {
                let _ = h.record(us.min(60_000_000));
            }
            tally.calls.fetch_add(1, Ordering::Relaxed);
            for o in outcomes {
                let counter = match o {
                    SendOutcome::Confirmed { .. } => &tally.confirmed,
                    SendOutcome::Unknown { .. } => {
                        tally.unknown.fetch_add(1, Ordering::Relaxed);
                        &tally.failed
                    }
                    SendOutcome::DefiniteFailure { .. } => &tally.failed,
                };
                counter.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}
