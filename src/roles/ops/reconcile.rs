//! `seckill reconcile`: a one-shot check for cron or a systemd timer
//! (docs/architecture/recovery.md#reconcile). Within a
//! window and past a grace period it finds orders whose events are missing, expired unpaid
//! orders never cancelled, reservations that neither became orders nor were released, and
//! stock that does not add up; it emits each missing event into the outbox with a
//! deterministic id (a second run emits nothing new) and never changes business state.

use crate::domain::status::OrderStatus;
use crate::pg::reconcile::{self as db, ChangedOrder};
use std::time::Instant;

use chrono::{DateTime, Duration, Utc};
use clap::Args;
use serde::Serialize;
use tokio_postgres::GenericClient;

use crate::config::Settings;
use crate::domain::events::{
    order_canceled_event_id, order_created_event_id, order_paid_event_id, payload,
    reconcile_cancel_if_unpaid_event_id, release_reservation_event_id, CancelOrderIfUnpaid,
    OrderCanceled, OrderCreated, OrderPaid, OrderRef, ReleaseReservation, TAG_CANCEL_IF_UNPAID,
    TAG_ORDER_CANCELED, TAG_ORDER_CREATED, TAG_ORDER_PAID, TAG_RELEASE_RESERVATION,
};
use crate::pg::rows::{OutboxEvent, OutboxRows, OutboxStart};
use crate::redis::RedisStore;

#[derive(Debug, Clone, Args)]
pub struct ReconcileArgs {
    /// Look at orders and reservations of the last this many hours.
    #[arg(long, default_value_t = 24)]
    pub window_hours: i64,
    /// Leave alone what changed in the last this many seconds (the pipeline may still be on it).
    #[arg(long, default_value_t = 120)]
    pub grace_secs: i64,
    #[arg(long)]
    pub json: bool,
    /// Exit non-zero when any drift was found.
    #[arg(long)]
    pub fail_on_drift: bool,
    /// Write the figures to this Prometheus textfile (node_exporter textfile collector).
    #[arg(long)]
    pub metrics_file: Option<std::path::PathBuf>,
}

/// One kind of drift: what the check looked at, what it left for the next run as too fresh,
/// how many drifts it found, how many events it emitted for them, and some examples.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Finding {
    pub kind: &'static str,
    /// Rows (reservations, SKUs) in the window the check examined.
    pub scanned: u64,
    /// Rows it would have examined but that changed within `--grace-secs`: the pipeline may
    /// still be on them, so the next run looks again.
    pub skipped_fresh: u64,
    pub found: usize,
    pub emitted: u64,
    pub examples: Vec<String>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct ReconcileReport {
    pub window_start: Option<DateTime<Utc>>,
    pub window_end: Option<DateTime<Utc>>,
    pub findings: Vec<Finding>,
    pub duration_secs: f64,
}

impl ReconcileReport {
    pub fn drift(&self) -> usize {
        self.findings.iter().map(|f| f.found).sum()
    }
    pub fn emitted(&self) -> u64 {
        self.findings.iter().map(|f| f.emitted).sum()
    }
}

/// An event to put back into the outbox.
struct Emit {
    event_id: String,
    topic: String,
    tag: &'static str,
    key: String,
    aggregate_id: Option<String>,
    version: Option<i32>,
    payload: serde_json::Value,
}

impl Emit {
    /// An event keyed by `key` (no aggregate).
    fn new(
        topic: &str,
        tag: &'static str,
        key: &str,
        event_id: &str,
        payload: serde_json::Value,
    ) -> Self {
        Self {
            event_id: event_id.to_string(),
            topic: topic.to_string(),
            tag,
            key: key.to_string(),
            aggregate_id: None,
            version: None,
            payload,
        }
    }

    /// One of the order's own events: its aggregate is the order (the key), at `version`
    /// (`None` for the unversioned timer).
    fn of_order(mut self, version: Option<i32>) -> Self {
        self.aggregate_id = Some(self.key.clone());
        self.version = version;
        self
    }
}

async fn emit(client: &impl GenericClient, e: &Emit) -> Result<u64, tokio_postgres::Error> {
    let mut rows = OutboxRows::default();
    rows.push(OutboxEvent {
        event_id: e.event_id.clone(),
        activity_id: e
            .payload
            .get("activity_id")
            .and_then(serde_json::Value::as_i64)
            .unwrap_or(0),
        topic: &e.topic,
        tag: e.tag,
        key: &e.key,
        aggregate: e.aggregate_id.as_deref().map(|id| (id, e.version)),
        payload: (&e.payload).into(),
        deliver_at: None,
        first_send_at: None,
        start: OutboxStart::Pending,
    });
    rows.insert_with(client).await
}

fn example(list: &mut Vec<String>, s: String) {
    if list.len() < 10 {
        list.push(s);
    }
}

impl Finding {
    fn new(kind: &'static str, scanned: u64, skipped_fresh: u64) -> Self {
        Self {
            kind,
            scanned,
            skipped_fresh,
            ..Default::default()
        }
    }

    /// Counts one drift (`id` among the examples) and writes its missing event.
    async fn record(
        &mut self,
        pg: &impl GenericClient,
        id: String,
        e: &Emit,
    ) -> Result<(), tokio_postgres::Error> {
        self.found += 1;
        example(&mut self.examples, id);
        self.emitted += emit(pg, e).await?;
        Ok(())
    }
}

/// The event ids an order's state calls for: ORDER_CREATED always; ORDER_PAID when paid;
/// ORDER_CANCELED and its RELEASE_RESERVATION when cancelled.
fn wanted_event_ids(orders: &[ChangedOrder]) -> Vec<String> {
    let mut wanted: Vec<String> = Vec::with_capacity(orders.len() * 2);
    for o in orders {
        let (oid, rid) = (&o.order.order_id, &o.order.reservation_id);
        wanted.push(order_created_event_id(oid));
        match o.status.parse::<OrderStatus>() {
            Ok(OrderStatus::Paid) => wanted.push(order_paid_event_id(oid, o.version)),
            Ok(OrderStatus::Canceled) => {
                wanted.push(order_canceled_event_id(oid, o.version));
                wanted.push(release_reservation_event_id(rid));
            }
            _ => {}
        }
    }
    wanted
}

/// The RELEASE_RESERVATION a cancelled order's unit goes back with.
fn release_after_cancel(names: &crate::mq::Names, facts: &OrderRef, now: DateTime<Utc>) -> Emit {
    let mut e = ReleaseReservation::new(facts, "ORDER_CANCELED");
    e.reconciled_at = Some(now);
    Emit::new(
        &names.compensate_topic,
        TAG_RELEASE_RESERVATION,
        &facts.reservation_id,
        &e.event_id,
        payload(&e),
    )
}

/// Finds, among the orders changed in the window, those whose events are missing from the
/// outbox (ORDER_CREATED; ORDER_PAID of a paid order; ORDER_CANCELED and RELEASE_RESERVATION
/// of a cancelled one) and writes each again with the id its writer gives it.
async fn missing_order_events(
    pg: &impl GenericClient,
    names: &crate::mq::Names,
    start: DateTime<Utc>,
    end: DateTime<Utc>,
    now: DateTime<Utc>,
) -> anyhow::Result<(Finding, Finding, Finding, Finding)> {
    let orders = db::changed_orders(pg, start, end).await?;
    let present = db::outbox_has(pg, &wanted_event_ids(&orders)).await?;
    let fresh = db::fresh_orders(pg, end).await?;
    let with_status =
        |s: OrderStatus| orders.iter().filter(|o| o.status == s.as_str()).count() as u64;
    let (n_paid, n_canceled) = (
        with_status(OrderStatus::Paid),
        with_status(OrderStatus::Canceled),
    );
    let mut created = Finding::new("missing_order_created", orders.len() as u64, fresh.all);
    let mut paid = Finding::new("missing_order_paid", n_paid, fresh.paid);
    let mut canceled = Finding::new("missing_order_canceled", n_canceled, fresh.canceled);
    let mut released = Finding::new("missing_release_after_cancel", n_canceled, fresh.canceled);
    for o in &orders {
        let facts = &o.order;
        let (oid, rid) = (&facts.order_id, &facts.reservation_id);
        let (status, version, expires_at) = (&o.status, o.version, o.expires_at);
        let order_event = |tag, event_id: String, payload, version| {
            let topic = &names.order_event_topic;
            Emit::new(topic, tag, oid, &event_id, payload).of_order(Some(version))
        };
        if !present.contains(&order_created_event_id(oid)) {
            let mut e = OrderCreated::new(facts, expires_at);
            e.base.reconciled_at = Some(now);
            let emit = order_event(TAG_ORDER_CREATED, e.base.event_id.clone(), payload(&e), 1);
            created.record(pg, oid.clone(), &emit).await?;
        }
        if status == OrderStatus::Paid.as_str()
            && !present.contains(&order_paid_event_id(oid, version))
        {
            let mut e = OrderPaid::new(facts, version, o.payment_id.clone());
            e.base.reconciled_at = Some(now);
            let emit = order_event(
                TAG_ORDER_PAID,
                e.base.event_id.clone(),
                payload(&e),
                version,
            );
            paid.record(pg, oid.clone(), &emit).await?;
        }
        if status != OrderStatus::Canceled.as_str() {
            continue;
        }
        if !present.contains(&order_canceled_event_id(oid, version)) {
            let mut e = OrderCanceled::new(facts, version);
            e.base.reconciled_at = Some(now);
            let id = e.base.event_id.clone();
            let emit = order_event(TAG_ORDER_CANCELED, id, payload(&e), version);
            canceled.record(pg, oid.clone(), &emit).await?;
        }
        if !present.contains(&release_reservation_event_id(rid)) {
            let emit = release_after_cancel(names, facts, now);
            released.record(pg, rid.clone(), &emit).await?;
        }
    }
    Ok((created, paid, canceled, released))
}

/// Events sent as transaction messages whose row is still TRANSACTION past
/// `events.transaction_horizon_secs`: their producer never marked them, and the broker has
/// stopped asking about their half by then (it may have delivered it after a check-back, or
/// dropped it). Handed to the relay, which sends them under the same id.
async fn past_transaction_horizon(
    pg: &impl GenericClient,
    settings: &Settings,
    now: DateTime<Utc>,
) -> anyhow::Result<Finding> {
    use crate::pg::half_message_events::{requeue_stale, transaction_rows};
    let horizon = Duration::seconds(settings.events.transaction_horizon_secs as i64);
    let (past, within) = transaction_rows(pg, now - horizon).await?;
    let ids = requeue_stale(pg, now - horizon, 10_000).await?;
    let mut f = Finding::new("transaction_past_horizon", past, within);
    f.found = ids.len();
    f.emitted = ids.len() as u64;
    for id in ids {
        example(&mut f.examples, id);
    }
    Ok(f)
}

/// Expired unpaid orders nobody cancelled: a fresh cancel trigger each (deterministic id).
async fn expired_not_canceled(
    pg: &impl GenericClient,
    names: &crate::mq::Names,
    start: DateTime<Utc>,
    end: DateTime<Utc>,
    now: DateTime<Utc>,
) -> anyhow::Result<Finding> {
    let (scanned, fresh) = db::expiries(pg, start, end, now).await?;
    let mut expired = Finding::new("expired_unpaid_not_canceled", scanned, fresh);
    for (oid, activity_id, sku_id, expires_at) in db::expired_unpaid(pg, start, end).await? {
        let mut e = CancelOrderIfUnpaid::new(
            reconcile_cancel_if_unpaid_event_id(&oid),
            &oid,
            activity_id,
            sku_id,
            expires_at,
        );
        e.reconciled_at = Some(now);
        let topic = &names.order_timeout_topic;
        let emit =
            Emit::new(topic, TAG_CANCEL_IF_UNPAID, &oid, &e.event_id, payload(&e)).of_order(None);
        expired.record(pg, oid, &emit).await?;
    }
    Ok(expired)
}

/// Reservations of one activity SKU still holding a unit in Redis past their validity that
/// PostgreSQL never recorded: neither ordered nor released.
async fn stuck_reservations(
    pg: &impl GenericClient,
    redis: &RedisStore,
    (aid, sku): (i64, i64),
    end: DateTime<Utc>,
    stuck: &mut Finding,
) -> anyhow::Result<()> {
    let census = redis.stock().reservation_census(aid, sku).await?;
    stuck.scanned += census.reserved_ids.len() as u64;
    if !census.reserved_ids.is_empty() {
        let recorded = db::recorded_reservations(pg, &census.reserved_ids).await?;
        for rid in census
            .reserved_ids
            .iter()
            .filter(|r| !recorded.contains(*r))
        {
            let f = redis.reservation(aid, rid).await?;
            let valid_until = f
                .get("valid_until")
                .and_then(|v| v.parse::<i64>().ok())
                .unwrap_or(i64::MAX);
            if valid_until >= end.timestamp_millis() {
                stuck.skipped_fresh += 1;
            } else {
                stuck.found += 1;
                example(
                    &mut stuck.examples,
                    format!(
                        "{rid} ({})",
                        f.get("mq_status").cloned().unwrap_or_default()
                    ),
                );
            }
        }
    }
    Ok(())
}

/// Runs every check once.
pub async fn reconcile(
    settings: &Settings,
    pg: &impl GenericClient,
    redis: &RedisStore,
    args: &ReconcileArgs,
) -> anyhow::Result<ReconcileReport> {
    let started = Instant::now();
    let names = settings.names();
    let now = Utc::now();
    let start = now - Duration::hours(args.window_hours);
    let end = now - Duration::seconds(args.grace_secs);
    let mut report = ReconcileReport {
        window_start: Some(start),
        window_end: Some(end),
        ..Default::default()
    };

    let (created, paid, canceled, released) =
        missing_order_events(pg, names, start, end, now).await?;
    let expired = expired_not_canceled(pg, names, start, end, now).await?;
    let horizon = past_transaction_horizon(pg, settings, now).await?;

    // 5-6. Per activity SKU: reservations stuck in Redis and stock that does not add up.
    let mut stuck = Finding::new("reservation_neither_ordered_nor_released", 0, 0);
    let mut stock = Finding::new("stock_drift", 0, 0);
    for (aid, sku) in db::skus_in_window(pg, start, now).await? {
        stock.scanned += 1;
        stuck_reservations(pg, redis, (aid, sku), end, &mut stuck).await?;
        let inv = crate::invariants::check(pg, redis, &names.order_create_group, aid, sku).await?;
        for v in inv.violations {
            stock.found += 1;
            example(
                &mut stock.examples,
                format!("activity {aid} sku {sku}: {v}"),
            );
        }
    }
    report.findings = vec![
        created, paid, canceled, released, expired, horizon, stuck, stock,
    ];
    if report.emitted() > 0 {
        crate::pg::outbox::notify(pg).await?;
    }
    report.duration_secs = started.elapsed().as_secs_f64();
    Ok(report)
}

/// The report in node_exporter's textfile format.
pub fn textfile(report: &ReconcileReport) -> String {
    let mut out = String::new();
    let mut gauge = |name: &str, help: &str, value: &dyn Fn(&Finding) -> u64| {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} gauge\n"));
        for f in &report.findings {
            out.push_str(&format!("{name}{{kind=\"{}\"}} {}\n", f.kind, value(f)));
        }
    };
    gauge(
        "seckill_reconcile_scanned",
        "Rows the last reconcile run examined in its window, by kind.",
        &|f| f.scanned,
    );
    gauge(
        "seckill_reconcile_skipped_fresh",
        "Rows the last run left for the next as changed within its grace period, by kind.",
        &|f| f.skipped_fresh,
    );
    gauge(
        "seckill_reconcile_drift",
        "Drift found by the last reconcile run, by kind.",
        &|f| f.found as u64,
    );
    gauge(
        "seckill_reconcile_emitted",
        "Events re-emitted into the outbox by the last run, by kind.",
        &|f| f.emitted,
    );
    out.push_str(
        "# HELP seckill_reconcile_last_run_timestamp_seconds When the last run finished.\n",
    );
    out.push_str("# TYPE seckill_reconcile_last_run_timestamp_seconds gauge\n");
    out.push_str(&format!(
        "seckill_reconcile_last_run_timestamp_seconds {}\n",
        Utc::now().timestamp()
    ));
    out.push_str("# HELP seckill_reconcile_duration_seconds How long the last run took.\n");
    out.push_str("# TYPE seckill_reconcile_duration_seconds gauge\n");
    out.push_str(&format!(
        "seckill_reconcile_duration_seconds {:.3}\n",
        report.duration_secs
    ));
    out
}

/// `seckill reconcile`. Returns false with `--fail-on-drift` when drift was found.
pub async fn run(settings: Settings, args: ReconcileArgs) -> anyhow::Result<bool> {
    anyhow::ensure!(args.window_hours > 0, "--window-hours must be positive");
    anyhow::ensure!(args.grace_secs >= 0, "--grace-secs must not be negative");
    let (client, conn) = crate::pg::connect_one(&settings.pg).await?;
    let conn = tokio::spawn(conn);
    // A one-shot scan over the window, not the hot path: it gets a longer statement bound.
    crate::pg::set_statement_timeout(&client, 300).await?;
    let redis = RedisStore::connect(&settings.redis).await?;
    let report = reconcile(&settings, &client, &redis, &args).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "reconcile {} .. {} ({:.2}s)",
            report
                .window_start
                .map(|t| t.to_rfc3339())
                .unwrap_or_default(),
            report
                .window_end
                .map(|t| t.to_rfc3339())
                .unwrap_or_default(),
            report.duration_secs
        );
        for f in &report.findings {
            println!(
                "  {:<42} scanned {:>7}  skipped fresh {:>6}  found {:>6}  emitted {:>6}  {}",
                f.kind,
                f.scanned,
                f.skipped_fresh,
                f.found,
                f.emitted,
                f.examples.join(", ")
            );
        }
        println!(
            "drift: {}, events emitted: {}",
            report.drift(),
            report.emitted()
        );
    }
    if let Some(path) = &args.metrics_file {
        // Written whole then renamed, so the collector never reads half a file.
        let tmp = path.with_extension("prom.tmp");
        std::fs::write(&tmp, textfile(&report))?;
        std::fs::rename(&tmp, path)?;
    }
    drop(client);
    let _ = conn.await;
    Ok(!(args.fail_on_drift && report.drift() > 0))
}
