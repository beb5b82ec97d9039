//! `seckill-bench run`: the scenarios of `make bench`, in order, each a line kept under the
//! run directory's `lines/`, then the ratios (`crate::ratios`). `scripts/bench.sh` prepares
//! the services, builds, measures the machine's limits with pgbench and redis-benchmark
//! (`bench/limits/limits.sh`) and hands over to this; BENCHMARKS.md says what each scenario
//! is compared with.

mod burst;
mod ceilings;
mod costs;
mod fair;
mod pg_cpu;
mod procs;
mod relay;
mod scenarios;
mod tables;

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Context;
use seckill::config::Settings;

use crate::ratios::{Line, Part};
use crate::tokens::Provisioned;
use procs::Procs;

/// `seckill-bench run`.
#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// The `seckill` binary the roles run from.
    #[arg(long)]
    pub seckill: PathBuf,
    /// Logs, outputs, `lines/` and `summary.txt`.
    #[arg(long)]
    pub run_dir: PathBuf,
    /// The file whose last `LIMITS ...` line holds the machine's limits (limits.sh's output).
    #[arg(long)]
    pub limits: Option<PathBuf>,
    /// Smaller runs, for a smoke test.
    #[arg(long)]
    pub quick: bool,
    /// Only one part: `sale` (the sale's three runs, `make bench-sale`; last line
    /// SALE_RATIOS), `ceilings` (the front door's ceilings with wrk, `make bench-ceilings`;
    /// CEILING_RATIOS) or `orders` (pgbench's batch and the order consumer on a backlog,
    /// round by round, `make bench-orders`; ORDER_RATIOS) or `fair` (who gets the units of a
    /// contested start, `make bench-fair`; FAIR_RATIOS) or `crowd` (open-loop steps above the
    /// direct design's capacity, both designs, `make bench-crowd`; CROWD_RATIOS).
    #[arg(long, value_enum)]
    pub only: Option<Part>,
    /// Requests in flight from the load generator.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// The nice level of consume and scan (10 as shipped; 0 to compare without weights).
    #[arg(long, default_value_t = 10)]
    pub waiting_nice: i32,
    /// The crowd's steps: PostgreSQL's CPU, in cores, the same for both designs (a cgroup
    /// quota; a core of its own where no cgroup can be written). A quarter of a core leaves
    /// the rest of this two-core machine to the tiers that scale out (BENCHMARKS.md, "The
    /// crowd as it arrives": with half a core the pipeline's front saturated at 3x).
    #[arg(long, default_value_t = 0.25)]
    pub crowd_pg_cpu: f64,
    /// The algorithm the buyers' tokens are signed with (RS256, PS256, ES256, EdDSA), from a
    /// key generated for the run and published in the JWKS every server verifies with.
    #[arg(long, default_value = "RS256")]
    pub token_alg: String,
}

/// How big each part of the run is.
#[derive(Debug, Clone, Copy)]
pub struct Sizes {
    pub sale_requests: usize,
    pub sale_buyers: usize,
    pub sale_stock: i64,
    pub backlog: usize,
    pub backlog_single: usize,
    pub api_requests: usize,
    /// Pairs of pgbench's batch and the consumer's batched drain (the median kept).
    pub order_rounds: usize,
    /// The crowd's steps: seconds of arrivals each, the requests of the direct design's
    /// capacity run, and the most requests a step plans (the buyers whose tokens are signed
    /// beforehand).
    pub crowd_step_secs: f64,
    pub crowd_capacity_requests: usize,
    pub crowd_max_requests: usize,
}

impl Sizes {
    pub fn of(quick: bool) -> Self {
        if quick {
            Sizes {
                sale_requests: 10_000,
                sale_buyers: 6_000,
                sale_stock: 1_000,
                backlog: 5_000,
                backlog_single: 1_000,
                api_requests: 5_000,
                order_rounds: 1,
                crowd_step_secs: 2.0,
                crowd_capacity_requests: 3_000,
                crowd_max_requests: 20_000,
            }
        } else {
            Sizes {
                sale_requests: 100_000,
                sale_buyers: 60_000,
                sale_stock: 10_000,
                backlog: 30_000,
                backlog_single: 5_000,
                api_requests: 30_000,
                order_rounds: 3,
                crowd_step_secs: 4.0,
                crowd_capacity_requests: 6_000,
                crowd_max_requests: 120_000,
            }
        }
    }
}

/// The ports of `config/bench.toml`.
pub const API: &str = "http://127.0.0.1:28080";
pub const API_READY: &str = "http://127.0.0.1:28080/readyz";
pub const CONSUME_READY: &str = "http://127.0.0.1:29101/readyz";
pub const CONSUME_METRICS: &str = "http://127.0.0.1:29101/metrics";
pub const SCAN_READY: &str = "http://127.0.0.1:29102/readyz";
pub const BASELINE: &str = "http://127.0.0.1:28090";
pub const BASELINE_READY: &str = "http://127.0.0.1:28090/readyz";

/// One run: its processes, its database and the lines gathered so far.
pub struct Run {
    pub procs: Procs,
    pub sizes: Sizes,
    pub concurrency: usize,
    pub pg: tokio_postgres::Client,
    pub schema: String,
    pub lines: BTreeMap<&'static str, Line>,
    /// The run's configuration (`SECKILL_ENV=bench`), for signing the ceilings' tokens.
    pub settings: Settings,
    /// PostgreSQL's CPU during the crowd's steps, in cores.
    pub crowd_pg_cpu: f64,
}

impl Run {
    /// Keeps a scenario's line for the ratios.
    pub fn keep(&mut self, name: &'static str, line: Line) -> Line {
        self.lines.insert(name, line.clone());
        line
    }

    /// Writes every kept line to `lines/<name>` (what `seckill-bench ratios` reads).
    fn write_lines(&self) -> anyhow::Result<PathBuf> {
        let dir = self.procs.dir.join("lines");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        for (name, line) in &self.lines {
            std::fs::write(dir.join(name), format!("{}\n", line.text))?;
        }
        Ok(dir)
    }

    /// Waits (3 minutes at most) until the consumer has recorded at least `accepted`
    /// reservations of `activities`: the backlog a scenario left is orders before the next.
    pub async fn wait_recorded(&self, activities: &[i64], accepted: i64) {
        let ids: Vec<String> = activities.iter().map(|a| a.to_string()).collect();
        let sql = format!(
            "SELECT count(*) FROM {{s}}.reservations WHERE activity_id IN ({})",
            ids.join(", ")
        );
        let q = sql.as_str();
        procs::poll_until(
            std::time::Duration::from_secs(180),
            std::time::Duration::from_millis(200),
            || async move { self.count(q).await >= accepted },
        )
        .await;
    }

    /// `SELECT count(*) ...` on this run's schema (`{s}` in `sql` is the schema).
    pub async fn count(&self, sql: &str) -> i64 {
        let sql = sql.replace("{s}", &self.schema);
        match self.pg.query_one(sql.as_str(), &[]).await {
            Ok(row) => row.get(0),
            Err(e) => {
                eprintln!("[bench] count failed: {e}");
                -1
            }
        }
    }
}

pub async fn run(settings: Settings, args: RunArgs) -> anyhow::Result<bool> {
    let mut procs = Procs::new(
        args.seckill.clone(),
        args.run_dir.clone(),
        args.waiting_nice,
    )?;
    let keys = signing_keys(&args)?;
    procs.base_env = keys[0].env();
    procs.base_env.push((
        "SECKILL__AUTH__JWKS_FILE".into(),
        keys[0].jwks_file.display().to_string(),
    ));
    let (pg, conn) = seckill::pg::connect_one(&settings.pg).await?;
    tokio::spawn(conn);
    let mut run = Run {
        procs,
        sizes: Sizes::of(args.quick),
        concurrency: args.concurrency,
        pg,
        schema: settings.pg.schema.clone(),
        lines: BTreeMap::new(),
        settings: settings.clone(),
        crowd_pg_cpu: args.crowd_pg_cpu,
    };
    if args.only.is_none() {
        let limits = args
            .limits
            .as_ref()
            .context("--limits FILE is needed for a whole run")?;
        let text = std::fs::read_to_string(limits)?;
        let line = text
            .lines()
            .rfind(|l| l.starts_with("LIMITS "))
            .context("no LIMITS line in the limits output")?;
        run.keep("LIMITS", Line::parse(line));
    }
    let outcome = match args.only {
        Some(Part::Sale) => scenarios::only_sale(&mut run).await,
        Some(Part::Ceilings) => ceilings::only_ceilings(&mut run, &keys).await,
        Some(Part::Orders) => scenarios::only_orders(&mut run).await,
        Some(Part::Fair) => fair::fairness(&mut run).await,
        Some(Part::Relay) => scenarios::only_relay(&mut run).await,
        Some(Part::Crowd) => burst::crowd(&mut run, &keys).await,
        // The crowd last: it holds PostgreSQL to a share of the machine while it runs.
        None => match scenarios::whole(&mut run, &keys).await {
            Ok(()) => burst::crowd(&mut run, &keys).await,
            Err(e) => Err(e),
        },
    };
    // Whatever happened, nothing started here outlives the run.
    run.procs.stop_all().await;
    outcome?;
    let dir = run.write_lines()?;
    crate::ratios::run(crate::ratios::RatiosArgs {
        dir,
        only: args.only,
        summary: Some(run.procs.dir.join("summary.txt")),
    })
}

/// A key of every algorithm, generated for this run under `keys/` and published in one JWKS;
/// the `--token-alg` one first (the one the generators sign with).
fn signing_keys(args: &RunArgs) -> anyhow::Result<Vec<Provisioned>> {
    let main = seckill::auth::keygen::parse_algorithm(&args.token_alg).with_context(|| {
        format!(
            "--token-alg {}: RS256, PS256, ES256 or EdDSA",
            args.token_alg
        )
    })?;
    let mut algs = vec![main];
    algs.extend(
        seckill::auth::keygen::ALGORITHMS
            .into_iter()
            .filter(|a| *a != main),
    );
    Provisioned::generate(&args.run_dir.join("keys"), &algs)
}
