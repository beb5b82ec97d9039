//! What a load run measured: the report, its human form and the machine-readable last line
//! (`BENCH OK ...`, `DEMO OK ...`) that `make bench`, `make demo` and `make chaos` parse.

use std::collections::BTreeMap;

use hdrhistogram::Histogram;
use serde::Serialize;

use crate::cpu::CpuUse;
use seckill::invariants;

#[derive(Debug, Default, Serialize)]
pub struct BenchReport {
    pub scenario: String,
    /// `closed` (concurrency) or `open` (fixed arrival rate).
    pub mode: String,
    /// How the buyers' tokens were signed (`RS256`, …, `HS256-dev`, or `none`).
    pub tokens: String,
    pub target_rate: Option<f64>,
    pub requests: usize,
    pub accepted: usize,
    pub duplicate_requests: usize,
    pub sold_out: usize,
    pub already_purchased: usize,
    pub other_errors: BTreeMap<String, usize>,
    pub transport_errors: usize,
    /// Of `transport_errors`: no answer before the buyer gave up.
    pub timeouts: usize,
    pub elapsed_secs: f64,
    /// Requests answered (any HTTP answer) per second of the load.
    pub answers_per_sec: f64,
    /// Open loop: the rate the requests were actually sent at (below the planned rate when the
    /// generator could not keep up).
    pub sent_per_sec: Option<f64>,
    /// Accepted reservations not yet orders when the load ended (the backlog).
    pub backlog_at_end: i64,
    pub requests_per_sec: f64,
    pub accepted_per_sec: f64,
    /// Sold-out answers per second (the sold-out comparisons count these, not every answer).
    pub sold_out_per_sec: f64,
    pub api_p50_ms: f64,
    pub api_p99_ms: f64,
    pub api_p999_ms: f64,
    pub api_max_ms: f64,
    pub drained: bool,
    /// From the end of the load (the last answer) to the last reservation recorded.
    pub drain_secs: f64,
    /// From the last request's send to the last reservation recorded: the backlog's drain
    /// after the crowd stopped arriving.
    pub drain_after_arrivals_secs: f64,
    pub orders: i64,
    pub rejected: i64,
    pub order_latency_p50_ms: f64,
    pub order_latency_p99_ms: f64,
    pub order_latency_p999_ms: f64,
    pub order_latency_max_ms: f64,
    pub within_3s_pct: f64,
    pub paid: usize,
    pub pay_errors: usize,
    pub canceled: i64,
    pub settled: bool,
    pub settle_secs: f64,
    /// Orders created per second, first to last order (database timestamps).
    pub orders_per_sec: f64,
    /// Dead letters and outbox rows given up on (DEAD) at the end: both must be 0.
    pub dlq_open: i64,
    pub outbox_dead: i64,
    /// Requests whose outcome the client could not know (no answer, or a failure past the
    /// point of no return), and what the history check found (see `check_history`).
    pub unknown: usize,
    pub lost: usize,
    pub doubled: i64,
    pub leaked: i64,
    /// CPU used during the load, per named process: seconds and share of one core.
    pub cpu: Vec<CpuUse>,
    /// The same from the load's start to the end of the drain (empty for `--load-only`).
    pub cpu_through_drain: Vec<CpuUse>,
    pub invariants: invariants::Report,
}

/// A quantile of a histogram of microseconds, in milliseconds (0 when empty).
pub fn ms(h: &Histogram<u64>, q: f64) -> f64 {
    if h.is_empty() {
        0.0
    } else {
        h.value_at_quantile(q) as f64 / 1000.0
    }
}

/// The machine-readable last line (`make bench`, `make demo` and chaos parse it by field name).
pub fn print_summary(prefix: &str, ok: bool, r: &BenchReport) {
    let cpu: String = r
        .cpu
        .iter()
        .map(|c| format!(" cpu_{}_pct={:.0}", c.name, c.core_pct))
        .chain(
            r.cpu_through_drain
                .iter()
                .map(|c| format!(" cpu_{}_s_total={:.2}", c.name, c.cpu_secs)),
        )
        .collect();
    let kinds: Vec<String> = r
        .other_errors
        .iter()
        .map(|(code, n)| format!("{code}:{n}"))
        .collect();
    let open_loop = format!(
        " timeouts={} no_answer={} error_kinds={} answers_per_s={:.0} planned_per_s={} sent_per_s={:.0} backlog_at_end={} drain_after_arrivals_s={:.2}",
        r.timeouts,
        r.transport_errors - r.timeouts,
        if kinds.is_empty() { "none".into() } else { kinds.join(",") },
        r.answers_per_sec,
        r.target_rate.map_or("-".into(), |x| format!("{x:.0}")),
        r.sent_per_sec.unwrap_or(r.requests_per_sec),
        r.backlog_at_end,
        r.drain_after_arrivals_secs,
    );
    println!(
        "{} {} scenario={} mode={} tokens={} requests={} accepted={} orders={} rejected={} sold_out={} already_purchased={} duplicate_requests={} errors={} req_per_s={:.0} accepted_per_s={:.0} sold_out_per_s={:.0} api_p50_ms={:.2} api_p99_ms={:.2} api_p999_ms={:.2} orders_per_s={:.0} order_p50_ms={:.1} order_p99_ms={:.1} order_p999_ms={:.1} within_3s_pct={:.2} drain_s={:.2} paid={} canceled={} dlq={} unknown={} lost={} doubled={} leaked={} violations={}{}{}",
        prefix,
        if ok { "OK" } else { "FAILED" },
        r.scenario,
        r.mode,
        r.tokens,
        r.requests,
        r.accepted,
        r.orders,
        r.rejected,
        r.sold_out,
        r.already_purchased,
        r.duplicate_requests,
        r.transport_errors + r.other_errors.values().sum::<usize>(),
        r.requests_per_sec,
        r.accepted_per_sec,
        r.sold_out_per_sec,
        r.api_p50_ms,
        r.api_p99_ms,
        r.api_p999_ms,
        r.orders_per_sec,
        r.order_latency_p50_ms,
        r.order_latency_p99_ms,
        r.order_latency_p999_ms,
        r.within_3s_pct,
        r.drain_secs,
        r.paid,
        r.canceled,
        r.dlq_open,
        r.unknown,
        r.lost,
        r.doubled,
        r.leaked,
        r.invariants.violations.len(),
        open_loop,
        cpu,
    );
}

/// The run in a few lines for a person.
pub fn print_human(r: &BenchReport) {
    let f = &r.invariants.figures;
    println!(
        "scenario           {} ({} loop{})",
        r.scenario,
        r.mode,
        r.target_rate
            .map(|x| format!(", {x:.0} requests/s planned"))
            .unwrap_or_default()
    );
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
        "reservation→order  p50 {:.1} ms  p99 {:.1} ms  p99.9 {:.1} ms  max {:.1} ms  within 3 s {:.2}%",
        r.order_latency_p50_ms,
        r.order_latency_p99_ms,
        r.order_latency_p999_ms,
        r.order_latency_max_ms,
        r.within_3s_pct
    );
    println!(
        "order creation     {:.0} orders/s, first to last order",
        r.orders_per_sec
    );
    for c in &r.cpu {
        println!(
            "cpu {:<14} {:.2} s ({:.0}% of a core)",
            c.name, c.cpu_secs, c.core_pct
        );
    }
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
