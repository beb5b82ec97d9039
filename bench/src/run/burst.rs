//! The crowd as it arrives (BENCHMARKS.md, "The crowd as it arrives"): requests at fixed
//! arrival rates whatever the answers take, in steps of the direct-PostgreSQL design's
//! measured capacity (`crate::burst::STEPS`), to that design and to the whole pipeline, with
//! the same tokens, buyers, request mix and stock, PostgreSQL held to the same CPU for both
//! (`super::pg_cpu`: a cgroup quota, a quarter of a core unless `--crowd-pg-cpu` says otherwise).
//!
//! The traffic is shaped like a sale: many SKUs asked for with a Zipf popularity, repeat
//! buyers and repeated requests (retries), every buyer with a token signed before the clock
//! starts. Each step restarts the server under test (cold token cache, as at a sale's start).
//! For the pipeline each step also reads its stages from the roles' own metrics
//! (`BURST_STAGES_*`): send percentiles, order transaction and pool wait p99, the oldest
//! message's age, WAL bytes per order.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::pg_cpu::PgCpu;
use super::procs::wait_ready;
use super::SCAN_READY;
use super::{Run, API, API_READY, BASELINE, BASELINE_READY, CONSUME_METRICS, CONSUME_READY};
use crate::burst::{Step, ACTIVITIES, CAPACITY, DRAIN, SKUS, STEPS, ZIPF};
use crate::lines::Line;
use crate::scrape::Scrape;
use crate::tokens::{write_tokens_file, Minter, Provisioned};

const API_METRICS: &str = "http://127.0.0.1:29100/metrics";
/// Requests in flight at most from the generator; past it a request waits for a slot, its
/// latency counted from its planned start all the same.
const OUTSTANDING: usize = 2048;
/// Shares of requests repeating an earlier one (a retry) and of fresh requests from a buyer
/// who already asked.
const RETRY_SHARE: &str = "0.03";
const REPEAT_BUYER_SHARE: &str = "0.05";

fn s(v: impl ToString) -> String {
    v.to_string()
}

/// The scenario: PostgreSQL held to its CPU; the direct design's capacity and the order
/// consumer's drain on a backlog measured under that hold; the buyers' tokens signed; the
/// steps run; every role stopped and PostgreSQL released at the end.
pub(super) async fn crowd(run: &mut Run, keys: &[Provisioned]) -> anyhow::Result<()> {
    run.procs.stop_all().await;
    let held = PgCpu::hold(run.crowd_pg_cpu).await?;
    let label = held
        .as_ref()
        .map_or("postgres_cpu=shared".to_owned(), |p| p.label.clone());
    eprintln!("[bench] crowd: {label}");
    let tokens = run.procs.dir.join("crowd-tokens.txt");
    let outcome = steps(run, keys, &tokens, &label).await;
    run.procs.stop_all().await;
    if let Some(p) = held {
        p.release().await;
    }
    let _ = std::fs::remove_file(&tokens);
    outcome
}

async fn steps(
    run: &mut Run,
    keys: &[Provisioned],
    tokens: &std::path::Path,
    pin: &str,
) -> anyhow::Result<()> {
    let capacity = direct_capacity(run, pin).await?;
    // PostgreSQL's pace on this hold: a backlog drained by a fresh consumer, the relay
    // publishing the orders' events beside it as in a sale (what `seckill plan` sizes the
    // drain with).
    run.procs.start("scan", &["scan"], None)?;
    wait_ready(SCAN_READY).await?;
    // Its batches touch as many stock rows as the steps' do: the backlog spread over as many
    // SKUs as the steps' activities hold.
    let messages = run.sizes.crowd_capacity_requests * 2;
    let shape = (messages as i64, (SKUS * ACTIVITIES) as usize);
    let drain = super::scenarios::backlog_over(run, "crowd", shape, messages, &[]).await?;
    run.keep(DRAIN, with_pin(drain, pin));
    let z = run.sizes;
    let most = ((STEPS[STEPS.len() - 1].factor * capacity * z.crowd_step_secs) as usize)
        .clamp(1, z.crowd_max_requests);
    eprintln!("[bench] crowd: signing {most} buyers' tokens");
    let minter = Minter::new(&run.settings, &keys[0].signing_args())?;
    let users: Vec<i64> = (1..=most as i64).collect();
    write_tokens_file(&minter, &users, tokens)?;
    run.procs.start("consume", &["consume"], None)?;
    wait_ready(CONSUME_READY).await?;
    for (i, step) in STEPS.iter().enumerate() {
        let rate = step.factor * capacity;
        let requests = ((rate * z.crowd_step_secs) as usize).clamp(1, most);
        let pairs = SKUS * ACTIVITIES;
        let stock = ((requests as i64 / 2 + pairs - 1) / pairs).max(1);
        eprintln!(
            "[bench] crowd {}: {rate:.0} requests/s, {requests} requests, {} units over \
             {ACTIVITIES} activities of {SKUS} SKUs",
            step.label,
            stock * pairs
        );
        let shape = Shape {
            step: *step,
            rate,
            requests,
            stock,
            seed: 1 + i as u64,
        };
        let line = direct_step(run, &shape, tokens, pin).await?;
        run.keep(step.direct, line);
        seckill_step(run, &shape, tokens, pin).await?;
    }
    let costs = super::costs::write_costs(run).await?;
    super::costs::check_plan(run, &costs);
    Ok(())
}

/// One step's crowd, the same for both designs.
struct Shape {
    step: Step,
    rate: f64,
    requests: usize,
    stock: i64,
    seed: u64,
}

/// `seckill-bench load` arguments of the crowd against `api`.
fn load_args(
    api: &str,
    activities: &[i64],
    requests: usize,
    tokens: Option<&std::path::Path>,
) -> Vec<String> {
    let ids: Vec<String> = activities.iter().map(s).collect();
    let mut args = vec![
        s("load"),
        s("--api"),
        s(api),
        s("--activity-id"),
        ids.join(","),
    ];
    args.extend([s("--sku-id"), s(1), s("--skus"), s(SKUS)]);
    args.extend([s("--sku-zipf"), s(ZIPF), s("--requests"), s(requests)]);
    args.extend([s("--buyers"), s(requests)]);
    if let Some(file) = tokens {
        args.extend([s("--tokens-file"), file.display().to_string()]);
    }
    args
}

/// The direct server with `stock` units of each SKU of `activities` fresh activity ids.
async fn restart_direct(run: &mut Run, activities: i64, stock: i64) -> anyhow::Result<Vec<i64>> {
    run.procs.stop("baseline").await;
    let ids: Vec<i64> = (0..activities).map(|_| run.procs.fresh_id()).collect();
    let mut args = vec![s("--pool"), s(16)];
    for a in &ids {
        for sku in 1..=SKUS {
            args.extend([s("--stock"), format!("{a}:{sku}:{stock}")]);
        }
    }
    run.procs.start_baseline(&args)?;
    wait_ready(BASELINE_READY).await?;
    Ok(ids)
}

/// The direct design's capacity on this traffic: a closed loop of every buyer new, stock for
/// all (each answer a purchase committed), its answers per second.
async fn direct_capacity(run: &mut Run, pin: &str) -> anyhow::Result<f64> {
    let n = run.sizes.crowd_capacity_requests;
    let a = restart_direct(run, ACTIVITIES, n as i64).await?;
    super::scenarios::quiesce(run).await;
    let mut args = load_args(BASELINE, &a, n, None);
    args.extend([s("--concurrency"), s(run.concurrency), s("--seed"), s(0)]);
    args.extend(["--dup-request-share", "0", "--repeat-buyer-share", "0"].map(s));
    args.extend(["--load-only", "--scenario", "crowd-capacity"].map(s));
    args.extend([s("--summary-prefix"), s(CAPACITY)]);
    args.extend(run.procs.cpu_args().await);
    let line = run.procs.bench_line("crowd-capacity", &args).await?;
    let capacity = line
        .num("answers_per_s")
        .filter(|c| *c > 0.0)
        .ok_or_else(|| anyhow::anyhow!("the direct design's capacity: {}", line.text))?;
    run.keep(CAPACITY, with_pin(line, pin));
    run.procs.stop("baseline").await;
    Ok(capacity)
}

/// The arguments both designs' steps share: the arrival rate, the plan's seed, the mix.
fn step_args(shape: &Shape, prefix: &str) -> Vec<String> {
    let mut args = vec![s("--rate"), format!("{:.1}", shape.rate)];
    args.extend([
        s("--concurrency"),
        s(OUTSTANDING),
        s("--seed"),
        s(shape.seed),
    ]);
    args.extend([s("--dup-request-share"), s(RETRY_SHARE)]);
    args.extend([s("--repeat-buyer-share"), s(REPEAT_BUYER_SHARE)]);
    args.extend([s("--scenario"), format!("crowd-{}", shape.step.label)]);
    // Errors are what a step measures, not a reason to stop it.
    args.extend([s("--tolerate-faults"), s("--summary-prefix"), s(prefix)]);
    args
}

async fn direct_step(
    run: &mut Run,
    shape: &Shape,
    tokens: &std::path::Path,
    pin: &str,
) -> anyhow::Result<Line> {
    let a = restart_direct(run, ACTIVITIES, shape.stock).await?;
    super::scenarios::quiesce(run).await;
    let mut args = load_args(BASELINE, &a, shape.requests, Some(tokens));
    args.extend(step_args(shape, shape.step.direct));
    args.extend([s("--load-only"), s("--stock"), s(shape.stock)]);
    args.extend(run.procs.cpu_args().await);
    let out = format!("crowd-{}-direct", shape.step.label);
    let line = run.procs.bench_line(&out, &args).await?;
    run.procs.stop("baseline").await;
    Ok(with_pin(line, pin))
}

async fn seckill_step(
    run: &mut Run,
    shape: &Shape,
    tokens: &std::path::Path,
    pin: &str,
) -> anyhow::Result<()> {
    let mut a = Vec::new();
    for _ in 0..ACTIVITIES {
        a.push(run.procs.activity(shape.stock, SKUS as usize).await?);
    }
    run.procs.stop("api").await;
    run.procs.start("api", &["api"], None)?;
    wait_ready(API_READY).await?;
    super::scenarios::quiesce(run).await;
    let before = Stages::read(run).await;
    let sampler = LagSampler::start();
    let mut args = load_args(API, &a, shape.requests, Some(tokens));
    args.extend(step_args(shape, shape.step.seckill));
    args.extend(run.procs.cpu_args().await);
    let out = format!("crowd-{}-seckill", shape.step.label);
    let line = run.procs.bench_line(&out, &args).await?;
    let oldest = sampler.stop().await;
    let after = Stages::read(run).await;
    let stages = after.since(&before, &line, oldest, shape.step, pin);
    eprintln!("[bench] {}", stages.text);
    run.keep(shape.step.stages, stages);
    run.keep(shape.step.seckill, with_pin(line, pin));
    Ok(())
}

/// The pinning said on the line.
fn with_pin(line: Line, pin: &str) -> Line {
    Line::parse(&format!("{} {pin}", line.text))
}

/// What the roles' metrics and PostgreSQL said at one moment.
struct Stages {
    api: Scrape,
    consume: Scrape,
    wal_bytes: f64,
}

impl Stages {
    async fn read(run: &Run) -> Stages {
        let wal_bytes = match run
            .pg
            .query_one(
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::float8",
                &[],
            )
            .await
        {
            Ok(row) => row.get(0),
            Err(_) => f64::NAN,
        };
        Stages {
            api: Scrape::of(API_METRICS).await,
            consume: Scrape::of(CONSUME_METRICS).await,
            wal_bytes,
        }
    }

    /// The stages' line between `before` and now, for the step whose load line is `load`.
    fn since(&self, before: &Stages, load: &Line, oldest: f64, step: Step, pin: &str) -> Line {
        let ms = |b: crate::scrape::Buckets, q: f64| {
            b.quantile(q)
                .map_or_else(|| "-".to_owned(), |v| format!("{:.2}", v * 1000.0))
        };
        let send = self
            .api
            .buckets("mq_publish_latency_seconds", &[])
            .since(&before.api.buckets("mq_publish_latency_seconds", &[]));
        let tx = self
            .consume
            .buckets("order_tx_latency_seconds", &[("kind", "create")])
            .since(
                &before
                    .consume
                    .buckets("order_tx_latency_seconds", &[("kind", "create")]),
            );
        let wait = self
            .consume
            .buckets("pg_pool_wait_seconds", &[])
            .since(&before.consume.buckets("pg_pool_wait_seconds", &[]));
        let orders = load.num("orders").unwrap_or(0.0);
        let wal = if orders > 0.0 {
            format!("{:.0}", (self.wal_bytes - before.wal_bytes) / orders)
        } else {
            "-".to_owned()
        };
        Line::parse(&format!(
            "{} OK step={} send_p50_ms={} send_p95_ms={} send_p99_ms={} order_tx_p99_ms={} \
             pool_wait_consume_p99_ms={} oldest_message_age_s={oldest:.1} wal_bytes_per_order={wal} \
             consume_orders_per_s={} backlog_at_end={} drain_after_arrivals_s={} order_p50_ms={} order_p99_ms={} \
             order_p999_ms={} violations={} {pin}",
            step.stages,
            step.label,
            ms(send.clone(), 0.5),
            ms(send.clone(), 0.95),
            ms(send, 0.99),
            ms(tx, 0.99),
            ms(wait, 0.99),
            load.raw("orders_per_s"),
            load.raw("backlog_at_end"),
            load.raw("drain_after_arrivals_s"),
            load.raw("order_p50_ms"),
            load.raw("order_p99_ms"),
            load.raw("order_p999_ms"),
            load.raw("violations"),
        ))
    }
}

/// The oldest unconsumed order-create message's age, read from the consumer every 250 ms
/// while a step runs and drains; its largest value.
struct LagSampler {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<f64>,
}

impl LagSampler {
    fn start() -> LagSampler {
        let stop = CancellationToken::new();
        let until = stop.clone();
        let task = tokio::spawn(async move {
            let mut oldest: f64 = 0.0;
            while !until.is_cancelled() {
                let m = Scrape::of(CONSUME_METRICS).await;
                let age = m
                    .gauge_max("mq_consumer_lag_seconds", &[("topic", "order_create")])
                    .or_else(|| m.gauge_max("mq_consumer_lag_seconds", &[]));
                oldest = oldest.max(age.unwrap_or(0.0));
                tokio::select! {
                    _ = until.cancelled() => {}
                    _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                }
            }
            oldest
        });
        LagSampler { stop, task }
    }

    async fn stop(self) -> f64 {
        self.stop.cancel();
        self.task.await.unwrap_or(f64::NAN)
    }
}
