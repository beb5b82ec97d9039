//! `seckill-bench load`: a load generator against a running API, then a drain wait and the
//! invariant check. Closed loop: `--concurrency` buyers each send their next request as soon
//! as the previous one is answered. Latencies go into HDR histograms; the reservation→order
//! latency comes from the database's own timestamps (`order_commits.committed_at - reserved_at`:
//! from Redis accepting the reservation to the end of the transaction that created the order).
//!
//! The plan of requests (`plan`), the load and its answers (`load`), the books read after it
//! (`books`) and the payments made after the drain (`pay`).

mod books;
mod load;
mod pay;
mod plan;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;

use crate::cpu::{cpu_snapshot, cpu_use, parse_cpu_target, CpuTarget};
use crate::report::{print_human, print_summary, BenchReport};
use crate::tokens::{Minter, SigningArgs};
use seckill::config::Settings;

use books::{check_history, judge, order_latencies, wait_drained};
use load::{api_bases, closed_loop, load_report, open_loop, strict_violations, Tally};
use pay::{pay_orders, wait_settled};
use plan::{buyers_per_sku, expected_accepted, plan, with_tokens};

pub use books::order_rate;
pub(crate) use load::{one_request, Answer};
pub(crate) use pay::{pay_one, PayAnswer};

#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Base URL of a running `seckill api`; several, comma-separated, take the requests (and
    /// the payments) in turn.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub api: String,
    /// The activity, or several (comma-separated or repeated: a sale of several drops at
    /// once, each with the same SKU ids); each fresh request picks one of them evenly.
    #[arg(long, value_delimiter = ',', required = true)]
    pub activity_id: Vec<i64>,
    /// The SKU, or with `--skus N` the first of N consecutive SKU ids.
    #[arg(long)]
    pub sku_id: i64,
    /// Spread the requests uniformly over this many SKUs (`--sku-id` .. `--sku-id + N - 1`).
    #[arg(long, default_value_t = 1)]
    pub skus: i64,
    /// With `--skus`: the SKUs' popularity falls as 1/rank^s (Zipf; the first SKU the most
    /// asked for) instead of evenly; 0 is even.
    #[arg(long, default_value_t = 0.0)]
    pub sku_zipf: f64,
    /// Seed of the plan: the same seed and arguments give the same buyers, SKUs and repeats in
    /// the same order (two designs compared on the same crowd). Without it: a fresh plan.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Buyers' tokens minted beforehand, one `user_id Bearer-value` per line
    /// (`crate::tokens::write_tokens_file`); buyers missing from it get a token minted here.
    #[arg(long)]
    pub tokens_file: Option<std::path::PathBuf>,
    /// A buyer gives up on an answer this long after the request's planned start (open loop:
    /// waiting for a free slot counts); counted as a timeout.
    #[arg(long, default_value_t = 10_000)]
    pub give_up_ms: u64,
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
    pub(crate) activity_id: i64,
    pub(crate) user_id: i64,
    pub(crate) sku_id: i64,
    pub(crate) request_id: String,
    /// `Authorization` value: the buyer's token, minted before the clock starts (`None` when
    /// the API believes the body's user_id).
    pub(crate) auth: Option<Arc<str>>,
}

/// Runs the load, waits for the drain and checks the invariants.
pub async fn run(settings: Settings, args: BenchArgs) -> anyhow::Result<bool> {
    check_args(&args)?;
    let run_tag = format!("b{}", ulid::Ulid::new());
    let mut plan = plan(&args, &run_tag);
    let minter = Minter::new(&settings, &args.signing)?;
    with_tokens(&settings, &minter, args.tokens_file.as_deref(), &mut plan)?;
    let plan = Arc::new(plan);
    let client = http_client(args.concurrency)?;
    let bases: Arc<Vec<String>> = Arc::new(api_bases(&args.api));
    anyhow::ensure!(!bases.is_empty(), "--api names no server");
    // The generator's own CPU beside the servers': a saturated generator shows.
    let mut cpu_targets = args.cpu.clone();
    cpu_targets.push(crate::cpu::CpuTarget {
        name: "generator".into(),
        pids: vec![std::process::id()],
    });
    let cpu_before = cpu_snapshot(&cpu_targets);
    let bench_started_at = chrono::Utc::now();
    let started = Instant::now();
    let (hist, answers, sent_by) = match args.rate {
        None => {
            let (hist, answers) = closed_loop(&client, &bases, &plan, args.concurrency).await?;
            (hist, answers, None)
        }
        Some(rate) => {
            let bounds = (args.concurrency, Duration::from_millis(args.give_up_ms));
            let (hist, answers, sent_by) = open_loop(&client, &bases, &plan, rate, bounds).await?;
            (hist, answers, Some(sent_by))
        }
    };
    let elapsed = started.elapsed();
    let cpu = cpu_use(&cpu_targets, &cpu_before, elapsed);
    let t = Tally::of(answers);
    let mut report = load_report(&args, &t, &hist, elapsed, cpu);
    report.sent_per_sec = sent_by.map(|d| args.requests as f64 / d.as_secs_f64().max(1e-3));
    if settings.auth.buyers == seckill::config::BuyerIdentity::Token {
        report.tokens = minter.label();
    }
    let buyers = buyers_per_sku(&plan);
    if args.load_only {
        return Ok(load_only_verdict(&args, &t, &buyers, &mut report));
    }
    let accepted: Vec<String> = t.accepted.iter().cloned().collect();
    let step = AfterLoad {
        settings: &settings,
        args: &args,
        client: &client,
        plan: &plan,
        tally: &t,
        buyers: &buyers,
        accepted: &accepted,
        // The last request's send: where the drain after the arrivals counts from.
        arrivals_ended: started + sent_by.unwrap_or(elapsed),
        bench_started_at,
    };
    let strict = step.run_retrying(&mut report).await?;
    // Each process's CPU from the load's start to the drain's end: what an order cost them.
    report.cpu_through_drain = cpu_use(&cpu_targets, &cpu_before, started.elapsed());
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

fn check_args(args: &BenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.concurrency > 0, "--concurrency must be at least 1");
    anyhow::ensure!(args.requests > 0, "--requests must be at least 1");
    anyhow::ensure!(args.skus > 0, "--skus must be at least 1");
    anyhow::ensure!(
        !args.activity_id.is_empty(),
        "--activity-id names no activity"
    );
    if let Some(rate) = args.rate {
        anyhow::ensure!(rate > 0.0, "--rate must be positive");
    }
    Ok(())
}

/// The load generator's HTTP client, `concurrency` connections kept.
pub(crate) fn http_client(concurrency: usize) -> anyhow::Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency)
        // The API closes a keep-alive connection idle for api.header_read_timeout_ms (5 s);
        // a pooled connection taken just as it does fails the request without an answer.
        // Dropped well before, it never is.
        .pool_idle_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(10))
        .build()?)
}

/// `--load-only`: the answers alone judge the run (what `--stock` lets the bench expect);
/// prints the summary line.
fn load_only_verdict(
    args: &BenchArgs,
    t: &Tally,
    buyers: &BTreeMap<(i64, i64), usize>,
    report: &mut BenchReport,
) -> bool {
    let stock: BTreeMap<(i64, i64), i64> = match args.stock {
        Some(n) => buyers.keys().map(|&key| (key, n)).collect(),
        None => BTreeMap::new(),
    };
    let expected = args.stock.map(|_| expected_accepted(buyers, &stock));
    if !args.tolerate_faults {
        report.invariants.violations = strict_violations(t, expected);
    }
    let ok = report.invariants.violations.is_empty()
        && (report.transport_errors == 0 || args.tolerate_faults);
    print_summary(&args.summary_prefix, ok, report);
    ok
}

/// Everything after the load that reads the stores: the drain, the latencies, the settle
/// (payments made once), the verdict and the history check.
struct AfterLoad<'a> {
    settings: &'a Settings,
    args: &'a BenchArgs,
    client: &'a reqwest::Client,
    plan: &'a [Planned],
    tally: &'a Tally,
    buyers: &'a BTreeMap<(i64, i64), usize>,
    accepted: &'a [String],
    arrivals_ended: Instant,
    bench_started_at: chrono::DateTime<chrono::Utc>,
}

impl AfterLoad<'_> {
    /// [`AfterLoad::run`]; under injected faults a store may be restarting right now: the
    /// reads are retried (payments are made once) until the drain timeout.
    async fn run_retrying(&self, report: &mut BenchReport) -> anyhow::Result<Vec<String>> {
        let retry_until = Instant::now() + Duration::from_secs(self.args.drain_timeout_secs);
        let mut paid_done = false;
        loop {
            match self.run(report, &mut paid_done).await {
                Ok(strict) => return Ok(strict),
                Err(e) if self.args.tolerate_faults && Instant::now() < retry_until => {
                    eprintln!("the stores did not answer after the load ({e:#}); retrying in 2 s");
                    tokio::time::sleep(Duration::from_secs(2)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

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
        let stock: BTreeMap<(i64, i64), i64> = pg
            .query(
                "SELECT activity_id, sku_id, total_stock::int8 FROM activity_skus
                 WHERE activity_id = ANY($1::int8[])",
                &[&self.args.activity_id],
            )
            .await?
            .iter()
            .map(|r| ((r.get(0), r.get(1)), r.get(2)))
            .collect();
        let strict = strict_violations(self.tally, Some(expected_accepted(self.buyers, &stock)));
        wait_drained(&pg, (self.accepted, self.arrivals_ended), self.args, report).await?;
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
