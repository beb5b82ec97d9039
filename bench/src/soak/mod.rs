//! `seckill-bench soak`: a long sale at a steady rate, watched while it runs.
//!
//! An open loop sends `--rate` reservations a second for `--duration-secs`, every one from a
//! new buyer (the SKU's stock is sized by `scripts/soak.sh` so it never sells out). While it
//! runs, a payer pays `--pay-share` of the orders through signed notifications within their
//! pay window (the others expire and are cancelled), and every `--sample-secs` a sampler
//! prints one SAMPLE line: the memory of every process (`--proc`), Redis's, the sizes of the
//! PostgreSQL tables, each consumer group's lag and oldest age, the orders created and
//! cancelled in the interval with their reservation→order and expiry→cancel ages, and the
//! orders overdue for a cancel. After the load it waits for the drain and the settle (both
//! give up only when progress stops), checks the invariants and prints one line:
//!
//! `SOAK OK|FAILED duration_s=… created_per_s=… canceled_per_s=… cancel_p50_s=… cancel_p99_s=…
//! rss_slope_mib_per_min=api:…,consume:… … violations=N`
//!
//! It fails on a violation, on an expiry→cancel p99 above `--max-cancel-p99-secs`, on a
//! process whose anonymous memory still grows over the last third of the run faster than
//! `--max-rss-slope-mib-per-min`, and on a drain or settle that did not complete.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Args;

use crate::cpu::{parse_cpu_target, CpuTarget};
use crate::wait::wait_progress;
use seckill::config::Settings;
use seckill::redis::RedisStore;

mod load;
mod report;
mod sample;

use report::Figures;
use sample::Sampler;

#[derive(Debug, Clone, Args)]
pub struct SoakArgs {
    /// Base URL of a running `seckill api`.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub api: String,
    #[arg(long)]
    pub activity_id: i64,
    #[arg(long, default_value_t = 1)]
    pub sku_id: i64,
    /// How long the load lasts.
    #[arg(long, default_value_t = 600)]
    pub duration_secs: u64,
    /// Reservations per second, on a fixed schedule (open loop), each from a new buyer.
    #[arg(long, default_value_t = 300.0)]
    pub rate: f64,
    /// Requests outstanding at most.
    #[arg(long, default_value_t = 256)]
    pub concurrency: usize,
    /// Share of the orders paid within their pay window (chosen by a hash of the order id).
    #[arg(long, default_value_t = 0.5)]
    pub pay_share: f64,
    /// Seconds between two samples.
    #[arg(long, default_value_t = 15)]
    pub sample_secs: u64,
    /// A process whose memory is sampled: `name=pid` or `name=pid+pid+…` (repeatable).
    #[arg(long = "proc", value_parser = parse_cpu_target)]
    pub procs: Vec<CpuTarget>,
    /// Fails when the p99 from an order's deadline to its cancel is above this.
    #[arg(long, default_value_t = 5.0)]
    pub max_cancel_p99_secs: f64,
    /// Fails when a process's anonymous memory grows faster than this over the last third.
    #[arg(long, default_value_t = 2.0)]
    pub max_rss_slope_mib_per_min: f64,
    /// The drain and the settle give up after this long without progress.
    #[arg(long, default_value_t = 120)]
    pub stall_secs: u64,
    /// Prefix of the final line.
    #[arg(long, default_value = "SOAK")]
    pub summary_prefix: String,
    #[command(flatten)]
    pub signing: crate::tokens::SigningArgs,
}

pub async fn run(settings: Settings, args: SoakArgs) -> anyhow::Result<bool> {
    anyhow::ensure!(args.rate > 0.0, "--rate must be positive");
    anyhow::ensure!(args.duration_secs > 0, "--duration-secs must be positive");
    anyhow::ensure!(args.sample_secs > 0, "--sample-secs must be positive");
    let secret = settings.payments.webhook_secrets.first().cloned();
    let secret = secret.context("payments.webhook_secrets is empty: cannot pay")?;
    let pool = seckill::pg::connect_pool(&settings.pg, 4).await?;
    let redis = RedisStore::connect(&settings.redis).await?;
    let lag = seckill::mq::rocketmq::LagProbe::new(
        &seckill::mq::runtime()?,
        &settings.mq.name_server_list(),
    )
    .await?;
    let client = crate::bench::http_client(args.concurrency)?;
    let base = args.api.trim_end_matches('/').to_string();
    let started = Instant::now();
    let total = (args.rate * args.duration_secs as f64).round() as usize;
    eprintln!(
        "soak: {total} reservations at {}/s for {} s, {} of the orders paid",
        args.rate, args.duration_secs, args.pay_share
    );
    let stop = tokio_util::sync::CancellationToken::new();
    let payer = load::Payer {
        pool: pool.clone(),
        client: client.clone(),
        base: base.clone(),
        secret,
        activity_id: args.activity_id,
        share: args.pay_share,
    }
    .spawn(stop.clone());
    let sampler = Sampler {
        pool: pool.clone(),
        redis: redis.clone(),
        lag,
        groups: groups(&settings),
        procs: args.procs.clone(),
        activity_id: args.activity_id,
    }
    .spawn(Duration::from_secs(args.sample_secs), started, stop.clone());
    let load = load::open_loop(&settings, &args, &client, &base, total).await?;
    let pg = pool.get().await?;
    let pg: &tokio_postgres::Client = &pg;
    pg.batch_execute("SET statement_timeout = '300s'").await?;
    let left = wait_out(pg, &args, load.accepted.len() as i64).await?;
    stop.cancel();
    let pay = payer.await?;
    if pay.late > 0 {
        eprintln!(
            "soak: {} payments landed after their order was cancelled (409, refused as they should be)",
            pay.late
        );
    }
    let samples = sampler.await?;
    let figures = Figures::read(pg, args.activity_id).await?;
    let violations = seckill::invariants::check(
        pg,
        &redis,
        &settings.names().order_create_group,
        args.activity_id,
        args.sku_id,
    )
    .await?
    .violations;
    let verdict = report::Verdict {
        args: &args,
        total,
        load: &load,
        pay: &pay,
        left,
        figures: &figures,
        samples: &samples,
    };
    Ok(verdict.conclude(violations))
}

/// `(name on the SAMPLE line, consumer group, its topic)` of each group the sampler watches.
fn groups(settings: &Settings) -> Vec<(&'static str, String, String)> {
    let n = settings.names();
    vec![
        (
            "order_create",
            n.order_create_group.clone(),
            n.order_create_topic.clone(),
        ),
        (
            "compensate",
            n.compensate_group.clone(),
            n.compensate_topic.clone(),
        ),
        (
            "projection",
            n.projection_group.clone(),
            n.order_event_topic.clone(),
        ),
        (
            "timeout",
            n.timeout_group.clone(),
            n.order_timeout_topic.clone(),
        ),
    ]
}

/// What is left after the load: reservations never decided (the drain) and orders neither
/// paid nor cancelled or compensations pending (the settle). Each waits while it progresses.
async fn wait_out(
    pg: &tokio_postgres::Client,
    args: &SoakArgs,
    n_accepted: i64,
) -> anyhow::Result<report::Left> {
    let stall = Duration::from_secs(args.stall_secs);
    const EVERY: Duration = Duration::from_millis(500);
    let activity_id = args.activity_id;
    let drained = wait_progress(stall, EVERY, "soak: drain", move || async move {
        let recorded: i64 = pg
            .query_one(
                "SELECT count(*) FROM reservations WHERE activity_id = $1",
                &[&activity_id],
            )
            .await?
            .get(0);
        Ok((n_accepted - recorded).max(0))
    })
    .await?;
    let settled = wait_progress(stall, EVERY, "soak: settle", move || async move {
        let row = pg
            .query_one(
                "SELECT (SELECT count(*) FROM orders WHERE activity_id = $1
                           AND status IN ('CREATED', 'PAYING')),
                        (SELECT count(*) FROM compensation_tasks WHERE activity_id = $1
                           AND status = 'PENDING')",
                &[&activity_id],
            )
            .await?;
        Ok(row.get::<_, i64>(0) + row.get::<_, i64>(1))
    })
    .await?;
    Ok(report::Left { drained, settled })
}
