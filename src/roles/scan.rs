//! `seckill scan`: the two recovery loops that make every send eventually happen.
//!
//! * **Scanner** (§13): leases due reservations from each activity's pending index (Lua, a
//!   bounded batch, an owner and a lease), re-sends ORDER_CREATE_REQUESTED with the **same
//!   message_id**, and marks the outcome: CONFIRMED → MQ_SENT; UNKNOWN → rescheduled with
//!   exponential backoff and jitter (stock kept); DEFINITE_FAILURE → MQ_FAILED and released
//!   once. A dead scanner's leases expire and another scanner takes the work over.
//! * **Outbox relay** (002 §8.10): claims PENDING outbox rows without blocking other relays,
//!   sends them (delayed ones with their deliver time), marks them SENT with the broker id,
//!   backs off on failure and marks a row DEAD after `scan.relay_max_attempts` (ERROR log,
//!   `outbox_dead_total`). It wakes on the writers' NOTIFY and polls as a fallback.
//!
//! Several `scan` processes may run at once: the leases keep them out of each other's way.

use std::sync::Arc;
use std::time::Duration;

use chrono::{TimeZone, Utc};
use futures::{StreamExt, TryStreamExt};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::config::{Names, Settings};
use crate::domain::{
    OrderCreateRequested, TraceContext, EVENT_ORDER_CREATE_REQUESTED, SCHEMA_VERSION,
};
use crate::mq::{order_create_message, OutMessage, Publisher, SendOutcome};
use crate::pg::outbox::{self, backoff_ms, OutboxRow, OUTBOX_CHANNEL};
use crate::redis::RedisStore;
use crate::telemetry::Readiness;

/// What one scanner pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ScanStats {
    pub claimed: usize,
    pub confirmed: usize,
    pub unknown: usize,
    pub failed: usize,
    /// Activities taken off the work list in this pass (ended, nothing pending).
    pub retired: usize,
}

/// The reservation re-send scanner.
pub struct Scanner {
    redis: RedisStore,
    publisher: Arc<dyn Publisher>,
    settings: Arc<Settings>,
    names: Names,
    /// Lease owner id: host, pid and a random part, unique per scanner instance.
    owner: String,
}

fn owner_id(kind: &str) -> String {
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "host".to_string());
    format!("{kind}-{host}-{}-{}", std::process::id(), ulid::Ulid::new())
}

/// Rebuilds the original event from the reservation hash (the same ids, a higher retry count).
pub fn event_from_reservation(
    f: &std::collections::HashMap<String, String>,
) -> Option<OrderCreateRequested> {
    let s = |k: &str| f.get(k).cloned();
    let n = |k: &str| f.get(k).and_then(|v| v.parse::<i64>().ok());
    let ms = |k: &str| n(k).and_then(|v| Utc.timestamp_millis_opt(v).single());
    let reservation_id = s("reservation_id")?;
    let traceparent = s("traceparent").unwrap_or_default();
    let (trace_id, span_id) =
        crate::domain::ids::parse_traceparent(&traceparent).unwrap_or_default();
    Some(OrderCreateRequested {
        schema_version: SCHEMA_VERSION,
        event_type: EVENT_ORDER_CREATE_REQUESTED.to_string(),
        message_id: s("message_id")?,
        message_key: reservation_id.clone(),
        request_id: s("request_id")?,
        reservation_id,
        order_id: s("order_id")?,
        activity_id: n("activity_id")?,
        sku_id: n("sku_id")?,
        user_id: n("user_id")?,
        quantity: 1,
        reservation_created_at: ms("created_at")?,
        reservation_valid_until: ms("valid_until")?,
        created_at: Utc::now(),
        retry_count: (n("send_attempt").unwrap_or(1) - 1).max(0) as i32,
        replay_count: 0,
        producer: "seckill-scan".to_string(),
        trace: TraceContext {
            trace_id,
            span_id,
            traceparent,
        },
    })
}

impl Scanner {
    pub fn new(redis: RedisStore, publisher: Arc<dyn Publisher>, settings: Arc<Settings>) -> Self {
        Self {
            names: settings.names(),
            redis,
            publisher,
            settings,
            owner: owner_id("scanner"),
        }
    }

    /// One pass over every activity: claim what is due, re-send, record the outcome.
    pub async fn scan_once(&self) -> anyhow::Result<ScanStats> {
        let mut stats = ScanStats::default();
        let sc = &self.settings.scan;
        let mut pending_total = 0i64;
        let mut oldest_ms: Option<i64> = None;
        for activity_id in self.redis.activities().await? {
            let now_ms = Utc::now().timestamp_millis();
            let claimed = self
                .redis
                .claim_due(
                    activity_id,
                    now_ms,
                    sc.scanner_batch,
                    &self.owner,
                    sc.scanner_lease_ms,
                )
                .await?;
            if claimed.retire {
                // Ended long ago with nothing pending: no pass needs to look at it again.
                self.redis.retire_activity(activity_id).await?;
                stats.retired += 1;
                info!(
                    activity_id,
                    "activity ended with nothing pending; off the scanner's list"
                );
                continue;
            }
            let claims = claimed.reservations;
            stats.claimed += claims.len();
            // Injection point of §29.3: a scanner dies holding its leases.
            fail::fail_point!("scanner-holding-lease", |_| std::process::abort());
            let results: Vec<(&'static str, String)> = futures::stream::iter(claims)
                .map(|fields| self.resend(activity_id, fields))
                .buffer_unordered(sc.send_concurrency)
                .collect()
                .await;
            for (outcome, _) in &results {
                match *outcome {
                    "confirmed" => stats.confirmed += 1,
                    "unknown" => stats.unknown += 1,
                    _ => stats.failed += 1,
                }
            }
            let (count, oldest) = self.redis.pending_stats(activity_id).await?;
            pending_total += count;
            if let Some(o) = oldest {
                oldest_ms = Some(oldest_ms.map_or(o, |cur: i64| cur.min(o)));
            }
        }
        metrics::gauge!("reservation_mq_pending").set(pending_total as f64);
        let age = oldest_ms
            .map(|o| (Utc::now().timestamp_millis() - o).max(0) as f64 / 1000.0)
            .unwrap_or(0.0);
        metrics::gauge!("reservation_mq_pending_oldest_age_seconds").set(age);
        Ok(stats)
    }

    async fn resend(
        &self,
        activity_id: i64,
        fields: std::collections::HashMap<String, String>,
    ) -> (&'static str, String) {
        let rid = fields.get("reservation_id").cloned().unwrap_or_default();
        let Some(event) = event_from_reservation(&fields) else {
            error!(reservation_id = %rid, activity_id, "reservation hash is incomplete; cannot re-send");
            return ("invalid", rid);
        };
        let attempt = event.retry_count + 1;
        let msg = order_create_message(&self.names.order_create_topic, &event);
        let outcome = self
            .publisher
            .send(msg, self.settings.mq.send_timeout_ms)
            .await;
        metrics::counter!("reservation_resend_total", "outcome" => outcome.label()).increment(1);
        metrics::counter!("mq_publish_total", "topic" => "order_create", "outcome" => outcome.label())
            .increment(1);
        let now_ms = Utc::now().timestamp_millis();
        let label = outcome.label();
        let result = match &outcome {
            SendOutcome::Confirmed { broker_msg_id } => self
                .redis
                .mark_sent(activity_id, &rid, &event.message_id, broker_msg_id, now_ms)
                .await
                .map(|_| ()),
            SendOutcome::Unknown { error } => {
                metrics::counter!("mq_publish_unknown_total", "topic" => "order_create")
                    .increment(1);
                let wait = backoff_ms(
                    attempt,
                    self.settings.api.resend_backoff_ms,
                    self.settings.scan.resend_backoff_cap_ms,
                );
                self.redis
                    .schedule_resend(
                        activity_id,
                        &rid,
                        &event.message_id,
                        now_ms + wait as i64,
                        error,
                    )
                    .await
                    .map(|_| ())
            }
            SendOutcome::DefiniteFailure { error } => {
                error!(reservation_id = %rid, message_id = %event.message_id, order_id = %event.order_id,
                       send_attempt = attempt, send_outcome = "DEFINITE_FAILURE", error = %error,
                       "re-send refused by the broker; reservation released");
                self.redis
                    .mark_failed(
                        activity_id,
                        event.sku_id,
                        &rid,
                        &event.message_id,
                        error,
                        now_ms,
                    )
                    .await
                    .map(|_| ())
            }
        };
        if let Err(e) = result {
            // The lease expires and another pass retries with the same message_id.
            warn!(reservation_id = %rid, error = %e, "could not record the re-send outcome");
        }
        info!(reservation_id = %rid, message_id = %event.message_id, order_id = %event.order_id,
              request_id = %event.request_id, send_attempt = attempt, send_outcome = label,
              "reservation re-sent");
        (label, rid)
    }
}

/// The outbox relay.
pub struct Relay {
    pool: deadpool_postgres::Pool,
    publisher: Arc<dyn Publisher>,
    settings: Arc<Settings>,
}

/// The broker message for an outbox row: its event id is the `message_id` every consumer
/// deduplicates on; order events carry their order id as the ordering key.
pub fn outbox_message(row: &OutboxRow) -> OutMessage {
    let mut properties = vec![
        ("message_id".to_string(), row.event_id.clone()),
        (
            "event_type".to_string(),
            row.payload["event_type"].as_str().unwrap_or("").to_string(),
        ),
    ];
    if let Some(v) = row.aggregate_version {
        properties.push(("aggregate_version".to_string(), v.to_string()));
    }
    if let Some(tp) = row.payload["traceparent"]
        .as_str()
        .filter(|t| !t.is_empty())
    {
        properties.push(("traceparent".to_string(), tp.to_string()));
    }
    let now_ms = Utc::now().timestamp_millis();
    OutMessage {
        topic: row.topic.clone(),
        tag: row.tag.clone(),
        keys: vec![row.message_key.clone()],
        properties,
        body: serde_json::to_vec(&row.payload).unwrap_or_default(),
        // Past deliver times are sent as normal messages: the cancel is due now.
        deliver_time_ms: row
            .deliver_at
            .map(|d| d.timestamp_millis())
            .filter(|&ms| ms > now_ms + 1000),
        // Events of one order go to one queue, in version order (§18).
        sharding_key: if row.topic.ends_with("_SECKILL_ORDER_EVENT_V1") {
            row.aggregate_id.clone()
        } else {
            None
        },
    }
}

impl Relay {
    pub fn new(
        pool: deadpool_postgres::Pool,
        publisher: Arc<dyn Publisher>,
        settings: Arc<Settings>,
    ) -> Self {
        Self {
            pool,
            publisher,
            settings,
        }
    }

    /// Claims one batch, sends it and records the outcomes. Returns the rows claimed.
    pub async fn relay_once(&self) -> anyhow::Result<usize> {
        let sc = &self.settings.scan;
        let client = self.pool.get().await?;
        let rows =
            outbox::claim(&**client, sc.relay_batch as i64, sc.relay_lease_secs as f64).await?;
        if rows.is_empty() {
            return Ok(0);
        }
        let claimed = rows.len();
        let outcomes = self.send_rows(rows).await;
        // Injection point of §29.3: the relay dies after the send, before marking SENT.
        fail::fail_point!("relay-after-send-before-mark", |_| std::process::abort());
        let mut sent: Vec<(String, String)> = Vec::new();
        let mut failed: Vec<outbox::Failure> = Vec::new();
        for (row, outcome) in outcomes {
            metrics::counter!("outbox_publish_total", "tag" => tag_label(&row.tag), "outcome" => outcome.label())
                .increment(1);
            match outcome {
                SendOutcome::Confirmed { broker_msg_id } => {
                    sent.push((row.event_id, broker_msg_id))
                }
                SendOutcome::Unknown { error } | SendOutcome::DefiniteFailure { error } => {
                    let dead = row.attempts >= sc.relay_max_attempts;
                    let wait = backoff_ms(
                        row.attempts,
                        sc.relay_backoff_base_ms,
                        sc.relay_backoff_cap_ms,
                    );
                    if dead {
                        metrics::counter!("outbox_dead_total", "tag" => tag_label(&row.tag))
                            .increment(1);
                        error!(event_id = %row.event_id, topic = %row.topic, tag = %row.tag,
                               attempts = row.attempts, error = %error,
                               "outbox event DEAD after its last attempt; operator action needed");
                    } else {
                        warn!(event_id = %row.event_id, topic = %row.topic, attempts = row.attempts,
                              retry_in_ms = wait, error = %error, "outbox send failed; will retry");
                    }
                    failed.push(outbox::Failure {
                        event_id: row.event_id,
                        error,
                        backoff_ms: wait as i64,
                        dead,
                    });
                }
            }
        }
        // Both outcomes in one round trip (pipelined on the one connection).
        let (marked, failures) = futures::join!(
            outbox::mark_sent(&**client, &sent),
            outbox::mark_failed(&**client, &failed)
        );
        marked?;
        failures?;
        Ok(claimed)
    }

    /// Sends claimed rows; one outcome per row. Immediate messages go out in one
    /// [`Publisher::send_batch`] call, which the producer turns into one broker batch per queue
    /// (an order's events share a queue, in version order); timer messages (a future deliver
    /// time), which the broker takes only one per call, go out `send_concurrency` at a time
    /// meanwhile.
    async fn send_rows(&self, rows: Vec<OutboxRow>) -> Vec<(OutboxRow, SendOutcome)> {
        let timeout = self.settings.mq.send_timeout_ms;
        let (mut immediate, mut timed) = (Vec::new(), Vec::new());
        for row in rows {
            let msg = outbox_message(&row);
            if msg.deliver_time_ms.is_some() {
                timed.push((row, msg));
            } else {
                immediate.push((row, msg));
            }
        }
        let batch = async {
            if immediate.is_empty() {
                return Vec::new();
            }
            let (rows, msgs): (Vec<OutboxRow>, Vec<OutMessage>) = immediate.into_iter().unzip();
            let outcomes = self.publisher.send_batch(msgs, timeout).await;
            rows.into_iter().zip(outcomes).collect::<Vec<_>>()
        };
        let singles = futures::stream::iter(timed)
            .map(|(row, msg)| async move { (row, self.publisher.send(msg, timeout).await) })
            .buffer_unordered(self.settings.scan.send_concurrency)
            .collect::<Vec<_>>();
        let (mut out, singles) = tokio::join!(batch, singles);
        out.extend(singles);
        out
    }

    /// Updates the backlog gauges.
    pub async fn observe(&self) -> anyhow::Result<()> {
        let client = self.pool.get().await?;
        let (pending, oldest, dead) = outbox::backlog(&**client).await?;
        metrics::gauge!("outbox_pending").set(pending as f64);
        metrics::gauge!("outbox_pending_oldest_age_seconds").set(oldest);
        metrics::gauge!("outbox_dead").set(dead as f64);
        Ok(())
    }
}

/// Bounded label for an outbox tag.
fn tag_label(tag: &str) -> &'static str {
    match tag {
        "ORDER_CREATED" => "ORDER_CREATED",
        "ORDER_PAID" => "ORDER_PAID",
        "ORDER_CANCELED" => "ORDER_CANCELED",
        "CANCEL_IF_UNPAID" => "CANCEL_IF_UNPAID",
        "RELEASE_RESERVATION" => "RELEASE_RESERVATION",
        _ => "OTHER",
    }
}

/// Holds a LISTEN connection and wakes the relay on every NOTIFY; reconnects on loss.
async fn listen(settings: Arc<Settings>, wake: Arc<Notify>, shutdown: CancellationToken) {
    while !shutdown.is_cancelled() {
        let cfg = match crate::pg::pg_config(&settings.pg) {
            Ok(c) => c,
            Err(_) => return,
        };
        match cfg.connect(tokio_postgres::NoTls).await {
            Ok((client, mut conn)) => {
                let messages = futures::stream::poll_fn(move |cx| conn.poll_message(cx));
                let wake2 = wake.clone();
                let mut driver = tokio::spawn(async move {
                    let _ = messages
                        .try_for_each(|m| {
                            if let tokio_postgres::AsyncMessage::Notification(_) = m {
                                wake2.notify_one();
                            }
                            futures::future::ready(Ok(()))
                        })
                        .await;
                });
                if client
                    .batch_execute(&format!("LISTEN {OUTBOX_CHANNEL}"))
                    .await
                    .is_ok()
                {
                    tokio::select! {
                        _ = shutdown.cancelled() => { driver.abort(); return; }
                        _ = &mut driver => {}
                    }
                }
                warn!("outbox LISTEN connection lost; polling until it is back");
            }
            Err(e) => warn!(error = %e, "cannot open the outbox LISTEN connection"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

/// `seckill scan`.
pub async fn run(settings: Settings) -> anyhow::Result<()> {
    let settings = Arc::new(settings);
    let sc = settings.scan.clone();
    let redis = RedisStore::connect(&settings.redis).await?;
    let pool = crate::pg::connect_pool(&settings.pg, 2).await?;
    let publisher = crate::mq::connect_publisher(&settings).await?;
    let ready = Readiness::default();
    let shutdown = CancellationToken::new();
    let ops =
        crate::telemetry::serve_ops(sc.metrics_listen, ready.clone(), shutdown.clone()).await?;
    let wake = Arc::new(Notify::new());
    let listener = tokio::spawn(listen(settings.clone(), wake.clone(), shutdown.clone()));

    let scanner = Scanner::new(redis, publisher.clone(), settings.clone());
    let relay = Relay::new(pool, publisher, settings.clone());
    let stop = shutdown.clone();
    let scan_loop = tokio::spawn(async move {
        while !stop.is_cancelled() {
            let busy = match scanner.scan_once().await {
                Ok(s) => s.claimed > 0,
                Err(e) => {
                    warn!(error = %e, "scanner pass failed");
                    false
                }
            };
            if !busy {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(Duration::from_millis(sc.scanner_poll_ms)) => {}
                }
            }
        }
    });
    let stop = shutdown.clone();
    let relay_loop = tokio::spawn(async move {
        let mut last_observe = std::time::Instant::now() - Duration::from_secs(10);
        while !stop.is_cancelled() {
            let claimed = match relay.relay_once().await {
                Ok(n) => n,
                Err(e) => {
                    warn!(error = %e, "relay pass failed");
                    0
                }
            };
            if last_observe.elapsed() >= Duration::from_secs(1) {
                let _ = relay.observe().await;
                last_observe = std::time::Instant::now();
            }
            if claimed < relay.settings.scan.relay_batch {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = wake.notified() => {}
                    _ = tokio::time::sleep(Duration::from_millis(relay.settings.scan.relay_poll_ms)) => {}
                }
            }
        }
    });
    // Retention: settled bookkeeping rows past their retention, in small batches.
    let retention_pool = crate::pg::connect_pool(&settings.pg, 1).await?;
    let (stop, rt) = (shutdown.clone(), settings.retention.clone());
    let retention_loop = tokio::spawn(async move {
        while !stop.is_cancelled() {
            if let Ok(client) = retention_pool.get().await {
                match crate::pg::retention::purge_all(&**client, &rt).await {
                    Ok(done) => info!(deleted = ?done, "retention pass"),
                    Err(e) => warn!(error = %e, "retention pass failed"),
                }
            }
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(Duration::from_secs(rt.interval_secs)) => {}
            }
        }
    });
    ready.set(true);
    info!(owner_metrics = %sc.metrics_listen, "scan started: reservation scanner and outbox relay");
    crate::telemetry::shutdown_signal().await;
    info!("shutdown signal: finishing the current passes");
    ready.set(false);
    shutdown.cancel();
    let grace = Duration::from_secs(sc.shutdown_grace_secs);
    let _ = tokio::time::timeout(grace, async {
        let _ = scan_loop.await;
        let _ = relay_loop.await;
        let _ = retention_loop.await;
    })
    .await;
    let _ = listener.await;
    let _ = ops.await;
    info!("scan stopped");
    Ok(())
}
