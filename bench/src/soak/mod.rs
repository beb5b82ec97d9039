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

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use futures::StreamExt;
use hdrhistogram::Histogram;
use tokio::sync::Semaphore;

use crate::bench::{one_request, pay_one, Answer, PayAnswer, Planned};
use crate::cpu::{parse_cpu_target, CpuTarget};
use crate::wait::wait_progress;
use seckill::config::Settings;
use seckill::redis::RedisStore;

mod sample;

use sample::{sample, slope, Sample};

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

/// What the load's requests came to, shared by the request tasks.
#[derive(Default)]
struct Answers {
    accepted: Vec<String>,
    refused: BTreeMap<String, usize>,
    transport: usize,
}

pub async fn run(settings: Settings, args: SoakArgs) -> anyhow::Result<bool> {
    anyhow::ensure!(args.rate > 0.0, "--rate must be positive");
    anyhow::ensure!(args.duration_secs > 0, "--duration-secs must be positive");
    anyhow::ensure!(args.sample_secs > 0, "--sample-secs must be positive");
    let secret = settings
        .payments
        .webhook_secrets
        .first()
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("payments.webhook_secrets is empty: cannot pay"))?;
    let pool = seckill::pg::connect_pool(&settings.pg, 4).await?;
    let redis = RedisStore::connect(&settings.redis).await?;
    let lag = seckill::mq::rocketmq::LagProbe::new(
        &seckill::mq::runtime()?,
        &settings.mq.name_server_list(),
    )
    .await?;
    let n = seckill::mq::Names::of(&settings);
    let groups = [
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
    ];
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(args.concurrency)
        // The API closes a keep-alive connection idle for api.header_read_timeout_ms (5 s);
        // a pooled connection taken just as it does fails the request without an answer.
        // Dropped well before, it never is.
        .pool_idle_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(10))
        .build()?;
    let base = args.api.trim_end_matches('/').to_string();
    let started_at = chrono::Utc::now();
    let started = Instant::now();
    let total = (args.rate * args.duration_secs as f64).round() as usize;
    // Every run's buyers are new: user ids from the clock, far apart between runs.
    let first_user = started_at.timestamp_millis() * 1000;
    let run_tag = format!("s{}", ulid::Ulid::new());
    eprintln!(
        "soak: {total} reservations at {}/s for {} s, {} of the orders paid",
        args.rate, args.duration_secs, args.pay_share
    );

    let answers = Arc::new(Mutex::new(Answers::default()));
    let hist = Arc::new(Mutex::new(Histogram::<u64>::new_with_bounds(
        1, 60_000_000, 3,
    )?));
    let stop = tokio_util::sync::CancellationToken::new();

    // The payer: every second, the unpaid orders whose hash falls in the pay share.
    let payer = {
        let (pool, client, base, secret) = (pool.clone(), client.clone(), base.clone(), secret);
        let (stop, activity_id, share) = (stop.clone(), args.activity_id, args.pay_share);
        tokio::spawn(async move {
            let (mut paid, mut refused, mut late) = (0usize, 0usize, 0usize);
            let cut = (share.clamp(0.0, 1.0) * 1024.0).round() as i32;
            while !stop.is_cancelled() {
                let due: Vec<(String, i64)> = match pool.get().await {
                    Ok(c) => c
                        .query(
                            "SELECT order_id, amount_cents FROM orders
                             WHERE activity_id = $1 AND status = 'CREATED'
                               AND expires_at > now() + interval '2 seconds'
                               AND (hashtext(order_id) & 1023) < $2
                             LIMIT 5000",
                            &[&activity_id, &cut],
                        )
                        .await
                        .map(|rows| rows.iter().map(|r| (r.get(0), r.get(1))).collect())
                        .unwrap_or_default(),
                    Err(_) => Vec::new(),
                };
                let results: Vec<PayAnswer> = futures::stream::iter(due)
                    .map(|(order_id, cents)| {
                        let (client, base, secret) = (&client, &base, &secret);
                        async move { pay_one(client, base, secret, &order_id, cents).await }
                    })
                    .buffer_unordered(32)
                    .collect()
                    .await;
                // A notification that landed after its order's pay window closed is refused
                // (409) as it should be: on an overloaded machine the payer can be that late.
                // Only another refusal is a violation.
                for answer in results {
                    match answer {
                        PayAnswer::Paid => paid += 1,
                        PayAnswer::Late => late += 1,
                        PayAnswer::Refused => refused += 1,
                    }
                }
                tokio::select! {
                    _ = stop.cancelled() => {}
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
            (paid, refused, late)
        })
    };

    // The sampler: one SAMPLE line every --sample-secs until the settle is over.
    let sampler = {
        let (pool, stop) = (pool.clone(), stop.clone());
        let (procs, every, activity_id) = (
            args.procs.clone(),
            Duration::from_secs(args.sample_secs),
            args.activity_id,
        );
        let redis = redis.clone();
        tokio::spawn(async move {
            let mut samples: Vec<Sample> = Vec::new();
            let mut since = chrono::Utc::now();
            loop {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(every) => {}
                }
                let now = chrono::Utc::now();
                let line = match sample(
                    &pool,
                    &redis,
                    &lag,
                    &groups,
                    &procs,
                    activity_id,
                    since,
                    now,
                )
                .await
                {
                    Ok((line, anon)) => {
                        samples.push(Sample {
                            t: started.elapsed().as_secs_f64(),
                            anon_mib: anon,
                        });
                        line
                    }
                    Err(e) => format!("(not sampled: {e:#})"),
                };
                println!("SAMPLE t={:.0} {line}", started.elapsed().as_secs_f64());
                since = now;
            }
            lag.shutdown().await;
            samples
        })
    };

    // The load: an open loop, every request from a new buyer.
    let minter = crate::tokens::Minter::new(&settings, &args.signing)?;
    tracing::info!(tokens = %minter.label(), "buyers' tokens");
    let slots = Arc::new(Semaphore::new(args.concurrency.max(1)));
    let start = tokio::time::Instant::now();
    for i in 0..total {
        let due = start + Duration::from_secs_f64(i as f64 / args.rate);
        tokio::time::sleep_until(due).await;
        let slot = Arc::clone(&slots).acquire_owned().await?;
        let user_id = first_user + i as i64;
        let token = minter.mint(user_id)?;
        let p = Planned {
            activity_id: args.activity_id,
            user_id,
            sku_id: args.sku_id,
            request_id: format!("{run_tag}-{i}"),
            auth: Some(format!("Bearer {token}").into()),
        };
        let (client, base, answers, hist) =
            (client.clone(), base.clone(), answers.clone(), hist.clone());
        tokio::spawn(async move {
            let answer = one_request(&client, &base, &p).await;
            let us = (due.elapsed().as_micros() as u64).max(1);
            let _ = hist.lock().unwrap().record(us);
            let mut a = answers.lock().unwrap();
            match answer {
                Answer::Accepted { id, .. } => a.accepted.push(id),
                Answer::Refused(code) => *a.refused.entry(code).or_default() += 1,
                Answer::Transport | Answer::Timeout => a.transport += 1,
            }
            drop(slot);
        });
    }
    // Every request answered.
    let _all = slots.acquire_many(args.concurrency.max(1) as u32).await?;
    let load_secs = started.elapsed().as_secs_f64();
    let (accepted, refused, transport) = {
        let a = answers.lock().unwrap();
        (a.accepted.clone(), a.refused.clone(), a.transport)
    };
    eprintln!(
        "soak: load done in {load_secs:.0} s: {} accepted, refused {refused:?}, {transport} without answer",
        accepted.len()
    );

    let pg = pool.get().await?;
    pg.batch_execute("SET statement_timeout = '300s'").await?;
    let stall = Duration::from_secs(args.stall_secs);
    const EVERY: Duration = Duration::from_millis(500);
    let db: &tokio_postgres::Client = &pg;
    let (activity_id, n_accepted) = (args.activity_id, accepted.len() as i64);
    // Drain: every accepted reservation decided in PostgreSQL.
    let drained = wait_progress(stall, EVERY, "soak: drain", move || async move {
        let recorded: i64 = db
            .query_one(
                "SELECT count(*) FROM reservations WHERE activity_id = $1",
                &[&activity_id],
            )
            .await?
            .get(0);
        Ok((n_accepted - recorded).max(0))
    })
    .await?;
    // Settle: every order paid or cancelled, every compensation done.
    let settled = wait_progress(stall, EVERY, "soak: settle", move || async move {
        let row = db
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
    stop.cancel();
    let (paid, pay_refused, pay_late) = payer.await?;
    if pay_late > 0 {
        eprintln!("soak: {pay_late} payments landed after their order was cancelled (409, refused as they should be)");
    }
    let samples = sampler.await?;

    // The run's figures, from the database's own clocks.
    let row = pg
        .query_one(
            "SELECT count(*),
                    coalesce(extract(epoch FROM max(c.committed_at) - min(c.committed_at)), 0)::float8,
                    coalesce(percentile_cont(0.99) WITHIN GROUP (ORDER BY
                        extract(epoch FROM c.committed_at - o.reserved_at)), 0)::float8
             FROM orders o JOIN order_commits c USING (xact_id) WHERE o.activity_id = $1",
            &[&args.activity_id],
        )
        .await?;
    let (orders, create_span, order_p99): (i64, f64, f64) = (row.get(0), row.get(1), row.get(2));
    let row = pg
        .query_one(
            "SELECT count(*),
                    coalesce(extract(epoch FROM max(canceled_at) - min(canceled_at)), 0)::float8,
                    coalesce(percentile_cont(0.5) WITHIN GROUP (ORDER BY
                        extract(epoch FROM canceled_at - expires_at)), 0)::float8,
                    coalesce(percentile_cont(0.99) WITHIN GROUP (ORDER BY
                        extract(epoch FROM canceled_at - expires_at)), 0)::float8
             FROM orders WHERE activity_id = $1 AND status = 'CANCELED'",
            &[&args.activity_id],
        )
        .await?;
    let (canceled, cancel_span, cancel_p50, cancel_p99): (i64, f64, f64, f64) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    let per_s = |n: i64, span: f64| if span > 0.0 { n as f64 / span } else { 0.0 };
    let created_per_s = per_s(orders, create_span);
    let canceled_per_s = per_s(canceled, cancel_span);
    // Orders expire at the rate they were created, less the paid share.
    let expired_per_s = per_s(canceled, create_span);

    let mut violations: Vec<String> = Vec::new();
    let report = seckill::invariants::check(
        db,
        &redis,
        &n.order_create_group,
        args.activity_id,
        args.sku_id,
    )
    .await?;
    violations.extend(report.violations);
    if accepted.len() != total {
        violations.push(format!(
            "{} of {total} reservations accepted (every buyer is new and the stock is ample): refused {refused:?}, {transport} without answer",
            accepted.len()
        ));
    }
    if pay_refused > 0 {
        violations.push(format!(
            "{pay_refused} signed payment notifications refused"
        ));
    }
    if drained > 0 {
        violations.push(format!(
            "drain incomplete: {drained} reservations never decided"
        ));
    }
    if settled > 0 {
        violations.push(format!(
            "settle incomplete: {settled} orders unpaid and uncancelled or compensations pending"
        ));
    }
    if cancel_p99 > args.max_cancel_p99_secs {
        violations.push(format!(
            "expiry→cancel p99 {cancel_p99:.1} s > {} s",
            args.max_cancel_p99_secs
        ));
    }
    let mut slopes: Vec<String> = Vec::new();
    for (k, p) in args.procs.iter().enumerate() {
        let points: Vec<(f64, f64)> = samples
            .iter()
            .filter(|s| s.t >= load_secs * 2.0 / 3.0 && s.t <= load_secs)
            .filter_map(|s| s.anon_mib[k].map(|m| (s.t / 60.0, m)))
            .collect();
        match slope(&points) {
            Some(m) => {
                slopes.push(format!("{}:{m:.2}", p.name));
                if m > args.max_rss_slope_mib_per_min {
                    violations.push(format!(
                        "{}: anonymous memory still growing over the last third of the load, {m:.2} MiB/min",
                        p.name
                    ));
                }
            }
            None => slopes.push(format!("{}:n/a", p.name)),
        }
    }
    let api_p99_ms = {
        let h = hist.lock().unwrap();
        h.value_at_quantile(0.99) as f64 / 1000.0
    };
    for v in &violations {
        eprintln!("violation: {v}");
    }
    let ok = violations.is_empty();
    println!(
        "{} {} duration_s={} rate={} requests={total} accepted={} orders={orders} paid={paid} canceled={canceled} created_per_s={created_per_s:.0} canceled_per_s={canceled_per_s:.0} expired_per_s={expired_per_s:.0} cancel_p50_s={cancel_p50:.2} cancel_p99_s={cancel_p99:.2} order_p99_ms={:.0} api_p99_ms={api_p99_ms:.1} rss_slope_mib_per_min={} samples={} violations={}",
        args.summary_prefix,
        if ok { "OK" } else { "FAILED" },
        args.duration_secs,
        args.rate,
        accepted.len(),
        order_p99 * 1000.0,
        slopes.join(","),
        samples.len(),
        violations.len(),
    );
    Ok(ok)
}
