//! `seckill-bench ratios`: the arithmetic of `make bench`. `scripts/bench.sh` runs the scenarios
//! (it drives pgbench, redis-benchmark and the roles) and keeps each one's last line in a file
//! named after the scenario; this reads them, decides each scenario's verdict, and prints the
//! summary and the `RATIOS` line, each figure a ratio to its baseline measured in the same run
//! (BENCHMARKS.md, "What is measured, and against what").

use std::path::PathBuf;

use crate::judged::{Judged, SCENARIOS};
pub use crate::lines::{median_at, ratio, sum, Line, Lines};
use crate::summary::summary;

/// `seckill-bench ratios`.
#[derive(Debug, clap::Args)]
pub struct RatiosArgs {
    /// The directory holding one file per scenario, each the scenario's summary line.
    #[arg(long)]
    pub dir: PathBuf,
    /// Only one part's lines are there: `sale` prints `SALE_RATIOS ...`, `ceilings`
    /// `CEILING_RATIOS ...`, `orders` `ORDER_RATIOS ...`, `fair` `FAIR_RATIOS ...`, `relay`
    /// `RELAY_RATIOS ...`.
    #[arg(long, value_enum)]
    pub only: Option<Part>,
    /// Also write what is printed to this file (`summary.txt`).
    #[arg(long)]
    pub summary: Option<PathBuf>,
}

/// A part of `make bench` run alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Part {
    /// The sale's three runs (`make bench-sale`).
    Sale,
    /// The front door's ceilings with wrk (`make bench-ceilings`).
    Ceilings,
    /// The order consumer on a backlog beside pgbench's batch (`make bench-orders`).
    Orders,
    /// Who gets the units of a contested start (`make bench-fair`).
    Fair,
    /// The outbox relay on the order backlogs' events, beside the broker (`make bench-relay`).
    Relay,
    /// The crowd as it arrives: open-loop steps above the direct design's capacity, both
    /// designs (`make bench-crowd`).
    Crowd,
}

/// The front door's ceilings (`wrk`, bench/src/run/ceilings.rs) and the only answers each may
/// get: a sold-out SKU answers 410 and nothing else (a 401 would be a token refused), the
/// accepted path 202, or 409 once the buyers' tokens come round again.
pub const CEILINGS: [(&str, &[u16]); 13] = [
    ("C_HEALTHZ", &[200]),
    ("C_SOLDOUT_HS256", &[410]),
    ("C_SOLDOUT_RS256", &[410]),
    ("C_SOLDOUT_PS256", &[410]),
    ("C_SOLDOUT_ES256", &[410]),
    ("C_SOLDOUT_EDDSA", &[410]),
    ("C_SOLDOUT_HS256_NOCACHE", &[410]),
    ("C_SOLDOUT_RS256_NOCACHE", &[410]),
    ("C_SOLDOUT_PS256_NOCACHE", &[410]),
    ("C_SOLDOUT_ES256_NOCACHE", &[410]),
    ("C_SOLDOUT_EDDSA_NOCACHE", &[410]),
    ("C_ACCEPT", &[202, 409]),
    ("C_BASE_SOLDOUT", &[410]),
];

/// A ceiling that did not run, lost connections, or got an answer it should not have.
fn ceiling_violations(lines: &Lines) -> u64 {
    CEILINGS
        .iter()
        .filter(|(name, allowed)| {
            let l = lines.get(name);
            let statuses = l.statuses();
            !l.ok()
                || l.num("errors") != Some(0.0)
                || statuses.is_empty()
                || statuses.iter().any(|(s, _)| !allowed.contains(s))
        })
        .count() as u64
}

/// How many scenarios failed, counting each pipeline scenario's own violations too.
pub fn violations(lines: &Lines) -> u64 {
    let mut v = ceiling_violations(lines);
    v += crate::burst::burst_violations(lines).len() as u64;
    for (name, judged, _) in SCENARIOS {
        let line = lines.get(name);
        v += u64::from(!line.ok());
        if judged == Judged::Violations {
            v += line.num("violations").map_or(1, |n| n as u64);
        }
    }
    v
}

/// Who the units reached, as in `RATIOS` and `FAIR_RATIOS` (bench/src/crowd.rs): the people's
/// share first come first served, with a draw, and with a draw among pass holders, beside the
/// people's share of the accounts that asked within the window (what a fair draw would give);
/// what the draw costs in answers/s and p99.
pub fn fair_ratios(l: &Lines) -> String {
    let (fcfs, draw, passes) = (
        l.get("CROWD_FCFS"),
        l.get("CROWD_DRAW"),
        l.get("CROWD_PASSES"),
    );
    format!(
        "fcfs_people_share={} fair_people_share={} people_share_of_arrivals_in_window={} \
         passes_people_share={} passes_people_share_of_arrivals_in_window={} \
         draw_answers_vs_fcfs={} draw_api_cpu_per_answer_vs_fcfs={} draw_p99_ms={} fcfs_p99_ms={} \
         bot_pow_ms_per_pass={} bot_passes={}",
        fcfs.raw("people_share"),
        draw.raw("people_share"),
        draw.raw("people_share_of_arrivals_in_window"),
        passes.raw("people_share"),
        passes.raw("people_share_of_arrivals_in_window"),
        ratio(draw.num("answers_per_s"), fcfs.num("answers_per_s")),
        ratio(
            draw.num("cpu_api_us_per_answer"),
            fcfs.num("cpu_api_us_per_answer")
        ),
        draw.raw("p99_ms"),
        fcfs.raw("p99_ms"),
        passes.raw("bot_pow_ms_per_pass"),
        passes.raw("bot_passes"),
    )
}

/// The sale's figures, as in `RATIOS` and `SALE_RATIOS`.
pub fn sale_ratios(l: &Lines) -> String {
    let (sale, front, base) = (l.get("SALE"), l.get("SALE_FRONT"), l.get("BASE_SALE"));
    format!(
        "sale_vs_direct_pg={} sale_p99_vs_direct_pg={} sale_vs_front_door={} sale_p99_ms={} direct_pg_sale_p99_ms={} within_3s_pct={}",
        ratio(sale.num("req_per_s"), base.num("req_per_s")),
        ratio(sale.num("api_p99_ms"), base.num("api_p99_ms")),
        ratio(sale.num("req_per_s"), front.num("req_per_s")),
        sale.raw("api_p99_ms"),
        base.raw("api_p99_ms"),
        sale.raw("within_3s_pct"),
    )
}

/// The front door's ceilings (`wrk`), RS256 tokens unless named: sold-out answers against
/// `/healthz` of the same server, each algorithm against the development HS256 with the token
/// cache on and off, and against the direct-PostgreSQL server checking the same tokens.
pub fn ceiling_ratios(l: &Lines) -> String {
    let per_s = |n: &str| l.num(n, "per_s");
    let mut out = vec![format!(
        "soldout_vs_healthz={}",
        ratio(per_s("C_SOLDOUT_RS256"), per_s("C_HEALTHZ"))
    )];
    for alg in ["RS256", "PS256", "ES256", "EDDSA"] {
        let name = alg.to_lowercase();
        out.push(format!(
            "soldout_{name}_vs_hs256={} soldout_{name}_vs_hs256_nocache={}",
            ratio(per_s(&format!("C_SOLDOUT_{alg}")), per_s("C_SOLDOUT_HS256")),
            ratio(
                per_s(&format!("C_SOLDOUT_{alg}_NOCACHE")),
                per_s("C_SOLDOUT_HS256_NOCACHE")
            ),
        ));
    }
    out.push(format!(
        "soldout_ceiling_vs_direct_pg={} soldout_per_s={} healthz_per_s={} accept_ceiling_per_s={}",
        ratio(per_s("C_SOLDOUT_RS256"), per_s("C_BASE_SOLDOUT")),
        l.get("C_SOLDOUT_RS256").raw("per_s"),
        l.get("C_HEALTHZ").raw("per_s"),
        ratio(l.num("C_ACCEPT", "s202"), l.num("C_ACCEPT", "seconds")).replace("nan", "-"),
    ));
    out.join(" ")
}

/// The order work's CPU per order on the backlog (`B_BATCH`), split by process, beside the
/// floor: PostgreSQL and pgbench running the same statements (`LIMITS`, measurement 2).
pub fn cpu_ratios(l: &Lines) -> String {
    let (backlog, limits) = (l.get("B_BATCH"), l.batch_floor());
    let mut out = vec![format!(
        "cpu_us_per_order={} cpu_us_per_order_floor={} cpu_per_order_vs_floor={}",
        backlog.raw("cpu_us_per_order"),
        limits.raw("pgbench_batch_cpu_us_per_order"),
        ratio(
            backlog.num("cpu_us_per_order"),
            limits.num("pgbench_batch_cpu_us_per_order")
        ),
    )];
    for name in ["consume", "postgres", "broker", "redis"] {
        out.push(format!(
            "cpu_us_{name}={}",
            backlog.raw(&format!("cpu_us_{name}"))
        ));
    }
    for name in ["postgres", "pgbench"] {
        let key = format!("pgbench_batch_cpu_us_{name}");
        out.push(format!("cpu_us_floor_{name}={}", limits.raw(&key)));
    }
    out.push(format!(
        "wal_bytes_per_order={} wal_bytes_per_order_floor={}",
        backlog.raw("wal_bytes_per_order"),
        limits.raw("pgbench_batch_wal_bytes_per_order")
    ));
    out.join(" ")
}

/// The `RATIOS` line of a whole run.
pub fn ratios(l: &Lines) -> String {
    let single_tps = l.num("LIMITS", "pgbench_single_tps");
    let orders = l.num("B_BATCH", "orders_per_s");
    let accepted = |n: &str| l.num(n, "accepted_per_s");
    let sold_out = |n: &str| l.num(n, "sold_out_per_s");
    let trust_on = sum(accepted("T_ON"), accepted("T_ON2"));
    let trust_off = sum(accepted("T_OFF"), accepted("T_OFF2"));
    [
        ("order_vs_pgbench_single", ratio(orders, single_tps)),
        (
            "order_batch1_vs_pgbench_single",
            ratio(l.num("B_SINGLE", "orders_per_s"), single_tps),
        ),
        (
            "order_vs_pgbench_batch",
            ratio(orders, l.batch_floor().num("pgbench_batch_orders_per_s")),
        ),
        (
            "order_vs_pgbench_batch_rounds",
            l.get("ORDER_ROUNDS").raw("ratios").to_owned(),
        ),
        ("", cpu_ratios(l)),
        (
            "accept_batched_vs_unbatched",
            ratio(accepted("A_BATCHED"), accepted("A_SINGLE")),
        ),
        (
            "soldout_vs_direct_pg",
            ratio(sold_out("SOLDOUT"), sold_out("BASE_SOLDOUT")),
        ),
        (
            "soldout_vs_pgbench_direct",
            ratio(
                sold_out("SOLDOUT"),
                l.num("LIMITS", "direct_pg_soldout_per_s"),
            ),
        ),
        (
            "soldout_memory_vs_redis",
            ratio(sold_out("SOLDOUT"), sold_out("SOLDOUT_REDIS")),
        ),
        (
            "accept_vs_direct_pg_buy",
            ratio(accepted("A_BATCHED"), accepted("BASE_BUY")),
        ),
        ("", sale_ratios(l)),
        ("", fair_ratios(l)),
        (
            "workers64_vs_budget",
            ratio(l.num("B_WIDE", "orders_per_s"), orders),
        ),
        (
            "relay_vs_broker_single",
            ratio(
                l.num("RELAY", "events_per_s"),
                l.num("BROKER1", "msgs_per_s"),
            ),
        ),
        (
            "send_path_batched_vs_unbatched",
            ratio(accepted("I_BATCHED"), accepted("I_SINGLE")),
        ),
        ("trust_on_vs_off", ratio(trust_on, trust_off)),
        ("", ceiling_ratios(l)),
        ("", crate::burst::burst_ratios(l)),
        ("violations", violations(l).to_string()),
    ]
    .iter()
    .map(|(k, v)| {
        if k.is_empty() {
            v.clone()
        } else {
            format!("{k}={v}")
        }
    })
    .collect::<Vec<_>>()
    .join(" ")
}

/// Prints the summary (whole runs) and the ratios line; `false` when a scenario failed.
pub fn run(args: RatiosArgs) -> anyhow::Result<bool> {
    let lines = Lines::read(&args.dir)?;
    let (text, ok) = match args.only {
        Some(Part::Sale) => sale_only(&lines),
        Some(Part::Ceilings) => ceilings_only(&lines),
        Some(Part::Orders) => orders_only(&lines),
        Some(Part::Fair) => fair_only(&lines),
        Some(Part::Crowd) => crate::burst::only(&lines),
        Some(Part::Relay) => relay_only(&lines),
        None => whole(&lines),
    };
    println!("{text}");
    if matches!(args.only, None | Some(Part::Crowd)) {
        // The crowd's figure beside the lines it is drawn from.
        let svg = args.dir.parent().unwrap_or(&args.dir).join("crowd.svg");
        match crate::plot::crowd_svg(&lines, &svg) {
            Ok(()) => eprintln!("[bench] the crowd's figure: {}", svg.display()),
            Err(e) => eprintln!("[bench] no crowd figure: {e:#}"),
        }
    }
    if let Some(file) = &args.summary {
        std::fs::write(file, format!("{text}\n"))?;
    }
    Ok(ok)
}

/// `make bench-sale`: the sale's three lines judged.
fn sale_only(lines: &Lines) -> (String, bool) {
    let failed = ["SALE", "SALE_FRONT", "BASE_SALE"]
        .iter()
        .filter(|n| !lines.get(n).ok())
        .count();
    let text = format!("SALE_RATIOS {} violations={failed}", sale_ratios(lines));
    (text, failed == 0)
}

/// `make bench-ceilings`: the front door's ceilings with wrk.
fn ceilings_only(lines: &Lines) -> (String, bool) {
    let failed = ceiling_violations(lines);
    let table: Vec<String> = CEILINGS
        .iter()
        .map(|(n, _)| format!("{n}: {}", lines.get(n).text))
        .collect();
    let text = format!(
        "{}\nCEILING_RATIOS {} violations={failed}",
        table.join("\n"),
        ceiling_ratios(lines)
    );
    (text, failed == 0)
}

/// `make bench-orders`: the order work against pgbench's batch.
fn orders_only(lines: &Lines) -> (String, bool) {
    let (limits, backlog) = (lines.batch_floor(), lines.get("B_BATCH"));
    // The backlog's own verdict (its invariants) and a floor to compare with.
    let rounds = lines.get("ORDER_ROUNDS");
    let failed = u64::from(!backlog.ok())
        + u64::from(!rounds.ok())
        + rounds.num("violations").unwrap_or(0.0) as u64
        + u64::from(limits.num("pgbench_batch_orders_per_s").is_none());
    let text = format!(
        "{}\n{}\nORDER_RATIOS order_vs_pgbench_batch={} order_vs_pgbench_batch_rounds={} {} violations={failed}",
        limits.text,
        backlog.text,
        ratio(
            backlog.num("orders_per_s"),
            limits.num("pgbench_batch_orders_per_s")
        ),
        lines.get("ORDER_ROUNDS").raw("ratios"),
        cpu_ratios(lines)
    );
    (text, failed == 0)
}

/// `make bench-fair`: the mixed crowd's three ways of handing out units.
fn fair_only(lines: &Lines) -> (String, bool) {
    let names = ["CROWD_FCFS", "CROWD_DRAW", "CROWD_PASSES"];
    let failed = names.iter().filter(|n| !lines.get(n).ok()).count();
    let table: Vec<String> = names.iter().map(|n| lines.get(n).text.clone()).collect();
    let text = format!(
        "{}\nFAIR_RATIOS {} violations={failed}",
        table.join("\n"),
        fair_ratios(lines)
    );
    (text, failed == 0)
}

/// `make bench-relay`: the relay beside the broker's raw rate.
fn relay_only(lines: &Lines) -> (String, bool) {
    let relay = lines.get("RELAY");
    let failed = u64::from(!relay.ok())
        + ["B_BATCH", "B_WIDE", "B_SINGLE"]
            .iter()
            .map(|n| lines.get(n).num("violations").map_or(1, |v| v as u64))
            .sum::<u64>();
    let text = format!(
        "{}\n{}\nRELAY_RATIOS relay_vs_broker_single={} violations={failed}",
        lines.get("BROKER1").text,
        relay.text,
        ratio(
            relay.num("events_per_s"),
            lines.get("BROKER1").num("msgs_per_s")
        )
    );
    (text, failed == 0)
}

/// `make bench`: the summary of every scenario, the crowd's table and RATIOS.
fn whole(lines: &Lines) -> (String, bool) {
    let text = format!(
        "{}\n{}\nRATIOS {}",
        summary(lines, &CEILINGS.map(|(n, _)| n)),
        crate::burst::table(lines),
        ratios(lines)
    );
    (text, violations(lines) == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(pairs: &[(&str, &str)]) -> Lines {
        Lines(
            pairs
                .iter()
                .map(|(n, t)| (n.to_string(), Line::parse(t)))
                .collect(),
        )
    }

    #[test]
    fn a_ratio_is_two_places_or_nan() {
        assert_eq!(ratio(Some(3.0), Some(2.0)), "1.50");
        assert_eq!(ratio(Some(3.0), Some(0.0)), "nan");
        assert_eq!(ratio(None, Some(2.0)), "nan");
        assert_eq!(ratio(Some(1.0), None), "nan");
    }

    #[test]
    fn a_line_gives_its_verdict_and_figures() {
        let l = Line::parse("BENCH OK scenario=hot-sku req_per_s=7778.4 violations=0 note=x=y");
        assert!(l.ok());
        assert_eq!(l.num("req_per_s"), Some(7778.4));
        assert_eq!(l.num("scenario"), None);
        assert_eq!(l.raw("note"), "x=y");
        assert!(!Line::parse("BENCH FAILED req_per_s=1").ok());
        // "OK" elsewhere in the line is not the verdict.
        assert!(!Line::parse("BENCH FAILED reason=OK").ok());
        assert!(!Line::parse("").ok());
    }

    #[test]
    fn every_missing_or_failed_scenario_is_a_violation() {
        let all_ok: Vec<(&str, &str)> = SCENARIOS
            .iter()
            .map(|(n, judged, _)| match judged {
                Judged::Verdict => (*n, "X OK"),
                Judged::Violations => (*n, "X OK violations=0"),
            })
            .chain([
                ("C_HEALTHZ", "WRK OK errors=0 s200=5"),
                ("C_ACCEPT", "WRK OK errors=0 s202=5 s409=2"),
            ])
            .chain(
                CEILINGS[1..11]
                    .iter()
                    .chain(&CEILINGS[12..])
                    .map(|(n, _)| (*n, "WRK OK errors=0 s410=9")),
            )
            .chain(crate::burst::passing_lines())
            .collect();
        assert_eq!(violations(&lines(&all_ok)), 0);
        let mut some = all_ok.clone();
        let at = |name: &str| all_ok.iter().position(|(n, _)| *n == name).unwrap();
        some[at("RELAY")].1 = "X FAILED"; // a verdict-only scenario failed
        some[at("B_BATCH")].1 = "X OK violations=3"; // three broken invariants
        some[at("SALE")].1 = "X OK"; // no count: one
        assert_eq!(violations(&lines(&some)), 1 + 3 + 1);
        // A sold-out ceiling that got a 401 (a token refused), one that lost a connection.
        let mut refused = all_ok.clone();
        refused[at("C_SOLDOUT_RS256")].1 = "WRK OK errors=0 s410=9 s401=1";
        refused[at("C_SOLDOUT_EDDSA")].1 = "WRK OK errors=1 s410=9";
        assert_eq!(violations(&lines(&refused)), 2);
        // Nothing ran at all: every scenario counts.
        assert_eq!(
            violations(&lines(&[])),
            (SCENARIOS.len()
                + SCENARIOS
                    .iter()
                    .filter(|s| s.1 == Judged::Violations)
                    .count()
                + CEILINGS.len()
                + crate::burst::burst_violations(&lines(&[])).len()) as u64
        );
    }

    #[test]
    fn the_ratios_line_relates_each_figure_to_its_baseline() {
        let l = lines(&[
            (
                "LIMITS",
                "LIMITS pgbench_single_tps=2000 pgbench_batch_orders_per_s=16000 \
                 pgbench_batch_cpu_us_per_order=60.0 pgbench_batch_cpu_us_postgres=50.0 \
                 pgbench_batch_cpu_us_pgbench=10.0 pgbench_batch_wal_bytes_per_order=900",
            ),
            (
                "B_BATCH",
                "BACKLOG_batched OK orders_per_s=8000 cpu_us_per_order=150.0 \
                 cpu_us_consume=50.0 cpu_us_postgres=70.0 cpu_us_broker=30.0 \
                 wal_bytes_per_order=1500 violations=0",
            ),
            (
                "B_WIDE",
                "BACKLOG_workers64 OK orders_per_s=8800 violations=0",
            ),
            ("T_ON", "BENCH OK accepted_per_s=900"),
            ("T_ON2", "BENCH OK accepted_per_s=1000"),
            ("T_OFF", "BENCH OK accepted_per_s=1000"),
            ("T_OFF2", "BENCH OK accepted_per_s=1000"),
            (
                "SALE",
                "BENCH OK req_per_s=12000 api_p99_ms=50 within_3s_pct=100.00",
            ),
            ("BASE_SALE", "BENCH OK req_per_s=8000 api_p99_ms=40"),
            ("C_HEALTHZ", "WRK OK per_s=40000"),
            ("C_SOLDOUT_HS256", "WRK OK per_s=30000"),
            ("C_SOLDOUT_RS256", "WRK OK per_s=27000"),
            ("C_SOLDOUT_RS256_NOCACHE", "WRK OK per_s=6000"),
            ("C_SOLDOUT_HS256_NOCACHE", "WRK OK per_s=24000"),
            ("C_BASE_SOLDOUT", "WRK OK per_s=9000"),
        ]);
        let r = ratios(&l);
        for want in [
            "order_vs_pgbench_single=4.00",
            "order_vs_pgbench_batch=0.50",
            "cpu_us_per_order=150.0 cpu_us_per_order_floor=60.0 cpu_per_order_vs_floor=2.50",
            "wal_bytes_per_order=1500 wal_bytes_per_order_floor=900",
            "cpu_us_consume=50.0 cpu_us_postgres=70.0 cpu_us_broker=30.0 cpu_us_redis=-",
            "cpu_us_floor_postgres=50.0 cpu_us_floor_pgbench=10.0",
            "workers64_vs_budget=1.10",
            "trust_on_vs_off=0.95",
            "sale_vs_direct_pg=1.50",
            "sale_p99_vs_direct_pg=1.25",
            "sale_vs_front_door=nan",
            "within_3s_pct=100.00",
            "accept_batched_vs_unbatched=nan",
            "soldout_vs_healthz=0.68",
            "soldout_rs256_vs_hs256=0.90",
            "soldout_rs256_vs_hs256_nocache=0.25",
            "soldout_es256_vs_hs256=nan",
            "soldout_ceiling_vs_direct_pg=3.00",
        ] {
            assert!(r.contains(want), "{want} not in {r}");
        }
        assert!(r.ends_with(&format!("violations={}", violations(&l))));
    }
}
