//! After the load: the drain, the order latencies, the verdict, and the client's own history
//! checked against the stores.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use hdrhistogram::Histogram;

use super::{BenchArgs, Planned};
use crate::report::{ms, BenchReport};
use crate::wait::wait_progress;
use seckill::config::Settings;
use seckill::invariants;
use seckill::redis::RedisStore;

/// Drain: waits until every accepted reservation has a recorded decision in PostgreSQL. The
/// wait scales with the backlog: it gives up only after `--drain-timeout-secs` without a
/// single new decision recorded, however long the drain takes while it makes progress.
pub(super) async fn wait_drained(
    pg: &tokio_postgres::Client,
    (accepted, arrivals_ended): (&[String], Instant),
    args: &BenchArgs,
    report: &mut BenchReport,
) -> anyhow::Result<()> {
    let drain_started = Instant::now();
    let stall = Duration::from_secs(args.drain_timeout_secs);
    let total = accepted.len() as i64;
    let left = || async {
        let recorded: i64 = pg
            .query_one(
                "SELECT count(*) FROM reservations WHERE reservation_id = ANY($1::text[])",
                &[&accepted],
            )
            .await?
            .get(0);
        Ok((total - recorded).max(0))
    };
    report.backlog_at_end = left().await?;
    let what = "drain (accepted reservations without a decision in PostgreSQL)";
    let left = wait_progress(stall, Duration::from_millis(100), what, left).await?;
    report.drained = left == 0;
    report.drain_secs = drain_started.elapsed().as_secs_f64();
    report.drain_after_arrivals_secs = arrivals_ended.elapsed().as_secs_f64();
    Ok(())
}

/// Reservation→order latencies (to the end of the order's transaction) and the order rate,
/// from the database's own timestamps.
pub(super) async fn order_latencies(
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
             WHERE o.activity_id = ANY($1::int8[]) AND o.sku_id BETWEEN $2 AND $3",
            &[&args.activity_id, &args.sku_id, &last_sku],
        )
        .await?;
    report.orders_per_sec = order_rate(pg, &args.activity_id, args.sku_id, last_sku)
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
pub(super) async fn judge(
    settings: &Settings,
    pg: &tokio_postgres::Client,
    args: &BenchArgs,
    bench_started_at: chrono::DateTime<chrono::Utc>,
    report: &mut BenchReport,
) -> anyhow::Result<()> {
    let redis = RedisStore::connect(&settings.redis).await?;
    let group = settings.names().order_create_group.clone();
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
                    (SELECT count(*) FROM event_outbox_by_day WHERE status = 'DEAD' AND created_at >= $1)",
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
pub(super) enum Fate {
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
pub(super) fn fate(states: (Option<&str>, Option<&str>, Option<&str>)) -> Fate {
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
pub(super) struct History {
    /// 202s that never became a record, and unknown answers that hold stock without one.
    pub(super) lost: usize,
    /// Valid orders beyond one per buyer per SKU.
    pub(super) doubled: i64,
    /// Units neither sold (a valid order) nor available again (Redis remaining).
    pub(super) leaked: i64,
    pub(super) violations: Vec<String>,
}

/// Checks every request against the stores, as only the client can: every 202 became exactly
/// one order (live, paid, or cancelled with its one compensation) or exactly one compensated
/// rejection; every request whose outcome the client could not know (no answer, a failure past
/// the point of no return) became nothing that holds stock, or exactly one of those. Then the
/// sale's books: nothing left unrecorded, no compensation pending, nothing quarantined, no unit
/// leaked. Each failure is named.
pub(super) async fn check_history(
    settings: &Settings,
    pg: &tokio_postgres::Client,
    args: &BenchArgs,
    plan: &[Planned],
    accepted: &[String],
    unknown: &[usize],
    figures: &invariants::SkuFigures,
) -> anyhow::Result<History> {
    let mut h = History::default();
    let (recorded, held) = unknown_outcomes(settings, pg, args, plan, unknown).await?;
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
    let (unrecorded_202, third_state) = fates(pg, &ids).await?;
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
            "SELECT count(*) - count(DISTINCT (activity_id, sku_id, user_id)) FROM orders
             WHERE activity_id = ANY($1::int8[]) AND status <> 'CANCELED'",
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
    sale_books(figures, &mut h);
    Ok(h)
}

/// The unknown requests PostgreSQL recorded (request id -> reservation id), and the
/// reservations of the unrecorded ones that still hold stock in Redis.
async fn unknown_outcomes(
    settings: &Settings,
    pg: &tokio_postgres::Client,
    args: &BenchArgs,
    plan: &[Planned],
    unknown: &[usize],
) -> anyhow::Result<(std::collections::HashMap<String, String>, Vec<String>)> {
    let redis = RedisStore::connect(&settings.redis).await?;
    // By request id (unique within a run).
    let unknown_req: Vec<String> = unknown
        .iter()
        .map(|&i| plan[i].request_id.clone())
        .collect();
    let recorded: std::collections::HashMap<String, String> = pg
        .query(
            "SELECT request_id, reservation_id FROM reservations
             WHERE activity_id = ANY($1::int8[]) AND request_id = ANY($2::text[])",
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
            .intake()
            .request_reservation(p.activity_id, p.user_id, &p.request_id)
            .await?;
        if let Some(rid) = rid {
            let fields = redis.reservation(p.activity_id, &rid).await?;
            if fields.get("status").map(String::as_str) == Some("RESERVED") {
                held.push(rid);
            }
        }
    }
    Ok((recorded, held))
}

/// Of reservations `ids`, those PostgreSQL never recorded and those in a third state
/// (each as `id: (reservation, order, compensation)` with their statuses).
async fn fates(
    pg: &tokio_postgres::Client,
    ids: &[String],
) -> anyhow::Result<(Vec<String>, Vec<String>)> {
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
    Ok((unrecorded_202, third_state))
}

/// The sale's books, after the drain and the settle, from the figures `judge` read just
/// before: no unit leaked, nothing unrecorded, no compensation pending, nothing quarantined.
fn sale_books(figures: &invariants::SkuFigures, h: &mut History) {
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
}

/// The invariants of every SKU of every activity of the run, as one report.
pub(super) async fn check_skus(
    pg: &tokio_postgres::Client,
    redis: &RedisStore,
    group: &str,
    args: &BenchArgs,
) -> anyhow::Result<invariants::Report> {
    let mut all: Option<invariants::Report> = None;
    for &activity in &args.activity_id {
        for sku in args.sku_id..args.sku_id + args.skus {
            let r = invariants::check(pg, redis, group, activity, sku)
                .await
                .context("invariant check")?;
            match all.as_mut() {
                None => all = Some(r),
                Some(all) => {
                    all.figures.add(&r.figures);
                    all.violations.extend(r.violations);
                }
            }
        }
    }
    Ok(all.unwrap_or_default())
}

/// Orders of some SKUs of some activities, and how fast they were created.
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
    activities: &[i64],
    first_sku: i64,
    last_sku: i64,
) -> anyhow::Result<OrderRate> {
    let row = pg
        .query_one(
            "SELECT count(*), coalesce(extract(epoch FROM max(t) - min(t)), 0)::float8
             FROM (SELECT coalesce(c.committed_at, o.created_at) AS t
                   FROM orders o LEFT JOIN order_commits c USING (xact_id)
                   WHERE o.activity_id = ANY($1::int8[]) AND o.sku_id BETWEEN $2 AND $3)
                   AS committed",
            &[&activities, &first_sku, &last_sku],
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
