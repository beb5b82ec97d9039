//! `seckill-bench timers`: how fast the broker delivers timer messages that fall due together,
//! the way the CANCEL_IF_UNPAID timers of a busy sale do. It sends `--count` timer messages
//! whose deliver times are spread evenly over `--spread-secs` (so they fall due at
//! `count / spread` a second), starting `--due-in-secs` from now, to a topic of its own
//! (`<env>_SECKILL_BENCH_TIMER_V1`), and consumes them with a group of its own, recording how
//! late each one arrived. Messages of earlier runs are acknowledged and ignored.
//!
//! `TIMERS count=… due_per_s=… delivered=… delivered_per_s=… late_p50_ms=… late_p99_ms=…
//! late_max_ms=…`

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use hdrhistogram::Histogram;

use seckill::config::Settings;
use seckill::mq::{BatchHandler, ConsumeDecision, Delivery, OutMessage, SendOutcome};

#[derive(Debug, Clone, Args)]
pub struct TimersArgs {
    /// Timer messages to send.
    #[arg(long, default_value_t = 20_000)]
    pub count: usize,
    /// The first falls due this many seconds from now (after every send is done).
    #[arg(long, default_value_t = 15)]
    pub due_in_secs: u64,
    /// Deliver times spread evenly over this many seconds.
    #[arg(long, default_value_t = 5.0)]
    pub spread_secs: f64,
    /// Concurrent senders (the broker takes timer messages one per call).
    #[arg(long, default_value_t = 16)]
    pub senders: usize,
    /// Give up after this long without a delivery once they are due.
    #[arg(long, default_value_t = 60)]
    pub stall_secs: u64,
    /// Send them as a sale does instead: paced over `--spread-secs`, each due `--due-in-secs`
    /// after it was sent, so the broker indexes new timers while it delivers due ones.
    #[arg(long)]
    pub continuous: bool,
}

/// Records how late each message of this run arrived.
struct Lateness {
    run: String,
    hist: Mutex<Histogram<u64>>,
    received: AtomicU64,
    first_ms: AtomicU64,
    last_ms: AtomicU64,
}

#[async_trait::async_trait]
impl BatchHandler for Lateness {
    async fn handle(&self, batch: Vec<Delivery>) -> ConsumeDecision {
        let now = chrono::Utc::now().timestamp_millis();
        for d in &batch {
            if d.properties.get("run") != Some(&self.run) {
                continue;
            }
            let due: i64 = d
                .properties
                .get("due_ms")
                .and_then(|v| v.parse().ok())
                .unwrap_or(now);
            let _ = self.hist.lock().unwrap().record((now - due).max(1) as u64);
            self.received.fetch_add(1, Ordering::Relaxed);
            let _ =
                self.first_ms
                    .compare_exchange(0, now as u64, Ordering::AcqRel, Ordering::Acquire);
            self.last_ms.fetch_max(now as u64, Ordering::AcqRel);
        }
        ConsumeDecision::Ack
    }
}

pub async fn run(settings: Settings, args: TimersArgs) -> anyhow::Result<bool> {
    anyhow::ensure!(
        args.count > 0 && args.senders > 0,
        "--count and --senders must be positive"
    );
    anyhow::ensure!(args.spread_secs > 0.0, "--spread-secs must be positive");
    let topic = format!("{}_SECKILL_BENCH_TIMER_V1", settings.env);
    let group = format!("CG_{}_SECKILL_BENCH_TIMER_V1", settings.env);
    seckill::mq::create_topics(
        &settings,
        &[(topic.clone(), settings.mq.order_create_queues)],
    )
    .await?;
    seckill::mq::create_groups(
        &settings,
        &[seckill::roles::ops::topics::tool_group(&settings, &group)],
    )
    .await?;
    let run = ulid::Ulid::new().to_string();
    let lateness = Arc::new(Lateness {
        run: run.clone(),
        hist: Mutex::new(Histogram::new_with_bounds(1, 3_600_000, 3)?),
        received: AtomicU64::new(0),
        first_ms: AtomicU64::new(0),
        last_ms: AtomicU64::new(0),
    });
    let consumer =
        seckill::mq::start_consumer(&settings, &group, &topic, lateness.clone(), 4, 32).await?;
    let publisher = seckill::mq::connect_publisher(&settings).await?;
    let first_due = chrono::Utc::now().timestamp_millis() + (args.due_in_secs * 1000) as i64;
    let send_started = Instant::now();
    let sent = send_all(publisher, &topic, &run, &args, first_due).await;
    let send_secs = send_started.elapsed().as_secs_f64();
    let now = chrono::Utc::now().timestamp_millis();
    anyhow::ensure!(
        args.continuous || now < first_due,
        "sending took {send_secs:.1} s, past the first deliver time: raise --due-in-secs"
    );
    eprintln!("timers: {sent} sent in {send_secs:.1} s");
    tokio::time::sleep(Duration::from_millis((first_due - now).max(0) as u64)).await;
    wait_delivered(&lateness, sent, args.stall_secs).await;
    consumer.shutdown().await;
    let got = lateness.received.load(Ordering::Relaxed);
    let span_ms = lateness
        .last_ms
        .load(Ordering::Relaxed)
        .saturating_sub(lateness.first_ms.load(Ordering::Relaxed));
    let h = lateness.hist.lock().unwrap();
    println!(
        "TIMERS count={} due_per_s={:.0} sent={sent} delivered={got} delivered_per_s={:.0} late_p50_ms={} late_p99_ms={} late_max_ms={}",
        args.count,
        args.count as f64 / args.spread_secs,
        if span_ms > 0 { got as f64 * 1000.0 / span_ms as f64 } else { 0.0 },
        h.value_at_quantile(0.5),
        h.value_at_quantile(0.99),
        h.max(),
    );
    Ok(got == sent && sent == args.count as u64)
}

/// Sends `--count` timers from `--senders` tasks, due over `--spread-secs` from `first_due`
/// (or, `--continuous`, each `--due-in-secs` after it is sent, paced over the spread); how
/// many the broker confirmed.
async fn send_all(
    publisher: Arc<dyn seckill::mq::Publisher>,
    topic: &str,
    run: &str,
    args: &TimersArgs,
    first_due: i64,
) -> u64 {
    let step = args.spread_secs * 1000.0 / args.count as f64;
    let paced_from = tokio::time::Instant::now();
    let (continuous, due_in_ms) = (args.continuous, (args.due_in_secs * 1000) as i64);
    let next = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let mut senders = tokio::task::JoinSet::new();
    for _ in 0..args.senders {
        let (publisher, topic, run, next, failed) = (
            publisher.clone(),
            topic.to_string(),
            run.to_string(),
            next.clone(),
            failed.clone(),
        );
        let count = args.count as u64;
        senders.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= count {
                    break;
                }
                let due = if continuous {
                    let at = paced_from + Duration::from_secs_f64(i as f64 * step / 1000.0);
                    tokio::time::sleep_until(at).await;
                    chrono::Utc::now().timestamp_millis() + due_in_ms
                } else {
                    first_due + (i as f64 * step) as i64
                };
                let msg = OutMessage {
                    topic: topic.clone(),
                    tag: "BENCH_TIMER".into(),
                    keys: vec![format!("t-{run}-{i}")],
                    properties: vec![
                        ("message_id".into(), format!("timer-{run}-{i}")),
                        ("run".into(), run.clone()),
                        ("due_ms".into(), due.to_string()),
                    ],
                    body: vec![b'x'; 300],
                    deliver_time_ms: Some(due),
                    ..Default::default()
                };
                if !matches!(
                    publisher.send(msg, 3_000).await,
                    SendOutcome::Confirmed { .. }
                ) {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
    }
    while senders.join_next().await.is_some() {}
    args.count as u64 - failed.load(Ordering::Relaxed)
}

/// Waits for every delivery, giving up once none has come for `stall_secs` after they are due.
async fn wait_delivered(lateness: &Lateness, sent: u64, stall_secs: u64) {
    let (mut seen, mut progressed) = (0u64, Instant::now());
    loop {
        let got = lateness.received.load(Ordering::Relaxed);
        if got >= sent {
            return;
        }
        if got > seen {
            (seen, progressed) = (got, Instant::now());
        } else if progressed.elapsed() >= Duration::from_secs(stall_secs) {
            eprintln!("timers: stalled with {got} of {sent} delivered");
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
