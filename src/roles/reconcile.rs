//! `seckill reconcile`: a one-shot check for cron or a systemd timer (004; 000 §27). Within a
//! window and past a grace period it finds orders whose events are missing, expired unpaid
//! orders never cancelled, reservations that neither became orders nor were released, and
//! stock that does not add up; it emits each missing event into the outbox with a
//! deterministic id (a second run emits nothing new) and never changes business state.

use std::time::Instant;

use chrono::{DateTime, Duration, Utc};
use clap::Args;
use serde::Serialize;
use serde_json::json;
use tokio_postgres::GenericClient;

use crate::config::Settings;
use crate::pg::order_state::{order_canceled_event_id, order_paid_event_id};
use crate::pg::order_tx::{compensation_event_id, order_created_event_id};
use crate::pg::outbox::OUTBOX_CHANNEL;
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

/// One kind of drift: how many found, how many events emitted for it, and some examples.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Finding {
    pub kind: &'static str,
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

async fn emit(client: &impl GenericClient, e: &Emit) -> Result<u64, tokio_postgres::Error> {
    client
        .execute(
            "INSERT INTO event_outbox (event_id, topic, tag, message_key, aggregate_id, aggregate_version, payload)
             VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (event_id) DO NOTHING",
            &[&e.event_id, &e.topic, &e.tag, &e.key, &e.aggregate_id, &e.version, &e.payload],
        )
        .await
}

fn example(list: &mut Vec<String>, s: String) {
    if list.len() < 10 {
        list.push(s);
    }
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

    // 1-3. Orders whose events are missing from the outbox.
    let rows = pg
        .query(
            "SELECT o.order_id, o.reservation_id, o.activity_id, o.sku_id, o.user_id, o.status, o.version,
                    o.expires_at, o.payment_id,
                    EXISTS (SELECT 1 FROM event_outbox e WHERE e.event_id = o.order_id || '.v1.ORDER_CREATED'),
                    EXISTS (SELECT 1 FROM event_outbox e WHERE e.event_id = o.order_id || '.v' || o.version || '.ORDER_PAID'),
                    EXISTS (SELECT 1 FROM event_outbox e WHERE e.event_id = o.order_id || '.v' || o.version || '.ORDER_CANCELED'),
                    EXISTS (SELECT 1 FROM event_outbox e WHERE e.event_id = o.reservation_id || '.RELEASE_RESERVATION')
             FROM orders o
             WHERE o.updated_at >= $1 AND o.updated_at < $2",
            &[&start, &end],
        )
        .await?;
    let mut created = Finding {
        kind: "missing_order_created",
        ..Default::default()
    };
    let mut paid = Finding {
        kind: "missing_order_paid",
        ..Default::default()
    };
    let mut canceled = Finding {
        kind: "missing_order_canceled",
        ..Default::default()
    };
    let mut released = Finding {
        kind: "missing_release_after_cancel",
        ..Default::default()
    };
    for r in &rows {
        let (oid, rid, aid, sku, uid): (String, String, i64, i64, i64) =
            (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4));
        let (status, version, expires_at): (String, i32, DateTime<Utc>) =
            (r.get(5), r.get(6), r.get(7));
        let base = json!({"order_id": oid, "reservation_id": rid, "activity_id": aid, "sku_id": sku,
                          "user_id": uid, "reconciled_at": now});
        let with = |extra: serde_json::Value| {
            let mut v = base.clone();
            if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
                o.extend(e.clone());
            }
            v
        };
        if !r.get::<_, bool>(9) {
            created.found += 1;
            example(&mut created.examples, oid.clone());
            let id = order_created_event_id(&oid);
            created.emitted += emit(pg, &Emit {
                payload: with(json!({"schema_version": 1, "event_type": "ORDER_CREATED", "event_id": id,
                                     "status": "CREATED", "aggregate_version": 1, "expires_at": expires_at})),
                event_id: id, topic: names.order_event_topic.clone(), tag: "ORDER_CREATED",
                key: oid.clone(), aggregate_id: Some(oid.clone()), version: Some(1),
            }).await?;
        }
        if status == "PAID" && !r.get::<_, bool>(10) {
            paid.found += 1;
            example(&mut paid.examples, oid.clone());
            let id = order_paid_event_id(&oid, version);
            paid.emitted += emit(
                pg,
                &Emit {
                    payload: with(
                        json!({"schema_version": 1, "event_type": "ORDER_PAID", "event_id": id,
                                     "status": "PAID", "aggregate_version": version,
                                     "payment_id": r.get::<_, Option<String>>(8)}),
                    ),
                    event_id: id,
                    topic: names.order_event_topic.clone(),
                    tag: "ORDER_PAID",
                    key: oid.clone(),
                    aggregate_id: Some(oid.clone()),
                    version: Some(version),
                },
            )
            .await?;
        }
        if status == "CANCELED" {
            if !r.get::<_, bool>(11) {
                canceled.found += 1;
                example(&mut canceled.examples, oid.clone());
                let id = order_canceled_event_id(&oid, version);
                canceled.emitted += emit(pg, &Emit {
                    payload: with(json!({"schema_version": 1, "event_type": "ORDER_CANCELED", "event_id": id,
                                         "status": "CANCELED", "aggregate_version": version})),
                    event_id: id, topic: names.order_event_topic.clone(), tag: "ORDER_CANCELED",
                    key: oid.clone(), aggregate_id: Some(oid.clone()), version: Some(version),
                }).await?;
            }
            if !r.get::<_, bool>(12) {
                released.found += 1;
                example(&mut released.examples, rid.clone());
                let id = compensation_event_id(&rid);
                released.emitted += emit(
                    pg,
                    &Emit {
                        payload: with(
                            json!({"schema_version": 1, "event_type": "RELEASE_RESERVATION",
                                         "event_id": id, "reason": "ORDER_CANCELED"}),
                        ),
                        event_id: id,
                        topic: names.compensate_topic.clone(),
                        tag: "RELEASE_RESERVATION",
                        key: rid.clone(),
                        aggregate_id: None,
                        version: None,
                    },
                )
                .await?;
            }
        }
    }

    // 4. Expired unpaid orders nobody cancelled: a fresh cancel trigger (deterministic id).
    let mut expired = Finding {
        kind: "expired_unpaid_not_canceled",
        ..Default::default()
    };
    for r in pg
        .query(
            "SELECT order_id, activity_id, sku_id, expires_at FROM orders
             WHERE status IN ('CREATED', 'PAYING') AND expires_at < $1 AND expires_at >= $2",
            &[&end, &start],
        )
        .await?
    {
        let (oid, aid, sku, expires_at): (String, i64, i64, DateTime<Utc>) =
            (r.get(0), r.get(1), r.get(2), r.get(3));
        expired.found += 1;
        example(&mut expired.examples, oid.clone());
        let id = format!("{oid}.CANCEL_IF_UNPAID.reconcile");
        expired.emitted += emit(pg, &Emit {
            payload: json!({"schema_version": 1, "event_type": "CANCEL_ORDER_IF_UNPAID", "event_id": id,
                            "order_id": oid, "activity_id": aid, "sku_id": sku, "expires_at": expires_at,
                            "reconciled_at": now}),
            event_id: id, topic: names.order_timeout_topic.clone(), tag: "CANCEL_IF_UNPAID",
            key: oid.clone(), aggregate_id: Some(oid.clone()), version: None,
        }).await?;
    }

    // 5-6. Per activity SKU: reservations stuck in Redis and stock that does not add up.
    let mut stuck = Finding {
        kind: "reservation_neither_ordered_nor_released",
        ..Default::default()
    };
    let mut stock = Finding {
        kind: "stock_drift",
        ..Default::default()
    };
    let skus = pg
        .query(
            "SELECT s.activity_id, s.sku_id FROM activity_skus s JOIN activities a USING (activity_id)
             WHERE a.ends_at >= $1 AND a.starts_at < $2",
            &[&start, &now],
        )
        .await?;
    for s in &skus {
        let (aid, sku): (i64, i64) = (s.get(0), s.get(1));
        let census = redis.reservation_census(aid, sku).await?;
        if !census.reserved_ids.is_empty() {
            let recorded: std::collections::HashSet<String> = pg
                .query(
                    "SELECT reservation_id FROM reservations WHERE reservation_id = ANY($1::text[])",
                    &[&census.reserved_ids],
                )
                .await?
                .iter()
                .map(|r| r.get(0))
                .collect();
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
                if valid_until < end.timestamp_millis() {
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
        let inv = crate::invariants::check(pg, redis, &names.order_create_group, aid, sku).await?;
        for v in inv.violations {
            stock.found += 1;
            example(
                &mut stock.examples,
                format!("activity {aid} sku {sku}: {v}"),
            );
        }
    }
    report.findings = vec![created, paid, canceled, released, expired, stuck, stock];
    if report.emitted() > 0 {
        pg.batch_execute(&format!("NOTIFY {OUTBOX_CHANNEL}"))
            .await?;
    }
    report.duration_secs = started.elapsed().as_secs_f64();
    Ok(report)
}

/// The report in node_exporter's textfile format.
pub fn textfile(report: &ReconcileReport) -> String {
    let mut out = String::new();
    out.push_str(
        "# HELP seckill_reconcile_drift Drift found by the last reconcile run, by kind.\n",
    );
    out.push_str("# TYPE seckill_reconcile_drift gauge\n");
    for f in &report.findings {
        out.push_str(&format!(
            "seckill_reconcile_drift{{kind=\"{}\"}} {}\n",
            f.kind, f.found
        ));
    }
    out.push_str("# HELP seckill_reconcile_emitted Events re-emitted into the outbox by the last run, by kind.\n");
    out.push_str("# TYPE seckill_reconcile_emitted gauge\n");
    for f in &report.findings {
        out.push_str(&format!(
            "seckill_reconcile_emitted{{kind=\"{}\"}} {}\n",
            f.kind, f.emitted
        ));
    }
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
    let cfg = crate::pg::pg_config(&settings.pg)?;
    let (client, conn) = cfg.connect(tokio_postgres::NoTls).await?;
    let conn = tokio::spawn(conn);
    // A one-shot scan over the window, not the hot path: it gets a longer statement bound.
    client
        .batch_execute("SET statement_timeout = '300s'")
        .await?;
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
                "  {:<42} found {:>6}  emitted {:>6}  {}",
                f.kind,
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
