//! `seckill-bench backlog`: how fast the order consumer turns a backlog into orders.
//!
//! It reserves `--messages` units in Redis exactly as the API does (same script, same ids),
//! publishes their ORDER_CREATE_REQUESTED messages in broker batches and marks them sent, then
//! waits until PostgreSQL has recorded every one. The figure is orders per second from the
//! first to the last order's commit (`order_commits.committed_at`): what a running `seckill consume` sustains,
//! comparable with `pgbench` running the same transaction (`bench/limits/limits.sh`). Then it
//! checks the invariants of the SKU.
//!
//! `--fill-only` and `--drain-only` split the two halves, so that the backlog can be filled
//! while no consumer runs and a consumer started afterwards is measured alone.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use chrono::Utc;
use clap::Args;
use futures::StreamExt;

use seckill::config::Settings;

use crate::cpu::{cpu_snapshot, cpu_use, parse_cpu_target, CpuTarget};
use seckill::domain::ids::{new_traceparent, Ids};
use seckill::domain::order_create::{ReservationRef, TraceContext};
use seckill::domain::OrderCreateRequested;
use seckill::invariants;
use seckill::mq::{order_create_message, SendOutcome};
use seckill::redis::{RedisStore, ReserveArgs, ReserveResult};

#[derive(Debug, Clone, Args)]
pub struct BacklogArgs {
    #[arg(long)]
    pub activity_id: i64,
    /// The SKU, or with `--skus N` the first of N consecutive SKU ids.
    #[arg(long, default_value_t = 1)]
    pub sku_id: i64,
    /// Spread the reservations over this many SKUs in turn (`--sku-id` ..
    /// `--sku-id + N - 1`): a backlog whose batches update several stock rows, as a sale of
    /// many SKUs leaves.
    #[arg(long, default_value_t = 1)]
    pub skus: i64,
    /// Reservations (one unit each) to turn into orders.
    #[arg(long, default_value_t = 20_000)]
    pub messages: usize,
    /// Buyers are user ids `first_user ..` (one reservation each).
    #[arg(long, default_value_t = 1)]
    pub first_user: i64,
    /// Messages per broker call while filling the backlog.
    #[arg(long, default_value_t = 32)]
    pub publish_batch: usize,
    #[arg(long, default_value_t = 300)]
    pub drain_timeout_secs: u64,
    /// Prefix of the final machine-readable line.
    #[arg(long, default_value = "BACKLOG")]
    pub summary_prefix: String,
    /// Processes whose CPU the drain reports per order, `name=pid[+pid...]` (repeatable),
    /// e.g. `--cpu consume=1234 --cpu postgres=$(pgrep -o -x postgres)`.
    #[arg(long = "cpu", value_parser = parse_cpu_target)]
    pub cpu: Vec<CpuTarget>,
    /// Only fill the backlog (reserve and publish), for a consumer started afterwards.
    #[arg(long, conflicts_with = "drain_only")]
    pub fill_only: bool,
    /// Only wait for `--messages` reservations of the activity to reach PostgreSQL (filled
    /// earlier with `--fill-only`) and report.
    #[arg(long)]
    pub drain_only: bool,
}

pub async fn run(settings: Settings, args: BacklogArgs) -> anyhow::Result<bool> {
    anyhow::ensure!(args.messages > 0, "--messages must be at least 1");
    let redis = RedisStore::connect(&settings.redis).await?;
    if !args.drain_only {
        let filled = fill(&settings, &args, &redis).await?;
        if args.fill_only {
            println!(
                "{} FILLED messages={} unconfirmed={}",
                args.summary_prefix, filled.0, filled.1
            );
            return Ok(filled.1 == 0);
        }
    }
    drain(&settings, &args, &redis).await
}

/// Reserves and publishes; returns (reserved, unconfirmed).
async fn fill(
    settings: &Settings,
    args: &BacklogArgs,
    redis: &RedisStore,
) -> anyhow::Result<(usize, usize)> {
    let publisher = seckill::mq::connect_publisher(settings).await?;
    let reserve_started = Instant::now();
    let events = reserve_all(settings, args, redis).await?;
    let reserve_secs = reserve_started.elapsed().as_secs_f64();
    let publish_started = Instant::now();
    let topic = settings.names().order_create_topic.clone();
    let unconfirmed = publish_all(&publisher, &topic, args, redis, &events).await?;
    let publish_secs = publish_started.elapsed().as_secs_f64();
    println!(
        "reserved {} in {reserve_secs:.2}s, published in {publish_secs:.2}s ({unconfirmed} unconfirmed)",
        events.len()
    );
    Ok((events.len(), unconfirmed))
}

/// Reserves `--messages` units in Redis as the API does; returns their events.
async fn reserve_all(
    settings: &Settings,
    args: &BacklogArgs,
    redis: &RedisStore,
) -> anyhow::Result<Vec<OrderCreateRequested>> {
    let valid_secs = settings.api.reservation_valid_secs;
    // 1. Reserve, as the API does.
    let reserved: Vec<anyhow::Result<Option<OrderCreateRequested>>> =
        futures::stream::iter(0..args.messages)
            .map(|i| {
                let redis = redis.clone();
                let args = &args;
                async move {
                    // In the buyer's home stock bucket, as the API reserves.
                    let user = args.first_user + i as i64;
                    let bucket = redis.home_shard(args.activity_id, user).await?.bucket;
                    let ids = Ids::generate(args.activity_id, bucket);
                    let request_id = format!("bl-{}", ids.reservation_id);
                    let (trace_id, span_id, traceparent) = new_traceparent();
                    let now_ms = Utc::now().timestamp_millis();
                    let a = ReserveArgs {
                        reservation: ReservationRef {
                            message_id: &ids.message_id,
                            request_id: &request_id,
                            reservation_id: &ids.reservation_id,
                            order_id: &ids.order_id,
                            activity_id: args.activity_id,
                            sku_id: args.sku_id + i as i64 % args.skus.max(1),
                            user_id: user,
                        },
                        now_ms,
                        // Not the scanner's to send while this bench sends it.
                        next_retry_at_ms: now_ms + 60_000,
                        traceparent: &traceparent,
                        valid_secs,
                        limits: Default::default(),
                        channel: "",
                        pass_id: "",
                    };
                    Ok(match redis.intake().reserve(&a).await? {
                        ReserveResult::Reserved(view) => {
                            Some(seckill::roles::api::reservation_event(
                                &a,
                                1,
                                view.valid_until_ms,
                                seckill::domain::SCHEMA_VERSION,
                                TraceContext {
                                    trace_id,
                                    span_id,
                                    traceparent: traceparent.clone(),
                                },
                            ))
                        }
                        _ => None,
                    })
                }
            })
            .buffer_unordered(64)
            .collect()
            .await;
    let mut events = Vec::with_capacity(args.messages);
    for r in reserved {
        if let Some(e) = r.context("reserving in Redis")? {
            events.push(e);
        }
    }
    anyhow::ensure!(
        !events.is_empty(),
        "no reservation succeeded: is activity {} SKU {} on sale with stock?",
        args.activity_id,
        args.sku_id
    );

    Ok(events)
}

/// Publishes the events in broker batches, then marks each confirmed reservation sent;
/// returns how many stayed unconfirmed.
async fn publish_all(
    publisher: &std::sync::Arc<dyn seckill::mq::Publisher>,
    topic: &str,
    args: &BacklogArgs,
    redis: &RedisStore,
    events: &[OrderCreateRequested],
) -> anyhow::Result<usize> {
    // 2. Publish in batches, then mark each confirmed reservation sent.
    let chunks: Vec<Vec<OrderCreateRequested>> = events
        .chunks(args.publish_batch.max(1))
        .map(<[OrderCreateRequested]>::to_vec)
        .collect();
    let outcomes: Vec<(Vec<OrderCreateRequested>, Vec<SendOutcome>)> =
        futures::stream::iter(chunks)
            .map(|chunk| {
                let publisher = publisher.clone();
                let topic = topic.to_string();
                async move {
                    let msgs = chunk
                        .iter()
                        .map(|e| order_create_message(&topic, e))
                        .collect();
                    let out = publisher.send_batch(msgs, 3_000).await;
                    (chunk, out)
                }
            })
            .buffer_unordered(4)
            .collect()
            .await;
    let mut unconfirmed = 0usize;
    let mut sent = Vec::new();
    for (chunk, outs) in outcomes {
        for (e, o) in chunk.into_iter().zip(outs) {
            match o {
                SendOutcome::Confirmed { broker_msg_id } => sent.push((e, broker_msg_id)),
                // Left MQ_PENDING: a running scanner re-sends it (same message_id).
                _ => unconfirmed += 1,
            }
        }
    }
    let now_ms = Utc::now().timestamp_millis();
    futures::stream::iter(&sent)
        .for_each_concurrent(64, |(e, broker_msg_id)| {
            let redis = redis.clone();
            async move {
                let _ = redis
                    .sends()
                    .mark_sent(
                        e.activity_id,
                        &e.reservation_id,
                        &e.message_id,
                        broker_msg_id,
                        now_ms,
                    )
                    .await;
            }
        })
        .await;
    Ok(unconfirmed)
}

/// Waits until PostgreSQL recorded `--messages` reservations of the activity, then reports.
async fn drain(
    settings: &Settings,
    args: &BacklogArgs,
    redis: &RedisStore,
) -> anyhow::Result<bool> {
    let pool = seckill::pg::connect_pool(&settings.pg, 1).await?;
    let pg = pool.get().await?;
    pg.batch_execute("SET statement_timeout = '120s'").await?;
    // The polling below costs PostgreSQL CPU too: its backend's share is not the order work's.
    let poller: i32 = pg.query_one("SELECT pg_backend_pid()", &[]).await?.get(0);
    let poller_before = crate::cpu::cpu_secs_of(poller as u32);
    let wal_before = wal_bytes(&pg).await?;
    let started = Instant::now();
    let cpu_before = cpu_snapshot(&args.cpu);
    let deadline = started + Duration::from_secs(args.drain_timeout_secs);
    let want = args.messages as i64;
    let last_sku = args.sku_id + args.skus.max(1) - 1;
    let drained = loop {
        let n: i64 = pg
            .query_one(
                "SELECT count(*) FROM reservations
                 WHERE activity_id = $1 AND sku_id BETWEEN $2 AND $3",
                &[&args.activity_id, &args.sku_id, &last_sku],
            )
            .await?
            .get(0);
        if n >= want {
            break true;
        }
        if Instant::now() >= deadline {
            eprintln!("drain timeout: {n} of {want} reservations recorded");
            break false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let drain_secs = started.elapsed().as_secs_f64();
    let wal = wal_bytes(&pg).await? - wal_before;
    let mut cpu = cpu_use(&args.cpu, &cpu_before, started.elapsed());
    let polling = crate::cpu::cpu_secs_of(poller as u32) - poller_before;
    if let Some(pg_cpu) = cpu.iter_mut().find(|c| c.name == "postgres") {
        pg_cpu.cpu_secs = (pg_cpu.cpu_secs - polling).max(0.0);
    }
    let r = crate::bench::order_rate(&pg, &[args.activity_id], args.sku_id, last_sku).await?;
    let (orders, span, orders_per_sec) = (r.orders, r.span_secs, r.rate);
    let group = settings.names().order_create_group.clone();
    let mut report = invariants::Report::default();
    for sku in args.sku_id..=last_sku {
        let r = invariants::check(&**pg, redis, &group, args.activity_id, sku)
            .await
            .context("invariant check")?;
        report.figures.add(&r.figures);
        report.violations.extend(r.violations);
    }
    if !drained {
        report
            .violations
            .push("not drained: some reservations never reached PostgreSQL".into());
    }
    let ok = report.ok();
    println!("orders   {orders} in {span:.2}s first to last: {orders_per_sec:.0} orders/s; all recorded after {drain_secs:.2}s");
    for v in &report.violations {
        println!("  - {v}");
    }
    println!(
        "{} {} messages={} orders={orders} orders_per_s={orders_per_sec:.0} span_s={span:.2} drain_s={drain_secs:.2}{} wal_bytes_per_order={:.0} violations={}",
        args.summary_prefix,
        if ok { "OK" } else { "FAILED" },
        args.messages,
        cpu_per_order(&cpu, orders),
        wal as f64 / orders.max(1) as f64,
        report.violations.len()
    );
    Ok(ok)
}

/// WAL bytes PostgreSQL has written (all databases: the drain is the only writer while it runs).
async fn wal_bytes(pg: &tokio_postgres::Client) -> anyhow::Result<i64> {
    let row = pg
        .query_one("SELECT wal_bytes::int8 FROM pg_stat_wal", &[])
        .await?;
    Ok(row.get(0))
}

/// ` cpu_us_per_order=<all> cpu_us_<name>=<each>`: the CPU each measured process spent over
/// the drain, in microseconds per order (empty without `--cpu`). The consumer's start is inside
/// the window (an upper bound of the steady state's); the drain's own polling is not.
fn cpu_per_order(cpu: &[crate::cpu::CpuUse], orders: i64) -> String {
    if cpu.is_empty() || orders <= 0 {
        return String::new();
    }
    let per = |secs: f64| secs * 1e6 / orders as f64;
    let total: f64 = cpu.iter().map(|c| c.cpu_secs).sum();
    let mut out = format!(" cpu_us_per_order={:.1}", per(total));
    for c in cpu {
        out.push_str(&format!(" cpu_us_{}={:.1}", c.name, per(c.cpu_secs)));
    }
    out
}
