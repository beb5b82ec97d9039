//! The human summary of a whole `make bench` run (`summary.txt`): each scenario's line, then
//! what each figure is compared with, in words, then the front door's ceilings.

use crate::lines::Lines;

/// The summary of a whole run; `ceilings` names the front door's ceiling lines, in order.
pub fn summary(l: &Lines, ceilings: &[&str]) -> String {
    let mut out = scenario_lines(l);
    out.push("== ratios ==".to_owned());
    out.extend(comparisons(l));
    out.push("== the front door's ceilings (wrk: answers/s, generator and server CPU) ==".into());
    out.extend(ceilings.iter().map(|n| format!("{n}: {}", l.get(n).text)));
    out.join("\n")
}

/// The limits of this machine and every pipeline scenario's line, in the order they ran.
fn scenario_lines(l: &Lines) -> Vec<String> {
    let mut out = vec![
        String::new(),
        "== limits (this machine, this run) ==".to_owned(),
    ];
    out.extend(["LIMITS", "BROKER1", "BROKER32"].map(|n| l.get(n).text));
    out.push("== pipeline ==".to_owned());
    let pipeline = crate::judged::SCENARIOS.iter().filter(|s| s.2);
    out.extend(pipeline.map(|(n, _, _)| l.get(n).text));
    out
}

/// Each figure beside what it is compared with, in words.
fn comparisons(l: &Lines) -> Vec<String> {
    let mut out = Vec::new();
    let f = |n: &str, k: &str| l.get(n).raw(k).to_owned();
    out.push(format!(
        "consumer orders/s (batched) {} vs pgbench one order/tx {} and batched {}",
        f("B_BATCH", "orders_per_s"),
        f("LIMITS", "pgbench_single_tps"),
        l.batch_floor().raw("pgbench_batch_orders_per_s")
    ));
    out.push(format!(
        "consumer orders/s, --workers 64: {}; one order per transaction: {}",
        f("B_WIDE", "orders_per_s"),
        f("B_SINGLE", "orders_per_s")
    ));
    out.push(format!(
        "outbox relay events/s {} vs the broker's one-message sends/s {}",
        f("RELAY", "events_per_s"),
        f("BROKER1", "msgs_per_s")
    ));
    for (a, b, what) in [
        ("A_BATCHED", "A_SINGLE", "whole pipeline running"),
        ("I_BATCHED", "I_SINGLE", "send path alone, consumer stopped"),
    ] {
        out.push(format!(
            "accepted/s batched {} vs unbatched {} ({what})",
            f(a, "accepted_per_s"),
            f(b, "accepted_per_s")
        ));
    }
    out.push(format!(
        "accepted/s with tokens and rate limits {} and {} vs body user_id, no limits {} and {} (send path alone, alternating)",
        f("T_ON", "accepted_per_s"),
        f("T_ON2", "accepted_per_s"),
        f("T_OFF", "accepted_per_s"),
        f("T_OFF2", "accepted_per_s")
    ));
    out.extend(["BASE_SOLDOUT", "BASE_BUY", "BASE_SALE"].map(|n| l.get(n).text));
    out.push(format!(
        "sold-out answers/s {} vs direct PostgreSQL over HTTP {} and pgbench {}, {} clients",
        f("SOLDOUT", "sold_out_per_s"),
        f("BASE_SOLDOUT", "sold_out_per_s"),
        f("LIMITS", "direct_pg_soldout_per_s"),
        f("LIMITS", "direct_pg_clients")
    ));
    out.push(format!(
        "the sale, answers/s {} (p99 {} ms) vs direct PostgreSQL over HTTP {} (p99 {} ms)",
        f("SALE", "req_per_s"),
        f("SALE", "api_p99_ms"),
        f("BASE_SALE", "req_per_s"),
        f("BASE_SALE", "api_p99_ms")
    ));
    out.push(format!(
        "accepted/s {} vs direct PostgreSQL purchases over HTTP {} and pgbench {}",
        f("A_BATCHED", "accepted_per_s"),
        f("BASE_BUY", "accepted_per_s"),
        f("LIMITS", "direct_pg_buy_per_s")
    ));
    out
}
