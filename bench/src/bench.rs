//! `seckill-bench load`: a load generator against a running API, then a drain wait and the
//! invariant check. Closed loop: `--concurrency` buyers each send their next request as soon
//! as the previous one is answered. Latencies go into HDR histograms; the reservation→order
//! latency comes from the database's own timestamps (`order_commits.committed_at - reserved_at`:
//! from Redis accepting the reservation to the end of the transaction that created the order).

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Args;
use futures::StreamExt;
use hdrhistogram::Histogram;
use rand::Rng;
use tokio::sync::Semaphore;

use crate::cpu::{cpu_snapshot, cpu_use, parse_cpu_target, CpuTarget};
use crate::report::{ms, print_human, print_summary, BenchReport};
use crate::tokens::{Minter, SigningArgs};
use seckill::config::Settings;
use seckill::invariants;
use seckill::redis::RedisStore;

#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Base URL of a running `seckill api`; several, comma-separated, take the requests (and
    /// the payments) in turn.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub api: String,
    #[arg(long)]
    pub activity_id: i64,
    /// The SKU, or with `--skus N` the first of N consecutive SKU ids.
    #[arg(long)]
    pub sku_id: i64,
    /// Spread the requests uniformly over this many SKUs (`--sku-id` .. `--sku-id + N - 1`).
    #[arg(long, default_value_t = 1)]
    pub skus: i64,
    /// Open loop: send this many requests per second on a fixed schedule, whatever the answers
    /// take (latency counts from each request's planned start, so a stall is not hidden);
    /// `--concurrency` then bounds the requests outstanding. Without it: closed loop.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Report the CPU each process used during the load: `name=pid` or `name=pid+pid+...`
    /// (repeatable), e.g. `--cpu api=1234 --cpu postgres=$(pgrep -d+ postgres)`.
    #[arg(long = "cpu", value_parser = parse_cpu_target)]
    pub cpu: Vec<CpuTarget>,
    /// Label of the scenario, printed in the summary line.
    #[arg(long, default_value = "hot-sku")]
    pub scenario: String,
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
    /// Give up waiting for the consumer after this long without progress (no new decision
    /// recorded); a drain that keeps progressing is waited for however long it takes.
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
    /// Only the load: no drain, no database figures, no invariants (for a server that is not
    /// `seckill api`, such as `seckill-bench baseline-api`).
    #[arg(long)]
    pub load_only: bool,
    /// Faults are being injected (chaos): lost answers and 5xx are counted, not failures, and
    /// the invariants are re-checked until they hold or `--drain-timeout-secs` passes.
    #[arg(long)]
    pub tolerate_faults: bool,
    /// Stock of each SKU, for the strict verdict of a `--load-only` run (otherwise it is read
    /// from PostgreSQL): exactly min(stock, distinct buyers) reservations must be accepted.
    #[arg(long)]
    pub stock: Option<i64>,
    /// Prefix of the final machine-readable line (`DEMO` for `make demo`).
    #[arg(long, default_value = "BENCH")]
    pub summary_prefix: String,
    #[command(flatten)]
    pub signing: SigningArgs,
}

/// One request of the plan.
#[derive(Debug, Clone)]
pub(crate) struct Planned {
    pub(crate) user_id: i64,
    pub(crate) sku_id: i64,
    pub(crate) request_id: String,
    /// `Authorization` value: the buyer's token, minted before the clock starts (`None` when
    /// the API believes the body's user_id).
    pub(crate) auth: Option<Arc<str>>,
}

/// Gives every planned request its buyer's token (one token per buyer, as a shop's login
/// would hand out), signed before the clock starts.
fn with_tokens(settings: &Settings, minter: &Minter, plan: &mut [Planned]) -> anyhow::Result<()> {
    if settings.auth.buyers != seckill::config::BuyerIdentity::Token {
        return Ok(());
    }
    let users: Vec<i64> = plan
        .iter()
        .map(|p| p.user_id)
        .collect::<HashSet<_>>()
        .into_iter()
        .collect();
    let tokens = minter.bearer_for(&users)?;
    for p in plan.iter_mut() {
        p.auth = tokens.get(&p.user_id).cloned();
    }
    Ok(())
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
            sku_id: args.sku_id + rng.random_range(0..args.skus.max(1)),
            request_id: format!("{run_tag}-{i}"),
            auth: None,
        });
    }
    out
}

/// Distinct buyers asking for each SKU of the plan (one reservation per buyer per SKU).
fn buyers_per_sku(plan: &[Planned]) -> BTreeMap<i64, usize> {
    let mut pairs: BTreeMap<i64, HashSet<i64>> = BTreeMap::new();
    for p in plan {
        pairs.entry(p.sku_id).or_default().insert(p.user_id);
    }
    pairs
        .into_iter()
        .map(|(sku, users)| (sku, users.len()))
        .collect()
}

/// What a sale without faults must accept: min(stock, distinct buyers) for every SKU.
fn expected_accepted(buyers: &BTreeMap<i64, usize>, stock: &BTreeMap<i64, i64>) -> usize {
    buyers
        .iter()
        .map(|(sku, &n)| n.min(stock.get(sku).copied().unwrap_or(0).max(0) as usize))
        .sum()
}

/// The strict verdict of a sale without injected faults: every request answered, every answer
/// one the sale expects (202, SOLD_OUT, ALREADY_PURCHASED; no 5xx, no throttling, no pause),
/// and exactly the expected number accepted, which is never zero when stock and buyers exist.
fn strict_violations(t: &Tally, expected: Option<usize>) -> Vec<String> {
    let mut v = Vec::new();
    if t.transport_errors > 0 {
        v.push(format!("{} requests got no answer", t.transport_errors));
    }
    if !t.other.is_empty() {
        v.push(format!("unexpected answers: {:?}", t.other));
    }
    match expected {
        Some(n) if t.accepted.len() != n => v.push(format!(
            "accepted {} reservations, expected min(stock, distinct buyers) = {n}",
            t.accepted.len()
        )),
        None if t.accepted.is_empty() => v.push("nothing was accepted".into()),
        _ => {}
    }
    v
}

/// Error answers after which the reservation may or may not exist (the API could not tell).
const UNKNOWN_OUTCOME: [&str; 3] = ["UNAVAILABLE", "INTERNAL", "UNPARSEABLE"];

#[derive(Default)]
struct Tally {
    /// Plan indexes of the requests whose outcome the client cannot know: no answer (a
    /// connection error, a timeout) or a failure past the point of no return.
    unknown: Vec<usize>,
    accepted: HashSet<String>,
    duplicate_requests: usize,
    sold_out: usize,
    already_purchased: usize,
    other: BTreeMap<String, usize>,
    transport_errors: usize,
}

/// What one reservation request came to.
pub(crate) enum Answer {
    Accepted {
        id: String,
        duplicate: bool,
    },
    /// An error answer, by its stable code.
    Refused(String),
    Transport,
}

pub(crate) async fn one_request(client: &reqwest::Client, base: &str, p: &Planned) -> Answer {
    let body = serde_json::json!({"user_id": p.user_id, "request_id": p.request_id, "quantity": 1});
    let mut req = client
        .post(format!("{base}/{}/reservations", p.sku_id))
        .json(&body);
    if let Some(auth) = &p.auth {
        req = req.header("authorization", &**auth);
    }
    let resp = req.send().await;
    match resp {
        Err(e) => {
            tracing::warn!(request_id = %p.request_id, error = %e, "reservation request without answer");
            Answer::Transport
        }
        Ok(r) => {
            let status = r.status().as_u16();
            let v: serde_json::Value = r.json().await.unwrap_or_default();
            match (status, v["reservation_id"].as_str()) {
                (202, Some(id)) => Answer::Accepted {
                    id: id.to_owned(),
                    duplicate: v["duplicate"].as_bool() == Some(true),
                },
                _ => Answer::Refused(
                    v["error"]["code"]
                        .as_str()
                        .unwrap_or("UNPARSEABLE")
                        .to_owned(),
                ),
            }
        }
    }
}

fn latency_histogram() -> anyhow::Result<Histogram<u64>> {
    Ok(Histogram::new_with_bounds(1, 60_000_000, 3)?)
}

/// The base URLs of `--api` (comma-separated), without a trailing `/`.
fn api_bases(api: &str) -> Vec<String> {
    api.split(',')
        .map(|a| a.trim().trim_end_matches('/').to_string())
        .filter(|a| !a.is_empty())
        .collect()
}

/// `concurrency` buyers, each sending its next request when the previous one is answered.
async fn closed_loop(
    client: &reqwest::Client,
    bases: &Arc<Vec<String>>,
    plan: &Arc<Vec<Planned>>,
    concurrency: usize,
) -> anyhow::Result<(Histogram<u64>, Vec<(usize, Answer)>)> {
    let next = Arc::new(AtomicUsize::new(0));
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..concurrency.min(plan.len()) {
        let (client, bases, plan, next) =
            (client.clone(), bases.clone(), plan.clone(), next.clone());
        workers.spawn(async move {
            let mut hist = latency_histogram()?;
            let mut answers = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(p) = plan.get(i) else { break };
                let t = Instant::now();
                answers.push((i, one_request(&client, &bases[i % bases.len()], p).await));
                hist.record((t.elapsed().as_micros() as u64).max(1))?;
            }
            anyhow::Ok((hist, answers))
        });
    }
    let mut hist = latency_histogram()?;
    let mut answers = Vec::with_capacity(plan.len());
    while let Some(done) = workers.join_next().await {
        let (h, a) = done??;
        hist.add(&h)?;
        answers.extend(a);
    }
    Ok((hist, answers))
}

/// Requests start on a fixed schedule (`rate` per second) whatever the answers take; at most
/// `max_outstanding` are in flight. Latency counts from the planned start, so time spent
/// waiting for a free slot is part of it (no coordinated omission).
async fn open_loop(
    client: &reqwest::Client,
    bases: &Arc<Vec<String>>,
    plan: &Arc<Vec<Planned>>,
    rate: f64,
    max_outstanding: usize,
) -> anyhow::Result<(Histogram<u64>, Vec<(usize, Answer)>)> {
    let slots = Arc::new(Semaphore::new(max_outstanding.max(1)));
    let mut requests = tokio::task::JoinSet::new();
    let start = tokio::time::Instant::now();
    for i in 0..plan.len() {
        let due = start + Duration::from_secs_f64(i as f64 / rate);
        tokio::time::sleep_until(due).await;
        let slot = Arc::clone(&slots).acquire_owned().await?;
        let (client, base, plan) = (client.clone(), bases[i % bases.len()].clone(), plan.clone());
        requests.spawn(async move {
            let answer = one_request(&client, &base, &plan[i]).await;
            drop(slot);
            ((due.elapsed().as_micros() as u64).max(1), (i, answer))
        });
    }
    let mut hist = latency_histogram()?;
    let mut answers = Vec::with_capacity(plan.len());
    while let Some(done) = requests.join_next().await {
        let (us, a) = done?;
        hist.record(us)?;
        answers.push(a);
    }
    Ok((hist, answers))
}

/// Runs the load, waits for the drain and checks the invariants.
pub async fn run(settings: Settings, args: BenchArgs) -> anyhow::Result<bool> {
    anyhow::ensure!(args.concurrency > 0, "--concurrency must be at least 1");
    anyhow::ensure!(args.requests > 0, "--requests must be at least 1");
    anyhow::ensure!(args.skus > 0, "--skus must be at least 1");
    if let Some(rate) = args.rate {
        anyhow::ensure!(rate > 0.0, "--rate must be positive");
    }
    let run_tag = format!("b{}", ulid::Ulid::new());
    let mut plan = plan(&args, &run_tag);
    let minter = Minter::new(&settings, &args.signing)?;
    with_tokens(&settings, &minter, &mut plan)?;
    let plan = Arc::new(plan);
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(args.concurrency)
        // The API closes a keep-alive connection idle for api.header_read_timeout_ms (5 s);
        // a pooled connection taken just as it does fails the request without an answer.
        // Dropped well before, it never is.
        .pool_idle_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(10))
        .build()?;
    let bases: Arc<Vec<String>> = Arc::new(
        api_bases(&args.api)
            .iter()
            .map(|api| format!("{api}/v1/activities/{}/skus", args.activity_id))
            .collect(),
    );
    anyhow::ensure!(!bases.is_empty(), "--api names no server");
    let cpu_before = cpu_snapshot(&args.cpu);
    let bench_started_at = chrono::Utc::now();
    let started = Instant::now();
    let (hist, answers) = match args.rate {
        None => closed_loop(&client, &bases, &plan, args.concurrency).await?,
        Some(rate) => open_loop(&client, &bases, &plan, rate, args.concurrency).await?,
    };
    let elapsed = started.elapsed();
    let cpu = cpu_use(&args.cpu, &cpu_before, elapsed);
    let t = Tally::of(answers);
    let mut report = load_report(&args, &t, &hist, elapsed, cpu);
    if settings.auth.buyers == seckill::config::BuyerIdentity::Token {
        report.tokens = minter.label();
    }
    let buyers = buyers_per_sku(&plan);
    if args.load_only {
        let stock: BTreeMap<i64, i64> = match args.stock {
            Some(n) => buyers.keys().map(|&sku| (sku, n)).collect(),
            None => BTreeMap::new(),
        };
        let expected = args.stock.map(|_| expected_accepted(&buyers, &stock));
        if !args.tolerate_faults {
            report.invariants.violations = strict_violations(&t, expected);
        }
        let ok = report.invariants.violations.is_empty()
            && (report.transport_errors == 0 || args.tolerate_faults);
        print_summary(&args.summary_prefix, ok, &report);
        return Ok(ok);
    }
    let accepted: Vec<String> = t.accepted.iter().cloned().collect();

    // Under injected faults a store may be restarting right now: the reads after the load are
    // retried (payments are made once) until the drain timeout.
    let retry_until = Instant::now() + Duration::from_secs(args.drain_timeout_secs);
    let mut paid_done = false;
    let strict = loop {
        let step = AfterLoad {
            settings: &settings,
            args: &args,
            client: &client,
            plan: &plan,
            tally: &t,
            buyers: &buyers,
            accepted: &accepted,
            bench_started_at,
        };
        match step.run(&mut report, &mut paid_done).await {
            Ok(strict) => break strict,
            Err(e) if args.tolerate_faults && Instant::now() < retry_until => {
                eprintln!("the stores did not answer after the load ({e:#}); retrying in 2 s");
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            Err(e) => return Err(e),
        }
    };
    if !args.tolerate_faults {
        report.invariants.violations.extend(strict);
        if report.pay_errors > 0 {
            report.invariants.violations.push(format!(
                "{} signed payment notifications were refused",
                report.pay_errors
            ));
        }
    }
    let ok = report.invariants.ok() && (report.transport_errors == 0 || args.tolerate_faults);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_human(&report);
    }
    print_summary(&args.summary_prefix, ok, &report);
    Ok(ok)
}

/// Everything after the load that reads the stores: the drain, the latencies, the settle
/// (payments made once), the verdict and the history check.
struct AfterLoad<'a> {
    settings: &'a Settings,
    args: &'a BenchArgs,
    client: &'a reqwest::Client,
    plan: &'a [Planned],
    tally: &'a Tally,
    buyers: &'a BTreeMap<i64, usize>,
    accepted: &'a [String],
    bench_started_at: chrono::DateTime<chrono::Utc>,
}

impl AfterLoad<'_> {
    /// Returns the strict verdict's violations (applied only without injected faults).
    async fn run(
        &self,
        report: &mut BenchReport,
        paid_done: &mut bool,
    ) -> anyhow::Result<Vec<String>> {
        let pool = seckill::pg::connect_pool(&self.settings.pg, 2).await?;
        let pg = pool.get().await?;
        // The checks read whole tables; they are not bound by the hot path's statement timeout.
        pg.batch_execute("SET statement_timeout = '120s'").await?;
        let stock: BTreeMap<i64, i64> = pg
            .query(
                "SELECT sku_id, total_stock::int8 FROM activity_skus WHERE activity_id = $1",
                &[&self.args.activity_id],
            )
            .await?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        let strict = strict_violations(self.tally, Some(expected_accepted(self.buyers, &stock)));
        wait_drained(&pg, self.accepted, self.args, report).await?;
        order_latencies(&pg, self.args, report).await?;
        if self.args.pay_share > 0.0 {
            let last_sku = self.args.sku_id + self.args.skus - 1;
            if !*paid_done {
                pay_orders(self.settings, self.args, self.client, &pg, report, last_sku).await?;
                *paid_done = true;
            }
            wait_settled(self.args, &pg, report, last_sku).await?;
        }
        judge(self.settings, &pg, self.args, self.bench_started_at, report).await?;
        let history = check_history(
            self.settings,
            &pg,
            self.args,
            self.plan,
            self.accepted,
            &self.tally.unknown,
            &report.invariants.figures,
        )
        .await?;
        report.lost = history.lost;
        report.doubled = history.doubled;
        report.leaked = history.leaked;
        report.unknown = self.tally.unknown.len();
        report.invariants.violations.extend(history.violations);
        Ok(strict)
    }
}

impl Tally {
    fn of(answers: Vec<(usize, Answer)>) -> Self {
        let mut t = Tally::default();
        for (i, a) in answers {
            match a {
                Answer::Transport => {
                    t.transport_errors += 1;
                    t.unknown.push(i);
                }
                Answer::Accepted { id, duplicate } => {
                    if duplicate {
                        t.duplicate_requests += 1;
                    }
                    t.accepted.insert(id);
                }
                Answer::Refused(code) => match code.as_str() {
                    "SOLD_OUT" => t.sold_out += 1,
                    "ALREADY_PURCHASED" => t.already_purchased += 1,
                    _ => {
                        // A failure past the point of no return may or may not have reserved.
                        if UNKNOWN_OUTCOME.contains(&code.as_str()) {
                            t.unknown.push(i);
                        }
                        *t.other.entry(code).or_default() += 1
                    }
                },
            }
        }
        t
    }
}

/// What the load phase measured.
fn load_report(
    args: &BenchArgs,
    t: &Tally,
    hist: &Histogram<u64>,
    elapsed: Duration,
    cpu: Vec<crate::cpu::CpuUse>,
) -> BenchReport {
    BenchReport {
        scenario: args.scenario.clone(),
        mode: if args.rate.is_some() {
            "open"
        } else {
            "closed"
        }
        .into(),
        tokens: "none".into(),
        target_rate: args.rate,
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
        sold_out_per_sec: t.sold_out as f64 / elapsed.as_secs_f64(),
        api_p50_ms: ms(hist, 0.5),
        api_p99_ms: ms(hist, 0.99),
        api_p999_ms: ms(hist, 0.999),
        api_max_ms: if hist.is_empty() {
            0.0
        } else {
            hist.max() as f64 / 1000.0
        },
        cpu,
        ..Default::default()
    }
}

/// Drain: waits until every accepted reservation has a recorded decision in PostgreSQL. The
/// wait scales with the backlog: it gives up only after `--drain-timeout-secs` without a
/// single new decision recorded, however long the drain takes while it makes progress.
async fn wait_drained(
    pg: &tokio_postgres::Client,
    accepted: &[String],
    args: &BenchArgs,
    report: &mut BenchReport,
) -> anyhow::Result<()> {
    let drain_started = Instant::now();
    let stall = Duration::from_secs(args.drain_timeout_secs);
    let (mut last, mut progressed) = (-1i64, Instant::now());
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
        if recorded > last {
            (last, progressed) = (recorded, Instant::now());
        } else if progressed.elapsed() >= stall {
            eprintln!(
                "drain stalled: {recorded} of {} accepted reservations recorded, none in the last {} s",
                accepted.len(),
                stall.as_secs()
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    report.drain_secs = drain_started.elapsed().as_secs_f64();
    Ok(())
}

/// Reservation→order latencies (to the end of the order's transaction) and the order rate,
/// from the database's own timestamps.
async fn order_latencies(
    pg: &tokio_postgres::Client,
    args: &BenchArgs,
    report: &mut BenchReport,
) -> anyhow::Result<()> {
    let mut lat = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3)?;
    let last_sku = args.sku_id + args.skus - 1;
    let rows = pg
        .query(
            "SELECT (extract(epoch FROM (coalesce(c.committed_at, o.created_at) - o.reserved_at))
                     * 1000000)::int8
             FROM orders o LEFT JOIN order_commits c USING (xact_id)
             WHERE o.activity_id = $1 AND o.sku_id BETWEEN $2 AND $3",
            &[&args.activity_id, &args.sku_id, &last_sku],
        )
        .await?;
    report.orders_per_sec = order_rate(pg, args.activity_id, args.sku_id, last_sku)
        .await?
        .rate;
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
    report.order_latency_p999_ms = ms(&lat, 0.999);
    report.order_latency_max_ms = if lat.is_empty() {
        0.0
    } else {
        lat.max() as f64 / 1000.0
    };
    // No orders is not "every order within 3 s".
    report.within_3s_pct = if rows.is_empty() {
        0.0
    } else {
        within as f64 * 100.0 / rows.len() as f64
    };
    Ok(())
}

/// The verdict: the invariants of every SKU (after convergence when faults were injected),
/// nothing left behind, everything drained and settled.
async fn judge(
    settings: &Settings,
    pg: &tokio_postgres::Client,
    args: &BenchArgs,
    bench_started_at: chrono::DateTime<chrono::Utc>,
    report: &mut BenchReport,
) -> anyhow::Result<()> {
    let redis = RedisStore::connect(&settings.redis).await?;
    let group = seckill::mq::Names::of(settings).order_create_group;
    let converge_until = Instant::now() + Duration::from_secs(args.drain_timeout_secs);
    loop {
        report.invariants = check_skus(pg, &redis, &group, args).await?;
        // Under injected faults, reservations whose answer was lost are still on their way
        // (the scanner re-sends them): wait for the pipeline to converge before judging.
        if !args.tolerate_faults || report.invariants.ok() || Instant::now() >= converge_until {
            break;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    // Nothing may be left behind: no dead letter, no outbox row given up on.
    let row = pg
        .query_one(
            "SELECT (SELECT count(*) FROM dlq_messages WHERE status = 'OPEN' AND first_seen >= $1),
                    (SELECT count(*) FROM event_outbox WHERE status = 'DEAD' AND created_at >= $1)",
            &[&bench_started_at],
        )
        .await?;
    report.dlq_open = row.get(0);
    report.outbox_dead = row.get(1);
    if report.dlq_open > 0 || report.outbox_dead > 0 {
        report.invariants.violations.push(format!(
            "left behind: {} dead letters, {} dead outbox rows",
            report.dlq_open, report.outbox_dead
        ));
    }
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
    Ok(())
}

/// What a reservation the client knows of came to, after the drain and the settle.
#[derive(Debug, PartialEq)]
enum Fate {
    /// Exactly one order (live, paid, or cancelled with its one compensation), or exactly one
    /// compensated rejection.
    Settled,
    /// PostgreSQL never recorded it.
    Unrecorded,
    /// Anything else: a record without its order, a rejection without its compensation, a
    /// live order whose unit was also released...
    ThirdState,
}

/// The fate of a reservation from its statuses: (reservation, order, compensation task).
fn fate(states: (Option<&str>, Option<&str>, Option<&str>)) -> Fate {
    match states {
        (None, _, _) => Fate::Unrecorded,
        (Some("ORDERED"), Some("CANCELED"), Some(_)) => Fate::Settled,
        (Some("ORDERED"), Some(o), None) if o != "CANCELED" => Fate::Settled,
        (Some("REJECTED"), None, Some(_)) => Fate::Settled,
        _ => Fate::ThirdState,
    }
}

/// What the client's own history says about the stores after the drain and the settle.
#[derive(Debug, Default)]
struct History {
    /// 202s that never became a record, and unknown answers that hold stock without one.
    lost: usize,
    /// Valid orders beyond one per buyer per SKU.
    doubled: i64,
    /// Units neither sold (a valid order) nor available again (Redis remaining).
    leaked: i64,
    violations: Vec<String>,
}

/// Checks every request against the stores, as only the client can: every 202 became exactly
/// one order (live, paid, or cancelled with its one compensation) or exactly one compensated
/// rejection; every request whose outcome the client could not know (no answer, a failure past
/// the point of no return) became nothing that holds stock, or exactly one of those. Then the
/// sale's books: nothing left unrecorded, no compensation pending, nothing quarantined, no unit
/// leaked. Each failure is named.
async fn check_history(
    settings: &Settings,
    pg: &tokio_postgres::Client,
    args: &BenchArgs,
    plan: &[Planned],
    accepted: &[String],
    unknown: &[usize],
    figures: &invariants::SkuFigures,
) -> anyhow::Result<History> {
    let mut h = History::default();
    let redis = RedisStore::connect(&settings.redis).await?;
    // The unknown requests PostgreSQL recorded, by request id (unique within a run).
    let unknown_req: Vec<String> = unknown
        .iter()
        .map(|&i| plan[i].request_id.clone())
        .collect();
    let recorded: std::collections::HashMap<String, String> = pg
        .query(
            "SELECT request_id, reservation_id FROM reservations
             WHERE activity_id = $1 AND request_id = ANY($2::text[])",
            &[&args.activity_id, &unknown_req],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    // Unknown and unrecorded: fine if Redis holds no stock for it (never reserved, or released).
    let mut held = Vec::new();
    for &i in unknown {
        let p = &plan[i];
        if recorded.contains_key(&p.request_id) {
            continue;
        }
        let rid = redis
            .request_reservation(args.activity_id, p.user_id, &p.request_id)
            .await?;
        if let Some(rid) = rid {
            let fields = redis.reservation(args.activity_id, &rid).await?;
            if fields.get("status").map(String::as_str) == Some("RESERVED") {
                held.push(rid);
            }
        }
    }
    if !held.is_empty() {
        h.violations.push(format!(
            "{} unknown answers left a reservation holding stock with no record in PostgreSQL: {:?}",
            held.len(),
            &held[..held.len().min(10)]
        ));
    }
    // Every reservation the client knows of, and what it became.
    let mut ids: Vec<String> = accepted.to_vec();
    ids.extend(recorded.into_values());
    ids.sort();
    ids.dedup();
    let (mut unrecorded_202, mut third_state) = (Vec::new(), Vec::new());
    for row in pg
        .query(
            "SELECT a.id, r.status, o.status, c.status
             FROM unnest($1::text[]) AS a(id)
             LEFT JOIN reservations r ON r.reservation_id = a.id
             LEFT JOIN orders o ON o.reservation_id = a.id
             LEFT JOIN compensation_tasks c ON c.reservation_id = a.id",
            &[&ids],
        )
        .await?
    {
        let id: String = row.get(0);
        let (reservation, order, compensation): (Option<String>, Option<String>, Option<String>) =
            (row.get(1), row.get(2), row.get(3));
        let states = (
            reservation.as_deref(),
            order.as_deref(),
            compensation.as_deref(),
        );
        match fate(states) {
            Fate::Settled => {}
            Fate::Unrecorded => unrecorded_202.push(id),
            Fate::ThirdState => third_state.push(format!("{id}: {states:?}")),
        }
    }
    if !unrecorded_202.is_empty() {
        h.violations.push(format!(
            "lost: {} reservations answered 202 never reached PostgreSQL: {:?}",
            unrecorded_202.len(),
            &unrecorded_202[..unrecorded_202.len().min(10)]
        ));
    }
    if !third_state.is_empty() {
        h.violations.push(format!(
            "{} reservations are neither one order nor one compensated rejection (reservation, order, compensation): {:?}",
            third_state.len(),
            &third_state[..third_state.len().min(10)]
        ));
    }
    h.lost = unrecorded_202.len() + held.len();
    h.doubled = pg
        .query_one(
            "SELECT count(*) - count(DISTINCT (sku_id, user_id)) FROM orders
             WHERE activity_id = $1 AND status <> 'CANCELED'",
            &[&args.activity_id],
        )
        .await?
        .get(0);
    if h.doubled > 0 {
        h.violations.push(format!(
            "doubled: {} valid orders beyond one per buyer",
            h.doubled
        ));
    }
    // The books of the sale, after the drain and the settle.
    // The figures `judge` read just before, after the drain and the settle.
    let f = figures;
    h.leaked = f.pg_total - f.valid_orders - f.redis_remaining;
    if h.leaked != 0 {
        h.violations.push(format!(
            "leaked: {} units neither sold ({} valid orders) nor available again ({} left in Redis) of {}",
            h.leaked, f.valid_orders, f.redis_remaining, f.pg_total
        ));
    }
    if f.unrecorded > 0 {
        h.violations.push(format!(
            "{} reservations still hold stock in Redis without a record in PostgreSQL",
            f.unrecorded
        ));
    }
    if f.pending_compensations > 0 {
        h.violations.push(format!(
            "{} compensations still pending",
            f.pending_compensations
        ));
    }
    if f.quarantined > 0 {
        h.violations.push(format!(
            "{} messages quarantined by the order consumer",
            f.quarantined
        ));
    }
    Ok(h)
}

/// The invariants of every SKU of the run, as one report.
async fn check_skus(
    pg: &tokio_postgres::Client,
    redis: &RedisStore,
    group: &str,
    args: &BenchArgs,
) -> anyhow::Result<invariants::Report> {
    let mut all = invariants::Report::default();
    for sku in args.sku_id..args.sku_id + args.skus {
        let r = invariants::check(pg, redis, group, args.activity_id, sku)
            .await
            .context("invariant check")?;
        if sku == args.sku_id {
            all = r;
        } else {
            all.figures.add(&r.figures);
            all.violations.extend(r.violations);
        }
    }
    Ok(all)
}

/// Orders of some SKUs of an activity, and how fast they were created.
pub struct OrderRate {
    pub orders: i64,
    /// Seconds from the first to the last order's commit (`order_commits.committed_at`).
    pub span_secs: f64,
    /// Orders per second over that span (0 with fewer than two orders).
    pub rate: f64,
}

/// Order creation rate from the database's own timestamps, first to last commit (an order
/// written before migration V6 has no commit stamp: its `created_at` stands in).
pub async fn order_rate(
    pg: &tokio_postgres::Client,
    activity_id: i64,
    first_sku: i64,
    last_sku: i64,
) -> anyhow::Result<OrderRate> {
    let row = pg
        .query_one(
            "SELECT count(*), coalesce(extract(epoch FROM max(t) - min(t)), 0)::float8
             FROM (SELECT coalesce(c.committed_at, o.created_at) AS t
                   FROM orders o LEFT JOIN order_commits c USING (xact_id)
                   WHERE o.activity_id = $1 AND o.sku_id BETWEEN $2 AND $3) AS committed",
            &[&activity_id, &first_sku, &last_sku],
        )
        .await?;
    let (orders, span_secs): (i64, f64) = (row.get(0), row.get(1));
    let rate = if span_secs > 0.0 {
        (orders - 1).max(0) as f64 / span_secs
    } else {
        0.0
    };
    Ok(OrderRate {
        orders,
        span_secs,
        rate,
    })
}

/// Pays `--pay-share` of the created orders through signed payment notifications, newest
/// first: those have the most of their pay window left, so on a slow machine the payments do
/// not reach orders the timeout already cancelled (a late payment is refused with 409, which
/// the report counts as a refusal).
async fn pay_orders(
    settings: &Settings,
    args: &BenchArgs,
    client: &reqwest::Client,
    pg: &deadpool_postgres::Object,
    report: &mut BenchReport,
    last_sku: i64,
) -> anyhow::Result<()> {
    let orders: Vec<(String, i64)> = pg
        .query(
            "SELECT order_id, amount_cents FROM orders
             WHERE activity_id = $1 AND sku_id BETWEEN $2 AND $3 AND status = 'CREATED'
             ORDER BY created_at DESC",
            &[&args.activity_id, &args.sku_id, &last_sku],
        )
        .await?
        .into_iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let secret = settings
        .payments
        .webhook_secrets
        .first()
        .ok_or_else(|| anyhow::anyhow!("payments.webhook_secrets is empty: cannot pay"))?
        .clone();
    let to_pay = ((orders.len() as f64) * args.pay_share.clamp(0.0, 1.0)).round() as usize;
    let bases = api_bases(&args.api);
    let results: Vec<PayAnswer> =
        futures::stream::iter(orders.into_iter().take(to_pay).enumerate())
            .map(|(k, (order_id, amount_cents))| {
                let base = bases[k % bases.len()].clone();
                let (client, secret) = (client.clone(), secret.clone());
                async move { pay_one(&client, &base, &secret, &order_id, amount_cents).await }
            })
            .buffer_unordered(args.concurrency.max(1))
            .collect()
            .await;
    report.paid = results.iter().filter(|a| **a == PayAnswer::Paid).count();
    report.pay_errors = results.len() - report.paid;
    Ok(())
}

/// What the API answered a signed payment notification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PayAnswer {
    Paid,
    /// 409 `ORDER_CANCELED` / `ORDER_EXPIRED`: the order's pay window had closed when the
    /// notification landed. Refused as it should be; a slow payer, not a fault.
    Late,
    /// Any other refusal, or no answer after every retry.
    Refused,
}

/// Pays one order through a signed notification, as the provider would: `payment_id` =
/// `pay-<order_id>`. A notification that got no answer or a 5xx is sent again (signed afresh)
/// until it is answered, up to 20 times over ~10 s.
pub(crate) async fn pay_one(
    client: &reqwest::Client,
    base: &str,
    secret: &secrecy::SecretString,
    order_id: &str,
    amount_cents: i64,
) -> PayAnswer {
    let body = serde_json::json!({
        "order_id": order_id,
        "payment_id": format!("pay-{order_id}"),
        "amount_cents": amount_cents,
    })
    .to_string();
    for attempt in 0..20 {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let t = chrono::Utc::now().timestamp();
        let sig = seckill::auth::signature::sign(secret, t, body.as_bytes());
        let sent = client
            .post(format!("{base}/v1/payments/notifications"))
            .header("content-type", "application/json")
            .header("seckill-signature", sig)
            .body(body.clone())
            .send()
            .await;
        match sent {
            Ok(r) if r.status().is_server_error() => continue,
            Ok(r) if r.status().is_success() => return PayAnswer::Paid,
            Ok(r) if r.status() == reqwest::StatusCode::CONFLICT => {
                let body: serde_json::Value = r.json().await.unwrap_or_default();
                let code = body["error"]["code"].as_str().unwrap_or_default();
                return if matches!(code, "ORDER_CANCELED" | "ORDER_EXPIRED") {
                    PayAnswer::Late
                } else {
                    PayAnswer::Refused
                };
            }
            Ok(_) => return PayAnswer::Refused,
            Err(_) => continue,
        }
    }
    PayAnswer::Refused
}

/// Waits until every unpaid order is cancelled and every compensation done.
async fn wait_settled(
    args: &BenchArgs,
    pg: &deadpool_postgres::Object,
    report: &mut BenchReport,
    last_sku: i64,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let deadline = started + Duration::from_secs(args.settle_timeout_secs);
    loop {
        let row = pg
            .query_one(
                "SELECT (SELECT count(*) FROM orders WHERE activity_id = $1
                           AND sku_id BETWEEN $2 AND $3 AND status IN ('CREATED', 'PAYING')),
                        (SELECT count(*) FROM compensation_tasks WHERE activity_id = $1
                           AND sku_id BETWEEN $2 AND $3 AND status = 'PENDING'),
                        (SELECT count(*) FROM orders WHERE activity_id = $1
                           AND sku_id BETWEEN $2 AND $3 AND status = 'CANCELED')",
                &[&args.activity_id, &args.sku_id, &last_sku],
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

#[cfg(test)]
mod tests {
    use super::*;

    fn args(requests: usize, buyers: usize, dup: f64, repeat: f64) -> BenchArgs {
        BenchArgs {
            api: String::new(),
            activity_id: 1,
            sku_id: 1,
            skus: 1,
            rate: None,
            cpu: Vec::new(),
            scenario: "test".into(),
            requests,
            buyers,
            concurrency: 1,
            dup_request_share: dup,
            repeat_buyer_share: repeat,
            drain_timeout_secs: 1,
            pay_share: 0.0,
            settle_timeout_secs: 1,
            json: false,
            tolerate_faults: false,
            load_only: false,
            stock: None,
            summary_prefix: "BENCH".into(),
            signing: crate::tokens::SigningArgs {
                signing_key: String::new(),
                signing_kid: String::new(),
                signing_alg: String::new(),
            },
        }
    }

    fn tally(accepted: usize, other: &[(&str, usize)], transport_errors: usize) -> Tally {
        Tally {
            accepted: (0..accepted).map(|i| format!("rsv_{i}")).collect(),
            other: other.iter().map(|(c, n)| (c.to_string(), *n)).collect(),
            transport_errors,
            ..Tally::default()
        }
    }

    #[test]
    fn every_reservation_is_one_order_or_one_compensated_rejection() {
        for ok in [
            (Some("ORDERED"), Some("CREATED"), None),
            (Some("ORDERED"), Some("PAID"), None),
            (Some("ORDERED"), Some("CANCELED"), Some("DONE")),
            (Some("REJECTED"), None, Some("DONE")),
        ] {
            assert_eq!(fate(ok), Fate::Settled, "{ok:?}");
        }
        assert_eq!(fate((None, None, None)), Fate::Unrecorded);
        // No order; cancelled but never released; paid and released; rejected but never
        // compensated; rejected and ordered.
        for bad in [
            (Some("ORDERED"), None, None),
            (Some("ORDERED"), Some("CANCELED"), None),
            (Some("ORDERED"), Some("PAID"), Some("DONE")),
            (Some("REJECTED"), None, None),
            (Some("REJECTED"), Some("CREATED"), Some("DONE")),
        ] {
            assert_eq!(fate(bad), Fate::ThirdState, "{bad:?}");
        }
    }

    #[test]
    fn a_sale_without_faults_must_accept_exactly_min_stock_and_buyers_per_sku() {
        let plan: Vec<Planned> = [(1, 1), (2, 1), (2, 1), (3, 2), (4, 2), (5, 2)]
            .iter()
            .map(|&(user_id, sku_id)| Planned {
                user_id,
                sku_id,
                request_id: format!("r{user_id}"),
                auth: None,
            })
            .collect();
        let buyers = buyers_per_sku(&plan);
        assert_eq!(buyers, BTreeMap::from([(1, 2), (2, 3)]));
        // SKU 1: 2 buyers, 5 units -> 2; SKU 2: 3 buyers, 1 unit -> 1.
        let stock = BTreeMap::from([(1, 5), (2, 1)]);
        assert_eq!(expected_accepted(&buyers, &stock), 3);
        assert!(strict_violations(&tally(3, &[], 0), Some(3)).is_empty());
        // One short (an answer lost, a buyer turned away) or one too many: both fail.
        assert_eq!(strict_violations(&tally(2, &[], 0), Some(3)).len(), 1);
        assert_eq!(strict_violations(&tally(4, &[], 0), Some(3)).len(), 1);
        // Any 5xx, throttling or pause, or a request without an answer, fails.
        assert_eq!(
            strict_violations(&tally(3, &[("SALE_PAUSED", 1)], 0), Some(3)).len(),
            1
        );
        assert_eq!(strict_violations(&tally(3, &[], 1), Some(3)).len(), 1);
        // Nothing accepted with nothing to compare with is a failure; a sold-out SKU is not.
        assert_eq!(strict_violations(&tally(0, &[], 0), None).len(), 1);
        assert!(strict_violations(&tally(0, &[], 0), Some(0)).is_empty());
    }

    #[test]
    fn plan_respects_buyers_and_shares() {
        let p = plan(&args(10_000, 2_000, 0.0, 0.0), "t");
        assert_eq!(p.len(), 10_000);
        let users: HashSet<i64> = p.iter().map(|x| x.user_id).collect();
        assert!(p.iter().all(|x| x.sku_id == 1));
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

    #[test]
    fn several_apis_are_taken_in_turn_without_trailing_slashes() {
        assert_eq!(
            api_bases("http://a:1/, http://b:2"),
            vec!["http://a:1".to_string(), "http://b:2".to_string()]
        );
        assert!(api_bases(" , ").is_empty());
    }

    #[test]
    fn many_skus_spread_the_plan_over_consecutive_ids() {
        let mut a = args(1000, 1000, 0.0, 0.0);
        a.sku_id = 10;
        a.skus = 4;
        let p = plan(&a, "t");
        let skus: HashSet<i64> = p.iter().map(|x| x.sku_id).collect();
        assert_eq!(skus, HashSet::from([10, 11, 12, 13]));
    }
}
