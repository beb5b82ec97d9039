//! `seckill plan`: a shop's target (a peak of requests per second, units, SKUs, activities at
//! once) turned into instance counts, from per-core costs that `make bench` measured on a named
//! machine and wrote to a file (`deploy/plan/costs.json`; docs/SCALING.md works one through).
//!
//! The arithmetic, each part a cost times a rate over the share of a core a process may use:
//! - the API answers every request: its cores are the peak rate times its CPU per request;
//! - Redis runs the reservation script once per request, one core per primary; a hot SKU's
//!   requests (its Zipf share of one activity's) fall on its stock buckets, one per primary;
//! - the broker takes one message per unit sold, at up to the arrival rate until sold out;
//! - PostgreSQL commits orders at its measured rate per core: that rate is the pace of the
//!   whole drain, and the consumers are sized to keep it busy;
//! - the connection budget is the one every role checks at start-up
//!   ([`crate::config::Settings::connection_budget`]) for the planned instance counts.

use serde::{Deserialize, Serialize};

use crate::config::budget::ConnectionBudget;
use crate::config::Settings;

/// Per-core costs measured by `make bench` (bench/src/run/burst.rs writes them).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Costs {
    /// Where and when they were measured.
    pub machine: Machine,
    /// CPU of `seckill api` per request answered (µs of one core).
    pub api_cpu_us_per_request: f64,
    /// CPU of Redis per reservation request (µs of its one core).
    pub redis_cpu_us_per_request: f64,
    /// CPU of the broker per order-create message, sent and delivered (µs).
    pub broker_cpu_us_per_message: f64,
    /// CPU of `seckill consume` per order created (µs).
    pub consume_cpu_us_per_order: f64,
    /// Orders PostgreSQL commits per second with one core of its own (the drain's pace).
    pub pg_orders_per_s_per_core: f64,
    /// Purchases per second the direct-PostgreSQL design answers with one core for the
    /// database (for comparison: what the same target would ask of it).
    pub direct_pg_purchases_per_s_per_core: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Machine {
    pub cores: u32,
    pub cpu_model: String,
    pub measured_at: String,
    pub commit: String,
    /// The bench lines the costs were read from.
    pub source: String,
}

/// What a shop expects at its peak.
#[derive(Debug, Clone, clap::Args)]
pub struct Target {
    /// Requests per second at the peak (the crowd as it arrives).
    #[arg(long)]
    pub peak_rps: f64,
    /// Units on sale (all activities and SKUs).
    #[arg(long)]
    pub units: u64,
    /// SKUs per activity.
    #[arg(long)]
    pub skus: u32,
    /// Activities on sale at once (the peak shared evenly between them).
    #[arg(long, default_value_t = 1)]
    pub activities: u32,
    /// How fast SKU popularity falls within an activity: 1/rank^s (0: even).
    #[arg(long, default_value_t = 1.0)]
    pub sku_zipf: f64,
    /// Cores of each api, consume, broker instance.
    #[arg(long, default_value_t = 4)]
    pub instance_cores: u32,
    /// Cores of the PostgreSQL primary.
    #[arg(long, default_value_t = 16.0)]
    pub pg_cores: f64,
    /// Share of a core a process is planned to use at the peak (the rest is headroom).
    #[arg(long, default_value_t = 0.6)]
    pub utilization: f64,
    /// The costs file `make bench` wrote.
    #[arg(long, default_value = "deploy/plan/costs.json")]
    pub costs: std::path::PathBuf,
    /// Print the plan as JSON.
    #[arg(long)]
    pub json: bool,
}

/// The fleet for a target, and what it predicts.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub api_instances: u32,
    pub redis_primaries: u32,
    /// Stock buckets of the hottest SKU (one per primary, at most the primaries).
    pub hot_sku_buckets: u32,
    pub brokers: u32,
    pub queues_per_topic: u32,
    pub consume_instances: u32,
    pub timeout_cancel_instances: u32,
    /// Order transactions PostgreSQL runs at once (`pg.safe_concurrency`).
    pub pg_safe_concurrency: u32,
    /// Orders per second PostgreSQL commits: the drain's pace.
    pub pg_orders_per_s: f64,
    /// Seconds until the last unit is taken, at the peak rate with every arrival a winner
    /// (a lower bound: the crowd's losers and repeats lengthen it).
    pub sold_out_secs: f64,
    /// Seconds from the start until every unit is an order (the units over the drain's pace).
    pub orders_done_secs: f64,
    /// Seconds the backlog takes to drain after the last unit was taken.
    pub drain_secs: f64,
    /// Cores the direct-PostgreSQL design would need to commit the peak as it arrives.
    pub direct_pg_cores_for_peak: f64,
    /// The connections the planned fleet opens, role by role (`seckill budget` for this fleet).
    pub connections: ConnectionBudget,
}

fn at_least(x: f64, min: u32) -> u32 {
    (x.ceil() as u32).max(min)
}

/// The hottest SKU's share of an activity's requests: 1 / H(skus, s).
pub fn hottest_share(skus: u32, zipf: f64) -> f64 {
    let h: f64 = (1..=skus.max(1))
        .map(|k| 1.0 / f64::from(k).powf(zipf))
        .sum();
    1.0 / h
}

/// The plan for `t` from `costs`; `base` gives the pools the roles open (its instance counts
/// and `pg.safe_concurrency` are replaced by the plan's).
pub fn plan(costs: &Costs, t: &Target, base: &Settings) -> Plan {
    let u = t.utilization.clamp(0.05, 1.0);
    let cores = |rate: f64, us: f64| rate * us / 1e6 / u;
    let per_instance = f64::from(t.instance_cores.max(1));
    let api_instances = at_least(
        cores(t.peak_rps, costs.api_cpu_us_per_request) / per_instance,
        2,
    );
    let redis_primaries = at_least(cores(t.peak_rps, costs.redis_cpu_us_per_request), 1);
    let hot_rps = t.peak_rps / f64::from(t.activities.max(1)) * hottest_share(t.skus, t.sku_zipf);
    let hot_sku_buckets =
        at_least(cores(hot_rps, costs.redis_cpu_us_per_request), 1).min(redis_primaries);
    // One message per unit sold, at up to the arrival rate while units last.
    let brokers = at_least(
        cores(t.peak_rps, costs.broker_cpu_us_per_message) / per_instance,
        2,
    );
    let pg_orders_per_s = costs.pg_orders_per_s_per_core * t.pg_cores.max(0.1);
    let consume_instances = at_least(
        cores(pg_orders_per_s, costs.consume_cpu_us_per_order) / per_instance,
        2,
    );
    let units = t.units as f64;
    let sold_out_secs = units / t.peak_rps.max(1e-9);
    let orders_done_secs = units / pg_orders_per_s.max(1e-9);
    let mut settings = base.clone();
    let pg = &mut settings.pg;
    // Four order transactions at once per core of the primary (the shipped 8 for 2 cores).
    pg.safe_concurrency = ((4.0 * t.pg_cores).ceil() as u32).max(1);
    pg.api_instances = api_instances;
    pg.consume_instances_key = Some(consume_instances);
    let timeout_cancel_instances = consume_instances.div_ceil(2);
    pg.timeout_cancel_instances_key = Some(timeout_cancel_instances);
    let connections = settings.connection_budget();
    Plan {
        api_instances,
        redis_primaries,
        hot_sku_buckets,
        brokers,
        queues_per_topic: (4 * consume_instances).max(8),
        consume_instances,
        timeout_cancel_instances,
        pg_safe_concurrency: settings.pg.safe_concurrency,
        pg_orders_per_s,
        sold_out_secs,
        orders_done_secs,
        drain_secs: (orders_done_secs - sold_out_secs).max(0.0),
        direct_pg_cores_for_peak: t.peak_rps / costs.direct_pg_purchases_per_s_per_core.max(1e-9),
        connections,
    }
}

/// The plan as a person reads it.
pub fn human(p: &Plan, t: &Target, costs: &Costs) -> String {
    let m = &costs.machine;
    format!(
        "target: {:.0} requests/s at the peak, {} units, {} activities x {} SKUs (zipf {})\n\
         costs:  {} ({} cores, {}, commit {}, measured {})\n\
         \n\
         api               {:>5} instances of {} cores\n\
         redis             {:>5} primaries; the hottest SKU in {} stock buckets\n\
         broker            {:>5} brokers, {} queues per topic\n\
         consume           {:>5} instances\n\
         timeout-cancel    {:>5} instances\n\
         postgresql        {} cores, pg.safe_concurrency = {}, {:.0} orders/s\n\
         connections       {} of pg.max_connections = {}{}\n\
         \n\
         sold out after    {:>8.1} s (at the peak, every arrival a winner)\n\
         orders done after {:>8.1} s (units / PostgreSQL's pace)\n\
         drain after sold out {:>5.1} s\n\
         the direct-PostgreSQL design would need {:.0} database cores to commit the peak as it arrives\n\
         \n\
         PostgreSQL's pace and the direct design's are scaled linearly from the share of a core\n\
         they were measured on: an upper bound. Measure on the database you will run.\n",
        t.peak_rps,
        t.units,
        t.activities,
        t.skus,
        t.sku_zipf,
        m.source,
        m.cores,
        m.cpu_model,
        m.commit,
        m.measured_at,
        p.api_instances,
        t.instance_cores,
        p.redis_primaries,
        p.hot_sku_buckets,
        p.brokers,
        p.queues_per_topic,
        p.consume_instances,
        p.timeout_cancel_instances,
        t.pg_cores,
        p.pg_safe_concurrency,
        p.pg_orders_per_s,
        p.connections.total,
        p.connections.max_connections,
        if p.connections.check().is_ok() {
            " (seckill budget for this fleet)".to_owned()
        } else {
            format!(": over, set pg.max_connections to at least {}", p.connections.total)
        },
        p.sold_out_secs,
        p.orders_done_secs,
        p.drain_secs,
        p.direct_pg_cores_for_peak,
    )
}

/// `seckill plan`.
pub fn run(settings: &Settings, t: &Target) -> anyhow::Result<bool> {
    use anyhow::Context;
    anyhow::ensure!(t.peak_rps > 0.0, "--peak-rps must be positive");
    anyhow::ensure!(t.skus > 0, "--skus must be at least 1");
    let text = std::fs::read_to_string(&t.costs)
        .with_context(|| format!("reading the costs file {}", t.costs.display()))?;
    let costs: Costs = serde_json::from_str(&text)
        .with_context(|| format!("{}: not a costs file", t.costs.display()))?;
    let p = plan(&costs, t, settings);
    if t.json {
        println!("{}", serde_json::to_string_pretty(&p)?);
    } else {
        print!("{}", human(&p, t, &costs));
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn costs() -> Costs {
        Costs {
            machine: Machine {
                cores: 2,
                cpu_model: "test".into(),
                measured_at: "now".into(),
                commit: "abc".into(),
                source: "test".into(),
            },
            api_cpu_us_per_request: 60.0,
            redis_cpu_us_per_request: 12.0,
            broker_cpu_us_per_message: 30.0,
            consume_cpu_us_per_order: 40.0,
            pg_orders_per_s_per_core: 2_500.0,
            direct_pg_purchases_per_s_per_core: 1_500.0,
        }
    }

    fn shipped() -> Settings {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
        Settings::load_from(&dir).unwrap()
    }

    fn target(peak_rps: f64, units: u64) -> Target {
        Target {
            peak_rps,
            units,
            skus: 20,
            activities: 1,
            sku_zipf: 1.0,
            instance_cores: 4,
            pg_cores: 16.0,
            utilization: 0.6,
            costs: "unused".into(),
            json: false,
        }
    }

    #[test]
    fn the_worked_plan_of_docs_scaling_adds_up() {
        let settings = shipped();
        let p = plan(&costs(), &target(200_000.0, 50_000), &settings);
        // api: 200k x 60 µs = 12 cores / 0.6 = 20 cores = 5 instances of 4.
        assert_eq!(p.api_instances, 5);
        // redis: 200k x 12 µs = 2.4 cores / 0.6 = 4 primaries; the hottest SKU of 20 takes
        // 1/H(20) = 27.8 % = 55.6k/s x 12 µs / 0.6 = 1.1 cores: 2 buckets.
        assert_eq!(p.redis_primaries, 4);
        assert_eq!(p.hot_sku_buckets, 2);
        // PostgreSQL: 16 cores x 2,500 = 40,000 orders/s; 50,000 units in 1.25 s, taken in
        // 0.25 s: the drain ends 1 s after the sale sold out.
        assert_eq!(p.pg_orders_per_s, 40_000.0);
        assert!((p.orders_done_secs - 1.25).abs() < 1e-9);
        assert!((p.drain_secs - 1.0).abs() < 1e-9);
        // consume: 40,000 x 40 µs = 1.6 cores / 0.6 = 2.7 cores: 1 instance, at least 2.
        assert_eq!(p.consume_instances, 2);
        assert_eq!(p.pg_safe_concurrency, 64);
        assert!((p.direct_pg_cores_for_peak - 133.3).abs() < 0.1);
        // The budget counts the planned instances.
        let api = p
            .connections
            .roles
            .iter()
            .find(|r| r.role == "api")
            .unwrap();
        assert_eq!(api.instances, 5);
    }

    #[test]
    fn a_small_sale_still_gets_two_of_each_role_and_no_drain_when_the_database_keeps_up() {
        let settings = shipped();
        let p = plan(&costs(), &target(1_000.0, 500), &settings);
        assert_eq!((p.api_instances, p.consume_instances, p.brokers), (2, 2, 2));
        assert_eq!(p.drain_secs, 0.0);
        assert!((hottest_share(1, 1.0) - 1.0).abs() < 1e-12);
        assert!((hottest_share(4, 0.0) - 0.25).abs() < 1e-12);
    }
}
