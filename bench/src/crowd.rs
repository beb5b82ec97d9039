//! `seckill-bench crowd`: who gets the units of a contested start
//! (docs/architecture/hot-path.md#a-fair-start).
//!
//! A mixed crowd against one SKU of an activity that starts at `--starts-at-ms`:
//! - scripted buyers: `--bots` accounts run by one operator, each firing `--bot-lead-ms` before
//!   the start and asking again at full speed until answered for good (202, 410, a refusal);
//! - people: `--people` accounts, one each, arriving at a moment drawn evenly over the first
//!   `--spread-ms` of the sale, one click and at most two retries half a second apart.
//!
//! With `--passes`, everyone registers for a sale pass first: each person solves their own
//! proof of work, the operator solves for as many accounts as `--bot-pow-budget-ms` of solving
//! buys (the rest of its accounts have no pass). The line says how many units reached people
//! (`people_share`) against the people's share of the accounts that asked within the fair
//! window (`people_share_of_arrivals_in_window`: what a draw among them would give), and what
//! the crowd's answers cost (answers/s over the sale, p99).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use hdrhistogram::Histogram;
use rand::{Rng, SeedableRng};
use seckill::config::Settings;
use serde_json::{json, Value};

use crate::tokens::{Minter, SigningArgs};

#[derive(Debug, Args)]
pub struct CrowdArgs {
    #[arg(long, default_value = "http://127.0.0.1:28080")]
    pub api: String,
    #[arg(long)]
    pub activity_id: i64,
    #[arg(long, default_value_t = 1)]
    pub sku_id: i64,
    /// When the sale starts (Unix ms): the activity's `starts_at`.
    #[arg(long)]
    pub starts_at_ms: i64,
    /// The fair window the share of arrivals is counted over (the activity's own, or for a
    /// first-come run the one it is compared with).
    #[arg(long, default_value_t = 2000)]
    pub window_ms: i64,
    #[arg(long, default_value_t = 1000)]
    pub bots: i64,
    #[arg(long, default_value_t = 1000)]
    pub people: i64,
    /// People arrive evenly over this much of the sale's start.
    #[arg(long, default_value_t = 4000)]
    pub spread_ms: u64,
    /// Scripted buyers fire this long before the start.
    #[arg(long, default_value_t = 100)]
    pub bot_lead_ms: u64,
    /// Register for sale passes first (the activity requires them).
    #[arg(long)]
    pub passes: bool,
    /// The operator's solving time for its accounts' proofs of work, in ms of one core.
    #[arg(long, default_value_t = 2000)]
    pub bot_pow_budget_ms: u64,
    /// The SKU's stock: more units given out than this fails the run.
    #[arg(long)]
    pub stock: usize,
    #[arg(long, default_value = "CROWD")]
    pub summary_prefix: String,
    /// Processes whose CPU the sale costs, `name=pid[+pid...]` (repeatable): each one's CPU
    /// per answer is on the line (the draw's cost beside first come first served).
    #[arg(long = "cpu", value_parser = crate::cpu::parse_cpu_target)]
    pub cpu: Vec<crate::cpu::CpuTarget>,
    #[command(flatten)]
    pub signing: SigningArgs,
}

/// Who an account belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Bot,
    Person,
}

/// One account's sale: when it first asked, its last answer, how many requests it made.
struct Outcome {
    kind: Kind,
    has_pass: bool,
    first_sent_ms: i64,
    won: bool,
    requests: u32,
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// What the registration phase left: each account's pass, and what the proofs cost.
#[derive(Default)]
struct Registered {
    passes: HashMap<i64, String>,
    bot_solve_ms: f64,
    people_solve_ms: f64,
    bot_passes: i64,
    people_passes: i64,
}

pub async fn run(settings: Settings, args: CrowdArgs) -> anyhow::Result<bool> {
    let minter = Minter::new(&settings, &args.signing)?;
    let users: Vec<i64> = (1..=args.bots + args.people).collect();
    let bearers = Arc::new(minter.bearer_for(&users)?);
    let kind = |u: i64| {
        if u <= args.bots {
            Kind::Bot
        } else {
            Kind::Person
        }
    };
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(4096)
        .timeout(Duration::from_secs(15))
        .build()?;
    let registering = Instant::now();
    let reg = if args.passes {
        register(&client, &args, &bearers).await?
    } else {
        Registered::default()
    };
    let late_ms = now_ms() - (args.starts_at_ms - args.bot_lead_ms as i64);
    if late_ms >= 0 {
        // A line the bench keeps, not only an error on stderr: the sale would have started
        // before the scripts were in place, so its shares would mean nothing.
        println!(
            "{} FAILED not_ready late_ms={late_ms} registration_s={:.1} passes={}",
            args.summary_prefix,
            registering.elapsed().as_secs_f64(),
            reg.bot_passes + reg.people_passes
        );
        return Ok(false);
    }
    let passes = Arc::new(reg.passes.clone());
    let latencies = Arc::new(std::sync::Mutex::new(Histogram::<u64>::new(3)?));
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.activity_id as u64);
    let cpu_before = crate::cpu::cpu_snapshot(&args.cpu);
    let sale_started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for &u in &users {
        let k = kind(u);
        let at_ms = match k {
            Kind::Bot => args.starts_at_ms - args.bot_lead_ms as i64,
            Kind::Person => args.starts_at_ms + rng.random_range(0..=args.spread_ms) as i64,
        };
        let buyer = Buyer {
            client: client.clone(),
            url: format!(
                "{}/v1/activities/{}/skus/{}/reservations",
                args.api, args.activity_id, args.sku_id
            ),
            user: u,
            bearer: bearers[&u].clone(),
            pass: passes.get(&u).cloned(),
            latencies: latencies.clone(),
        };
        tasks.spawn(async move { buyer.shop(k, at_ms).await });
    }
    let mut outcomes = Vec::with_capacity(users.len());
    while let Some(o) = tasks.join_next().await {
        outcomes.push(o?);
    }
    // From the first request to the last answer.
    let sale_secs = (now_ms() - (args.starts_at_ms - args.bot_lead_ms as i64)) as f64 / 1000.0;
    let h = latencies
        .lock()
        .map(|h| h.clone())
        .unwrap_or_else(|e| e.into_inner().clone());
    let cpu = crate::cpu::cpu_use(&args.cpu, &cpu_before, sale_started.elapsed());
    report(&args, &reg, &outcomes, (sale_secs, &h), &cpu);
    Ok(true)
}

/// A buyer's side of the sale.
struct Buyer {
    client: reqwest::Client,
    url: String,
    user: i64,
    bearer: Arc<str>,
    pass: Option<String>,
    latencies: Arc<std::sync::Mutex<Histogram<u64>>>,
}

impl Buyer {
    /// Waits for its moment, then asks: a script until answered for good (at most 400 times),
    /// a person once and twice more half a second apart.
    async fn shop(self, kind: Kind, at_ms: i64) -> Outcome {
        let wait = (at_ms - now_ms()).max(0) as u64;
        tokio::time::sleep(Duration::from_millis(wait)).await;
        let first_sent_ms = now_ms();
        let (tries, pause) = match kind {
            Kind::Bot => (400, Duration::ZERO),
            Kind::Person => (3, Duration::from_millis(500)),
        };
        let mut requests = 0;
        let mut won = false;
        for _ in 0..tries {
            requests += 1;
            match self.ask().await {
                Some(202) => {
                    won = true;
                    break;
                }
                // Not started, paused, held past its time, overloaded, limited, no answer:
                // ask again (the same request id gets the same reservation).
                None | Some(425 | 429 | 500..=599) => {}
                Some(_) => break,
            }
            if !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
        }
        Outcome {
            kind,
            has_pass: self.pass.is_some(),
            first_sent_ms,
            won,
            requests,
        }
    }

    async fn ask(&self) -> Option<u16> {
        let sent = Instant::now();
        let mut r = self
            .client
            .post(&self.url)
            .header("authorization", &*self.bearer)
            .json(&json!({"request_id": format!("crowd-{}", self.user), "quantity": 1}));
        if let Some(p) = &self.pass {
            r = r.header("sale-pass", p);
        }
        let status = r.send().await.ok().map(|r| r.status().as_u16());
        if let Ok(mut h) = self.latencies.lock() {
            let _ = h.record(sent.elapsed().as_micros() as u64);
        }
        status
    }
}

/// The registration before the sale: every person, and the operator's accounts as far as its
/// solving budget goes (two at a time, the cores of a small bot host).
async fn register(
    client: &reqwest::Client,
    args: &CrowdArgs,
    bearers: &Arc<HashMap<i64, Arc<str>>>,
) -> anyhow::Result<Registered> {
    let mut reg = Registered::default();
    let base = format!("{}/v1/activities/{}/passes", args.api, args.activity_id);
    // The operator first, as it would be: registration opens and the scripts start. Two at a
    // time, the cores of a small bot host, while its solving budget lasts.
    let mut next = 1;
    while next <= args.bots && (reg.bot_solve_ms as u64) < args.bot_pow_budget_ms {
        let pair: Vec<i64> = (next..(next + 2).min(args.bots + 1)).collect();
        next += pair.len() as i64;
        for (u, pass, solve_ms) in register_all(client, &base, &pair, bearers).await? {
            reg.bot_solve_ms += solve_ms;
            reg.passes.insert(u, pass);
            reg.bot_passes += 1;
        }
    }
    // Each person on their own device: here two at a time, for the clock's sake.
    let people: Vec<i64> = (args.bots + 1..=args.bots + args.people).collect();
    for pair in people.chunks(2) {
        for (u, pass, solve_ms) in register_all(client, &base, pair, bearers).await? {
            reg.people_solve_ms += solve_ms;
            reg.passes.insert(u, pass);
            reg.people_passes += 1;
        }
    }
    Ok(reg)
}

/// `users` registered side by side: (user, pass, solving ms) each.
async fn register_all(
    client: &reqwest::Client,
    base: &str,
    users: &[i64],
    bearers: &HashMap<i64, Arc<str>>,
) -> anyhow::Result<Vec<(i64, String, f64)>> {
    let got = futures::future::join_all(
        users
            .iter()
            .map(|&u| register_one(client, base, u, &bearers[&u])),
    )
    .await;
    users
        .iter()
        .zip(got)
        .map(|(&u, r)| r.map(|(pass, ms)| (u, pass, ms)))
        .collect()
}

/// One account's registration: a challenge, solved off the runtime, then the pass; the pass
/// and the ms the solving took.
async fn register_one(
    client: &reqwest::Client,
    base: &str,
    user: i64,
    bearer: &str,
) -> anyhow::Result<(String, f64)> {
    let post = |url: String, body: Value| {
        client
            .post(url)
            .header("authorization", bearer)
            .json(&body)
            .send()
    };
    let c: Value = post(format!("{base}/challenges"), json!({}))
        .await?
        .json()
        .await?;
    let challenge: altcha::Challenge = serde_json::from_value(c["challenge"].clone())
        .with_context(|| format!("no challenge for buyer {user}: {c}"))?;
    let solving = Instant::now();
    let solved = tokio::task::spawn_blocking(move || seckill::auth::pow::solve(&challenge))
        .await?
        .context("unsolvable challenge")?;
    let solve_ms = solving.elapsed().as_secs_f64() * 1000.0;
    let r: Value = post(base.to_string(), json!({"pow": solved}))
        .await?
        .json()
        .await?;
    let pass = r["pass"]
        .as_str()
        .with_context(|| format!("no pass for buyer {user}: {r}"))?;
    Ok((pass.to_string(), solve_ms))
}

/// The line: units by kind, the share that reached people against their share of the accounts
/// that asked within the window, the cost of the answers.
fn report(
    args: &CrowdArgs,
    reg: &Registered,
    outcomes: &[Outcome],
    (sale_secs, h): (f64, &Histogram<u64>),
    cpu: &[crate::cpu::CpuUse],
) {
    let closes = args.starts_at_ms + args.window_ms;
    // The accounts that could buy (a pass, where passes are needed) and asked in the window.
    let in_window = |k: Kind| {
        outcomes
            .iter()
            .filter(|o| o.kind == k && o.first_sent_ms < closes && (o.has_pass || !args.passes))
            .count()
    };
    let won = |k: Kind| outcomes.iter().filter(|o| o.kind == k && o.won).count() as f64;
    let requests = |k: Kind| -> u64 {
        outcomes
            .iter()
            .filter(|o| o.kind == k)
            .map(|o| u64::from(o.requests))
            .sum()
    };
    let (people_units, bot_units) = (won(Kind::Person), won(Kind::Bot));
    let units = (people_units + bot_units).max(1.0);
    let (pw, bw) = (in_window(Kind::Person) as f64, in_window(Kind::Bot) as f64);
    let answers = requests(Kind::Bot) + requests(Kind::Person);
    let per = |ms: f64, n: i64| if n > 0 { ms / n as f64 } else { 0.0 };
    // Every account's 202 is its own unit: more than the stock is an oversell.
    let verdict = if (people_units + bot_units) as usize <= args.stock {
        "OK"
    } else {
        "FAILED oversold"
    };
    // The CPU each process spent per answer over the sale (its waits included).
    let cpu: String = cpu
        .iter()
        .map(|c| {
            let us = c.cpu_secs * 1e6 / answers.max(1) as f64;
            format!(" cpu_{}_us_per_answer={us:.0}", c.name)
        })
        .collect();
    println!(
        "{} {verdict} people_share={:.3} people_share_of_arrivals_in_window={:.3} people_units={} \
         bot_units={} people_in_window={} bots_in_window={} window_ms={} answers={} \
         answers_per_s={:.0} p50_ms={:.1} p99_ms={:.1} bot_requests={} people_requests={} \
         passes={} bot_passes={} bot_pow_ms_per_pass={:.1} people_pow_ms_per_pass={:.1} stock={}{cpu}",
        args.summary_prefix,
        people_units / units,
        pw / (pw + bw).max(1.0),
        people_units,
        bot_units,
        pw,
        bw,
        args.window_ms,
        answers,
        answers as f64 / sale_secs.max(0.001),
        h.value_at_quantile(0.5) as f64 / 1000.0,
        h.value_at_quantile(0.99) as f64 / 1000.0,
        requests(Kind::Bot),
        requests(Kind::Person),
        args.passes,
        reg.bot_passes,
        per(reg.bot_solve_ms, reg.bot_passes),
        per(reg.people_solve_ms, reg.people_passes),
        args.stock,
    );
}
