//! The per-core costs `seckill plan` reads (src/plan.rs), from the crowd's own lines: the
//! steepest step (10x) gives the front's CPU per request while the requests arrived (api,
//! Redis) and the broker's per message through the drain; the
//! backlog drained under the same hold gives PostgreSQL's pace and the consumer's CPU per
//! order; the capacity run gives the direct design's.
//! Then the plan is checked against this machine: fed the 10x step's winners and arrival
//! time (the step whose arrivals outrun PostgreSQL), it predicts that step's drain after the
//! arrivals stopped, compared with the one measured (`BURST_PLAN`).

use seckill::plan::{plan, Costs, Machine, Target};

use super::Run;
use crate::burst::{ACTIVITIES, CAPACITY, DRAIN, PLAN, PLAN_STEP, SKUS, STEPS, ZIPF};
use crate::lines::Line;

/// The step the costs come from, and the one the plan is checked on.
const COSTS_STEP: &str = "10x";

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, m)| m.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".into())
}

async fn commit() -> String {
    match tokio::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .await
    {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).trim().to_owned(),
        _ => "unknown".into(),
    }
}

/// CPU µs of `process` per `per` while the requests arrived (its share of the load's
/// seconds): what answering them cost it. The front's processes go on with other work
/// through the drain (Redis takes the consumer's write-backs, the API its probes), which is
/// not the requests'.
fn us_per_during_load(line: &Line, process: &str, per: &str) -> anyhow::Result<f64> {
    let missing = |key: &str| anyhow::anyhow!("no {key} on {}", line.text);
    let pct = line
        .num(&format!("cpu_{process}_pct"))
        .ok_or_else(|| missing(&format!("cpu_{process}_pct")))?;
    let (requests, rate) = (
        line.num("requests").ok_or_else(|| missing("requests"))?,
        line.num("req_per_s")
            .filter(|r| *r > 0.0)
            .ok_or_else(|| missing("req_per_s"))?,
    );
    let n = line
        .num(per)
        .filter(|n| *n > 0.0)
        .ok_or_else(|| missing(per))?;
    Ok(pct / 100.0 * (requests / rate) * 1e6 / n)
}

/// CPU µs of `process` per `per` (a field of the line: requests, accepted, orders) from the
/// load's start to the drain's end: a message's whole life on the broker, stored, delivered,
/// and the events of its order.
fn us_per(line: &Line, process: &str, per: &str) -> anyhow::Result<f64> {
    let secs = line
        .num(&format!("cpu_{process}_s_total"))
        .ok_or_else(|| anyhow::anyhow!("no cpu_{process}_s_total on {}", line.text))?;
    let n = line
        .num(per)
        .filter(|n| *n > 0.0)
        .ok_or_else(|| anyhow::anyhow!("no {per} on {}", line.text))?;
    Ok(secs * 1e6 / n)
}

/// The costs from the run's lines, written to `costs.json` in the run directory.
pub(super) async fn write_costs(run: &mut Run) -> anyhow::Result<Costs> {
    let step = STEPS
        .iter()
        .find(|s| s.label == COSTS_STEP)
        .expect("a 10x step");
    let line = run.lines.get(step.seckill).cloned().unwrap_or_default();
    let capacity = run.lines.get(CAPACITY).cloned().unwrap_or_default();
    let drain = run.lines.get(DRAIN).cloned().unwrap_or_default();
    // PostgreSQL's share of the machine during the steps (a quota, or a whole core).
    let pg_cores = line.num("postgres_cpu").unwrap_or(1.0);
    let field = |l: &Line, key: &str| {
        l.num(key)
            .ok_or_else(|| anyhow::anyhow!("no {key} on {}", l.text))
    };
    let costs = Costs {
        machine: Machine {
            cores: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
            cpu_model: cpu_model(),
            measured_at: chrono::Utc::now().to_rfc3339(),
            commit: commit().await,
            source: format!(
                "make bench-crowd (PostgreSQL held to {pg_cores} core): step {COSTS_STEP}, the backlog's drain, the direct design's capacity run"
            ),
        },
        api_cpu_us_per_request: us_per_during_load(&line, "api", "requests")?,
        redis_cpu_us_per_request: us_per_during_load(&line, "redis", "requests")?,
        broker_cpu_us_per_message: us_per(&line, "broker", "accepted")?,
        consume_cpu_us_per_order: field(&drain, "cpu_us_consume")?,
        pg_orders_per_s_per_core: field(&drain, "orders_per_s")? / pg_cores,
        direct_pg_purchases_per_s_per_core: capacity
            .num("answers_per_s")
            .ok_or_else(|| anyhow::anyhow!("no capacity line"))?
            / pg_cores,
    };
    let file = run.procs.dir.join("costs.json");
    std::fs::write(&file, serde_json::to_string_pretty(&costs)?)?;
    eprintln!("[bench] crowd: costs written to {}", file.display());
    Ok(costs)
}

/// The plan's drain for the steepest step against the drain measured: `BURST_PLAN`.
pub(super) fn check_plan(run: &mut Run, costs: &Costs) -> Line {
    let step = STEPS
        .iter()
        .find(|s| s.label == PLAN_STEP)
        .expect("a 10x step");
    let line = run.lines.get(step.seckill).cloned().unwrap_or_default();
    let (winners, requests, sent_per_s, measured) = (
        line.num("accepted").unwrap_or(0.0),
        line.num("requests").unwrap_or(0.0),
        line.num("sent_per_s").unwrap_or(0.0),
        line.num("drain_after_arrivals_s"),
    );
    // The winners arrived over the whole step: the plan's "peak" is their rate.
    let arrival_secs = requests / sent_per_s.max(1e-9);
    let target = Target {
        peak_rps: winners / arrival_secs.max(1e-9),
        units: winners as u64,
        skus: SKUS as u32,
        activities: ACTIVITIES as u32,
        sku_zipf: ZIPF,
        instance_cores: 1,
        pg_cores: line.num("postgres_cpu").unwrap_or(1.0),
        utilization: 1.0,
        costs: "costs.json".into(),
        json: false,
    };
    let p = plan(costs, &target, &run.settings);
    let ratio = crate::lines::ratio(Some(p.drain_secs), measured);
    let text = format!(
        "{PLAN} {} step={PLAN_STEP} winners={winners:.0} arrival_s={arrival_secs:.2} \
         pg_orders_per_s={:.0} predicted_drain_s={:.2} measured_drain_s={} \
         plan_drain_predicted_vs_measured={ratio}",
        if ratio == "nan" { "FAILED" } else { "OK" },
        p.pg_orders_per_s,
        p.drain_secs,
        line.raw("drain_after_arrivals_s"),
    );
    let out = Line::parse(&text);
    eprintln!("[bench] {}", out.text);
    run.keep(PLAN, out.clone());
    out
}
