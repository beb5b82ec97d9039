//! `seckill bench`: a load generator against a running API, then a drain wait and the
//! invariant check. Closed loop: `--concurrency` buyers each send their next request as soon
//! as the previous one is answered. Latencies go into HDR histograms; the reservation→order
//! latency comes from the database's own timestamps (`orders.created_at - reserved_at`).

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Args;
use futures::StreamExt;
use hdrhistogram::Histogram;
use rand::Rng;
use serde::Serialize;
use tokio::sync::Mutex;

use crate::config::Settings;
use crate::invariants;
use crate::redis::RedisStore;

#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Base URL of a running `seckill api`.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub api: String,
    #[arg(long)]
    pub activity_id: i64,
    #[arg(long)]
    pub sku_id: i64,
    /// Total requests to send.
    #[arg(long, default_value_t = 20_000)]
    pub requests: usize,
    /// Distinct buyers (user ids 1..=buyers).
    #[arg(long, default_value_t = 15_000)]
    pub buyers: usize,
    /// Requests in flight at once (closed loop).
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Share of requests that repeat an earlier request (same user, same request_id).
    #[arg(long, default_value_t = 0.02)]
    pub dup_request_share: f64,
    /// Share of fresh requests from a buyer who already sent one (new request_id).
    #[arg(long, default_value_t = 0.05)]
    pub repeat_buyer_share: f64,
    /// Give up waiting for the consumer after this long.
    #[arg(long, default_value_t = 120)]
    pub drain_timeout_secs: u64,
    /// Share of created orders to pay through the API after the drain (the rest expire).
    #[arg(long, default_value_t = 0.0)]
    pub pay_share: f64,
    /// With `--pay-share`: wait this long for every unpaid order to be cancelled and every
    /// compensation to be done (needs `scan` and `timeout-cancel` running).
    #[arg(long, default_value_t = 120)]
    pub settle_timeout_secs: u64,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Prefix of the final machine-readable line (`DEMO` for `make demo`).
    #[arg(long, default_value = "BENCH")]
    pub summary_prefix: String,
}

/// One request of the plan.
#[derive(Debug, Clone)]
struct Planned {
    user_id: i64,
    request_id: String,
}

/// Builds the request plan: fresh buyers, repeat buyers and repeated requests, shuffled in time.
fn plan(args: &BenchArgs, run_tag: &str) -> Vec<Planned> {
    let mut rng = rand::rng();
    let mut out: Vec<Planned> = Vec::with_capacity(args.requests);
    let mut next_user: i64 = 1;
    for i in 0..args.requests {
        if !out.is_empty() && rng.random_bool(args.dup_request_share.clamp(0.0, 1.0)) {
            let prev = out[rng.random_range(0..out.len())].clone();
            out.push(prev);
            continue;
        }
        let fresh_left = (next_user as usize) <= args.buyers;
        let repeat = next_user > 1
            && (!fresh_left || rng.random_bool(args.repeat_buyer_share.clamp(0.0, 1.0)));
        let user_id = if repeat {
            rng.random_range(1..next_user)
        } else {
            next_user += 1;
            next_user - 1
        };
        out.push(Planned {
            user_id,
            request_id: format!("{run_tag}-{i}"),
        });
    }
    out
}

#[derive(Debug, Default, Serialize)]
pub struct BenchReport {
    pub requests: usize,
    pub accepted: usize,
    pub duplicate_requests: usize,
    pub sold_out: usize,
    pub already_purchased: usize,
    pub other_errors: BTreeMap<String, usize>,
    pub transport_errors: usize,
    pub elapsed_secs: f64,
    pub requests_per_sec: f64,
    pub accepted_per_sec: f64,
    pub api_p50_ms: f64,
    pub api_p99_ms: f64,
    pub api_p999_ms: f64,
    pub api_max_ms: f64,
    pub drained: bool,
    pub drain_secs: f64,
    pub orders: i64,
    pub rejected: i64,
    pub order_latency_p50_ms: f64,
    pub order_latency_p99_ms: f64,
    pub order_latency_max_ms: f64,
    pub within_3s_pct: f64,
    pub paid: usize,
    pub pay_errors: usize,
    pub canceled: i64,
    pub settled: bool,
    pub settle_secs: f64,
    pub invariants: invariants::Report,
}

struct Tally {
    hist: Histogram<u64>,
    accepted: HashSet<String>,
    duplicate_requests: usize,
    sold_out: usize,
    already_purchased: usize,
    other: BTreeMap<String, usize>,
    transport_errors: usize,
}

fn ms(h: &Histogram<u64>, q: f64) -> f64 {
    if h.is_empty() {
        0.0
    } else {
        h.value_at_quantile(q) as f64 / 1000.0
    }
}

/// Runs the load, waits for the drain and checks the invariants.
pub async fn run(settings: Settings, args: BenchArgs) -> anyhow::Result<bool> {
    anyhow::ensure!(args.concurrency > 0, "--concurrency must be at least 1");
    anyhow::ensure!(args.requests > 0, "--requests must be at least 1");
    let run_tag = format!("b{}", ulid::Ulid::new());
    let plan = Arc::new(plan(&args, &run_tag));
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(args.concurrency)
        .timeout(Duration::from_secs(10))
        .build()?;
    let url = format!(
        "{}/v1/activities/{}/skus/{}/reservations",
        args.api.trim_end_matches('/'),
        args.activity_id,
        args.sku_id
    );
    let next = Arc::new(AtomicUsize::new(0));
    let tally = Arc::new(Mutex::new(Tally {
        hist: Histogram::new_with_bounds(1, 60_000_000, 3)?,
        accepted: HashSet::new(),
        duplicate_requests: 0,
        sold_out: 0,
        already_purchased: 0,
        other: BTreeMap::new(),
        transport_errors: 0,
    }));
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..args.concurrency.min(args.requests) {
        let (client, url, plan, next, tally) = (
            client.clone(),
            url.clone(),
            plan.clone(),
            next.clone(),
            tally.clone(),
        );
        workers.spawn(async move {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("static bounds");
            let mut local = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(p) = plan.get(i) else { break };
                let body = serde_json::json!({"user_id": p.user_id, "request_id": p.request_id, "quantity": 1});
                let t = Instant::now();
                let resp = client.post(&url).json(&body).send().await;
                let outcome = match resp {
                    Ok(r) => {
                        let status = r.status().as_u16();
                        let v: serde_json::Value = r.json().await.unwrap_or_default();
                        Ok((status, v))
                    }
                    Err(e) => Err(e),
                };
                let _ = hist.record((t.elapsed().as_micros() as u64).max(1));
                local.push(outcome);
            }
            let mut t = tally.lock().await;
            let _ = t.hist.add(&hist);
            for o in local {
                match o {
                    Err(_) => t.transport_errors += 1,
                    Ok((202, v)) => {
                        if v["duplicate"].as_bool() == Some(true) {
                            t.duplicate_requests += 1;
                        }
                        if let Some(id) = v["reservation_id"].as_str() {
                            t.accepted.insert(id.to_string());
                        }
                    }
                    Ok((_, v)) => {
                        let code = v["error"]["code"].as_str().unwrap_or("UNPARSEABLE").to_string();
                        match code.as_str() {
                            "SOLD_OUT" => t.sold_out += 1,
                            "ALREADY_PURCHASED" => t.already_purchased += 1,
                            _ => *t.other.entry(code).or_default() += 1,
                        }
                    }
                }
            }
        });
    }
    while workers.join_next().await.is_some() {}
    let elapsed = started.elapsed();
    let t = tally.lock().await;
    let mut report = BenchReport {
        requests: args.requests,
        accepted: t.accepted.len(),
        duplicate_requests: t.duplicate_requests,
        sold_out: t.sold_out,
        already_purchased: t.already_purchased,
        other_errors: t.other.clone(),
        transport_errors: t.transport_errors,
        elapsed_secs: elapsed.as_secs_f64(),
        requests_per_sec: args.requests as f64 / elapsed.as_secs_f64(),
        accepted_per_sec: t.accepted.len() as f64 / elapsed.as_secs_f64(),
        api_p50_ms: ms(&t.hist, 0.5),
        api_p99_ms: ms(&t.hist, 0.99),
        api_p999_ms: ms(&t.hist, 0.999),
        api_max_ms: if t.hist.is_empty() {
            0.0
        } else {
            t.hist.max() as f64 / 1000.0
        },
        ..Default::default()
    };
    let accepted: Vec<String> = t.accepted.iter().cloned().collect();
    drop(t);

    // Drain: every accepted reservation has a recorded decision in PostgreSQL.
    let pool = crate::pg::connect_pool(&settings.pg, 2).await?;
    let pg = pool.get().await?;
    // The checks read whole tables; they are not bound by the hot path's statement timeout.
    pg.batch_execute("SET statement_timeout = '120s'").await?;
    let drain_started = Instant::now();
    let deadline = drain_started + Duration::from_secs(args.drain_timeout_secs);
    loop {
        let recorded: i64 = pg
            .query_one(
                "SELECT count(*) FROM reservations WHERE reservation_id = ANY($1::text[])",
                &[&accepted],
            )
            .await?
            .get(0);
        if recorded as usize >= accepted.len() {
            report.drained = true;
            break;
        }
        if Instant::now() >= deadline {
            eprintln!(
                "drain timeout: {recorded} of {} accepted reservations recorded",
                accepted.len()
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    report.drain_secs = drain_started.elapsed().as_secs_f64();

    let mut lat = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3)?;
    let rows = pg
        .query(
            "SELECT (extract(epoch FROM (created_at - reserved_at)) * 1000000)::int8
             FROM orders WHERE activity_id = $1 AND sku_id = $2",
            &[&args.activity_id, &args.sku_id],
        )
        .await?;
    let mut within = 0usize;
    for r in &rows {
        let us: i64 = r.get(0);
        if us <= 3_000_000 {
            within += 1;
        }
        let _ = lat.record(us.max(1) as u64);
    }
    report.orders = rows.len() as i64;
    report.order_latency_p50_ms = ms(&lat, 0.5);
    report.order_latency_p99_ms = ms(&lat, 0.99);
    report.order_latency_max_ms = if lat.is_empty() {
        0.0
    } else {
        lat.max() as f64 / 1000.0
    };
    report.within_3s_pct = if rows.is_empty() {
        100.0
    } else {
        within as f64 * 100.0 / rows.len() as f64
    };
    if args.pay_share > 0.0 {
        settle(&args, &client, &pg, &mut report).await?;
    }
    let redis = RedisStore::connect(&settings.redis).await?;
    report.invariants = invariants::check(
        &**pg,
        &redis,
        &settings.names().order_create_group,
        args.activity_id,
        args.sku_id,
    )
    .await
    .context("invariant check")?;
    report.rejected = report.invariants.figures.rejected;
    if !report.drained {
        report
            .invariants
            .violations
            .push("not drained: some accepted reservations never reached PostgreSQL".into());
    }

    if args.pay_share > 0.0 && !report.settled {
        report
            .invariants
            .violations
            .push("not settled: unpaid orders or compensations still pending".into());
    }
    let ok = report.invariants.ok() && report.transport_errors == 0;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_human(&report);
    }
    println!(
        "{} {} requests={} accepted={} orders={} rejected={} sold_out={} already_purchased={} duplicate_requests={} errors={} req_per_s={:.0} api_p50_ms={:.2} api_p99_ms={:.2} api_p999_ms={:.2} order_p50_ms={:.1} order_p99_ms={:.1} within_3s_pct={:.2} drain_s={:.2} paid={} canceled={} violations={}",
        args.summary_prefix,
        if ok { "OK" } else { "FAILED" },
        report.requests,
        report.accepted,
        report.orders,
        report.rejected,
        report.sold_out,
        report.already_purchased,
        report.duplicate_requests,
        report.transport_errors + report.other_errors.values().sum::<usize>(),
        report.requests_per_sec,
        report.api_p50_ms,
        report.api_p99_ms,
        report.api_p999_ms,
        report.order_latency_p50_ms,
        report.order_latency_p99_ms,
        report.within_3s_pct,
        report.drain_secs,
        report.paid,
        report.canceled,
        report.invariants.violations.len(),
    );
    Ok(ok)
}

/// Pays a share of the created orders through the API, then waits until every other order
/// was cancelled by the timeout path and every compensation is done.
async fn settle(
    args: &BenchArgs,
    client: &reqwest::Client,
    pg: &deadpool_postgres::Object,
    report: &mut BenchReport,
) -> anyhow::Result<()> {
    let orders: Vec<String> = pg
        .query(
            "SELECT order_id FROM orders WHERE activity_id = $1 AND sku_id = $2 AND status = 'CREATED'
             ORDER BY created_at",
            &[&args.activity_id, &args.sku_id],
        )
        .await?
        .into_iter()
        .map(|r| r.get(0))
        .collect();
    let to_pay = ((orders.len() as f64) * args.pay_share.clamp(0.0, 1.0)).round() as usize;
    let base = args.api.trim_end_matches('/').to_string();
    let results: Vec<bool> = futures::stream::iter(orders.into_iter().take(to_pay))
        .map(|order_id| {
            let (client, base) = (client.clone(), base.clone());
            async move {
                client
                    .post(format!("{base}/v1/orders/{order_id}/pay"))
                    .json(&serde_json::json!({"payment_id": format!("pay-{order_id}")}))
                    .send()
                    .await
                    .map(|r| r.status().is_success())
                    .unwrap_or(false)
            }
        })
        .buffer_unordered(args.concurrency.max(1))
        .collect()
        .await;
    report.paid = results.iter().filter(|ok| **ok).count();
    report.pay_errors = results.len() - report.paid;
    let started = Instant::now();
    let deadline = started + Duration::from_secs(args.settle_timeout_secs);
    loop {
        let row = pg
            .query_one(
                "SELECT (SELECT count(*) FROM orders WHERE activity_id = $1 AND sku_id = $2
                           AND status IN ('CREATED', 'PAYING')),
                        (SELECT count(*) FROM compensation_tasks WHERE activity_id = $1 AND sku_id = $2
                           AND status = 'PENDING'),
                        (SELECT count(*) FROM orders WHERE activity_id = $1 AND sku_id = $2
                           AND status = 'CANCELED')",
                &[&args.activity_id, &args.sku_id],
            )
            .await?;
        let (unpaid, pending, canceled): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
        report.canceled = canceled;
        if unpaid == 0 && pending == 0 {
            report.settled = true;
            break;
        }
        if Instant::now() >= deadline {
            eprintln!("settle timeout: {unpaid} unpaid orders, {pending} pending compensations");
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    report.settle_secs = started.elapsed().as_secs_f64();
    Ok(())
}

fn print_human(r: &BenchReport) {
    let f = &r.invariants.figures;
    println!(
        "requests           {} in {:.2}s ({:.0}/s)",
        r.requests, r.elapsed_secs, r.requests_per_sec
    );
    println!(
        "accepted (202)     {} ({:.0}/s), of which repeated request ids {}",
        r.accepted, r.accepted_per_sec, r.duplicate_requests
    );
    println!("sold out           {}", r.sold_out);
    println!("already purchased  {}", r.already_purchased);
    println!(
        "other errors       {:?}, transport errors {}",
        r.other_errors, r.transport_errors
    );
    println!(
        "API latency        p50 {:.2} ms  p99 {:.2} ms  p99.9 {:.2} ms  max {:.2} ms",
        r.api_p50_ms, r.api_p99_ms, r.api_p999_ms, r.api_max_ms
    );
    println!(
        "drain              {} in {:.2}s after the last request",
        if r.drained { "complete" } else { "INCOMPLETE" },
        r.drain_secs
    );
    println!(
        "orders             {} (rejected reservations {})",
        r.orders, r.rejected
    );
    if r.paid > 0 || r.canceled > 0 {
        println!(
            "payments           {} paid ({} failed), {} cancelled after expiry; settled: {} in {:.2}s",
            r.paid,
            r.pay_errors,
            r.canceled,
            if r.settled { "yes" } else { "NO" },
            r.settle_secs
        );
    }
    println!(
        "reservation→order  p50 {:.1} ms  p99 {:.1} ms  max {:.1} ms  within 3 s {:.2}%",
        r.order_latency_p50_ms, r.order_latency_p99_ms, r.order_latency_max_ms, r.within_3s_pct
    );
    println!(
        "stock              PG total {} remaining {} valid orders {} ledger {} | Redis total {} remaining {} live reservations {} in flight {}",
        f.pg_total, f.pg_remaining, f.valid_orders, f.ledger_sum, f.redis_total, f.redis_remaining, f.redis_reserved, f.unrecorded
    );
    if r.invariants.violations.is_empty() {
        println!("invariants: OK");
    } else {
        println!("invariants: {} VIOLATIONS", r.invariants.violations.len());
        for v in &r.invariants.violations {
            println!("  - {v}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(requests: usize, buyers: usize, dup: f64, repeat: f64) -> BenchArgs {
        BenchArgs {
            api: String::new(),
            activity_id: 1,
            sku_id: 1,
            requests,
            buyers,
            concurrency: 1,
            dup_request_share: dup,
            repeat_buyer_share: repeat,
            drain_timeout_secs: 1,
            pay_share: 0.0,
            settle_timeout_secs: 1,
            json: false,
            summary_prefix: "BENCH".into(),
        }
    }

    #[test]
    fn plan_respects_buyers_and_shares() {
        let p = plan(&args(10_000, 2_000, 0.0, 0.0), "t");
        assert_eq!(p.len(), 10_000);
        let users: HashSet<i64> = p.iter().map(|x| x.user_id).collect();
        assert_eq!(users.len(), 2_000);
        assert!(p.iter().all(|x| (1..=2_000).contains(&x.user_id)));
        let reqs: HashSet<&str> = p.iter().map(|x| x.request_id.as_str()).collect();
        assert_eq!(
            reqs.len(),
            10_000,
            "no repeated request ids without dup share"
        );

        let p = plan(&args(10_000, 10_000, 0.5, 0.0), "t");
        let reqs: HashSet<&str> = p.iter().map(|x| x.request_id.as_str()).collect();
        assert!(
            reqs.len() < 6_000,
            "about half repeat an earlier request: {}",
            reqs.len()
        );
    }
}
