//! The reservation re-send scanner (docs/ARCHITECTURE.md#recovery-paths): leases due
//! reservations from each activity's pending index (Lua, a bounded batch, an owner and a
//! lease), re-sends ORDER_CREATE_REQUESTED with the **same message_id**, and marks the outcome:
//! CONFIRMED → MQ_SENT; UNKNOWN → rescheduled with exponential backoff and jitter (stock
//! kept); DEFINITE_FAILURE → retried while the reservation is valid, then settled from
//! PostgreSQL, never released on the broker's word alone: an earlier copy may be stored
//! (docs/ARCHITECTURE.md#uncertain-sends). A dead scanner's leases expire and another scanner
//! takes the work over.

use std::sync::Arc;

use chrono::Utc;
use futures::StreamExt;
use tracing::{error, info, warn};

use crate::config::{Names, Settings};
use crate::domain::event::ReservationFacts;
use crate::domain::Decision;
use crate::domain::{OrderCreateRequested, TraceContext};
use crate::mq::{order_create_message, Publisher, SendOutcome};
use crate::pg::order_tx::{withdraw, Inbound, TxNames};
use crate::pg::outbox::backoff_ms;
use crate::redis::reservation::ReservationHash;
use crate::redis::{RedisStore, Release, Shard};

use super::unconsumed::{AwaitingStats, Progress, ProgressReader};

/// What one scanner pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ScanStats {
    pub claimed: usize,
    pub confirmed: usize,
    pub unknown: usize,
    pub failed: usize,
    /// Refused re-sends past validity and grace, settled from PostgreSQL.
    pub settled: usize,
    /// Activities taken off the work list in this pass (ended, nothing pending).
    pub retired: usize,
    /// Leftover moves between stock buckets made, and open ones finished.
    pub moves: usize,
    pub moves_resumed: usize,
    /// Confirmed sends checked against the order-create inbox
    /// (docs/ARCHITECTURE.md#a-dead-brokers-messages).
    pub awaiting: AwaitingStats,
}

/// The reservation re-send scanner.
pub struct Scanner {
    pub(super) redis: RedisStore,
    /// Where an uncertain reservation is settled: the order-create group's inbox.
    pub(super) pool: deadpool_postgres::Pool,
    tx_names: TxNames,
    pub(super) publisher: Arc<dyn Publisher>,
    pub(super) settings: Arc<Settings>,
    pub(super) names: Names,
    /// Lease owner id: host, pid and a random part, unique per scanner instance.
    owner: String,
    /// How far the order-create group got; without it confirmed sends are never sent again.
    pub(super) progress: Option<Progress>,
}

fn owner_id(kind: &str) -> String {
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "host".to_string());
    format!("{kind}-{host}-{}-{}", std::process::id(), ulid::Ulid::new())
}

/// Rebuilds the original event from the reservation hash (the same ids, a higher retry count)
/// in schema `schema` (`mq.order_event_schema`).
pub fn event_from_reservation(
    f: &std::collections::HashMap<String, String>,
    schema: i32,
) -> Option<OrderCreateRequested> {
    let r = ReservationHash::parse(f)?;
    let (trace_id, span_id) =
        crate::domain::ids::parse_traceparent(&r.traceparent).unwrap_or_default();
    let facts = ReservationFacts {
        reservation: r.reservation(),
        quantity: 1,
        created_at: r.created_at,
        valid_until: r.valid_until,
        channel: r.channel.as_deref(),
    };
    let trace = TraceContext {
        trace_id,
        span_id,
        traceparent: r.traceparent.clone(),
    };
    let retry_count = (r.send_attempt - 1).max(0) as i32;
    Some(OrderCreateRequested::new(
        &facts,
        schema,
        "seckill-scan",
        retry_count,
        trace,
    ))
}

impl Scanner {
    pub fn new(
        redis: RedisStore,
        pool: deadpool_postgres::Pool,
        publisher: Arc<dyn Publisher>,
        settings: Arc<Settings>,
    ) -> Self {
        Self {
            names: settings.names(),
            tx_names: TxNames::order_create(&settings),
            redis,
            pool,
            publisher,
            settings,
            owner: owner_id("scanner"),
            progress: None,
        }
    }

    /// Watches confirmed sends until the consumers took them, reading the group's progress
    /// from `progress` (docs/ARCHITECTURE.md#a-dead-brokers-messages).
    pub fn with_progress(mut self, progress: Arc<dyn ProgressReader>) -> Self {
        self.progress = Some(Progress::new(progress));
        self
    }

    /// One pass over every activity: claim what is due, re-send, record the outcome.
    pub async fn scan_once(&self) -> anyhow::Result<ScanStats> {
        let mut stats = ScanStats::default();
        let mut pending_total = 0i64;
        let mut oldest_ms: Option<i64> = None;
        let mut awaiting_total = 0u64;
        let watching = self.settings.scan.unconsumed_resend_ms > 0;
        let taken_until = if watching {
            self.taken_until_ms().await
        } else {
            None
        };
        for activity_id in self.redis.activities().await? {
            let mut retire = true;
            for shard in self.redis.shards(activity_id).await? {
                retire &= self.scan_shard(shard, &mut stats).await?;
                if !watching {
                    continue;
                }
                // Without a reading nothing is due (cutoff 0): the claim only counts.
                let awaiting = self
                    .check_awaiting(shard, taken_until.unwrap_or(0), &mut stats.awaiting)
                    .await?;
                awaiting_total += awaiting;
                retire &= awaiting == 0;
            }
            if retire {
                // Ended long ago with nothing pending: no pass needs to look at it again.
                let keep = u64::from(self.settings.retention.activity_keys_hours) * 3600;
                let expiring = self.redis.retire_activity(activity_id, keep).await?;
                stats.retired += 1;
                info!(
                    activity_id,
                    keys_expiring = expiring,
                    keep_hours = self.settings.retention.activity_keys_hours,
                    "activity ended with nothing pending; off the scanner's list, its keys expire"
                );
                continue;
            }
            match super::rebalance::rebalance(&self.redis, activity_id, &self.owner).await {
                Ok(m) => {
                    stats.moves += m.moves;
                    stats.moves_resumed += m.resumed;
                }
                // Whatever a failed pass left open, the next one finishes first.
                Err(e) => warn!(activity_id, error = %e, "leftover move failed; resumed next pass"),
            }
            let (count, oldest) = self.redis.pending_stats(activity_id).await?;
            pending_total += count;
            if let Some(o) = oldest {
                oldest_ms = Some(oldest_ms.map_or(o, |cur: i64| cur.min(o)));
            }
        }
        metrics::gauge!("reservation_mq_pending").set(pending_total as f64);
        metrics::gauge!("reservation_awaiting_consumption").set(awaiting_total as f64);
        let age = oldest_ms
            .map(|o| (Utc::now().timestamp_millis() - o).max(0) as f64 / 1000.0)
            .unwrap_or(0.0);
        metrics::gauge!("reservation_mq_pending_oldest_age_seconds").set(age);
        Ok(stats)
    }

    /// Claims what is due in one shard (an activity's stock bucket), re-sends it and records
    /// the outcomes; `true` when the shard has nothing pending and its activity ended long
    /// ago (it can retire).
    async fn scan_shard(&self, shard: Shard, stats: &mut ScanStats) -> anyhow::Result<bool> {
        let sc = &self.settings.scan;
        let now_ms = Utc::now().timestamp_millis();
        let claimed = self
            .redis
            .claim_due(
                shard,
                now_ms,
                sc.scanner_batch,
                &self.owner,
                sc.scanner_lease_ms,
            )
            .await?;
        if claimed.retire {
            return Ok(true);
        }
        let claims = claimed.reservations;
        stats.claimed += claims.len();
        // Fault-injection point: a scanner dies holding its leases.
        fail::fail_point!("scanner-holding-lease", |_| std::process::abort());
        let results: Vec<(&'static str, String)> = futures::stream::iter(claims)
            .map(|fields| self.resend(shard.activity_id, fields))
            .buffer_unordered(sc.send_concurrency)
            .collect()
            .await;
        for (outcome, _) in &results {
            match *outcome {
                "confirmed" => stats.confirmed += 1,
                "unknown" => stats.unknown += 1,
                "settled" => stats.settled += 1,
                _ => stats.failed += 1,
            }
        }
        Ok(false)
    }

    /// Keeps the reservation `MQ_PENDING` and schedules its next re-send after the backoff of
    /// this attempt.
    async fn resend_later(
        &self,
        activity_id: i64,
        rid: &str,
        message_id: &str,
        attempt: i32,
        now_ms: i64,
        error: &str,
    ) -> anyhow::Result<()> {
        let wait = backoff_ms(
            attempt,
            self.settings.api.resend_backoff_ms,
            self.settings.scan.resend_backoff_cap_ms,
        );
        self.redis
            .schedule_resend(activity_id, rid, message_id, now_ms + wait as i64, error)
            .await
            .map(|_| ())
    }

    /// Settles a reservation whose re-send was refused after its validity and grace. The
    /// consumer's own transaction withdraws the message (`pg::order_tx::withdraw`): rejected,
    /// with its compensation, and its inbox row fences any copy still in the broker (a later
    /// delivery is a duplicate). If a copy reached the consumer first, the inbox says so and
    /// that decision stands (its order, or its rejection's compensation). Returns the verdict:
    /// `fenced` (the unit released here, once, through the compensation script) or `consumed`.
    pub(super) async fn settle(
        &self,
        activity_id: i64,
        rid: &str,
        event: &OrderCreateRequested,
        now_ms: i64,
    ) -> anyhow::Result<&'static str> {
        let item = Inbound {
            event: Ok(event.clone()),
            raw_body: event.encode(),
            properties: serde_json::json!({ "message_id": event.message_id, "settled_by": self.owner }),
            property_message_id: Some(event.message_id.clone()),
            broker_msg_id: String::new(),
            delivery_attempt: 0,
        };
        let mut client = self.pool.get().await?;
        let decisions = withdraw(
            &mut client,
            &self.tx_names,
            std::slice::from_ref(&item),
            Utc::now(),
        )
        .await?;
        let (verdict, mq_status) = match decisions.first() {
            Some(Decision::Rejected(_)) => ("fenced", "MQ_FENCED"),
            _ => ("consumed", "MQ_SENT"),
        };
        if verdict == "fenced" {
            self.redis
                .release_many(
                    &[Release {
                        activity_id,
                        sku_id: event.sku_id,
                        reservation_id: rid,
                        reason: "SEND_FENCED",
                    }],
                    now_ms,
                )
                .await?;
        }
        self.redis
            .settle(activity_id, rid, &event.message_id, mq_status, now_ms)
            .await?;
        metrics::counter!("reservation_settled_total", "verdict" => verdict).increment(1);
        Ok(verdict)
    }

    /// Sends a copy of a reservation's message (the same message_id) and counts it as a send
    /// to the order-create topic.
    pub(super) async fn send_copy(&self, event: &OrderCreateRequested) -> SendOutcome {
        let msg = order_create_message(&self.names.order_create_topic, event);
        let outcome = self
            .publisher
            .send(msg, self.settings.mq.send_timeout_ms)
            .await;
        metrics::counter!("mq_publish_total", "topic" => "order_create", "outcome" => outcome.label())
            .increment(1);
        if let SendOutcome::Unknown { .. } = outcome {
            metrics::counter!("mq_publish_unknown_total", "topic" => "order_create").increment(1);
        }
        outcome
    }

    async fn resend(
        &self,
        activity_id: i64,
        fields: std::collections::HashMap<String, String>,
    ) -> (&'static str, String) {
        let rid = fields.get("reservation_id").cloned().unwrap_or_default();
        let Some(event) = event_from_reservation(&fields, self.settings.mq.order_event_schema)
        else {
            error!(reservation_id = %rid, activity_id, "reservation hash is incomplete; cannot re-send");
            return ("invalid", rid);
        };
        let attempt = event.retry_count + 1;
        let outcome = self.send_copy(&event).await;
        metrics::counter!("reservation_resend_total", "outcome" => outcome.label()).increment(1);
        let now_ms = Utc::now().timestamp_millis();
        let label = outcome.label();
        let result = match &outcome {
            SendOutcome::Confirmed { broker_msg_id } => self
                .redis
                .mark_sent(activity_id, &rid, &event.message_id, broker_msg_id, now_ms)
                .await
                .map(|_| ()),
            SendOutcome::Unknown { error } => {
                self.resend_later(activity_id, &rid, &event.message_id, attempt, now_ms, error)
                    .await
            }
            // The buyer of a reservation the scanner re-sends was answered 202: a refusal does
            // not release it while it is valid. Right after a broker restart, a refusal such as
            // "topic route not found" is only the name server catching up; it is retried with
            // backoff like an unknown outcome.
            SendOutcome::DefiniteFailure { error }
                if now_ms
                    < event.reservation_valid_until.timestamp_millis()
                        + self.settings.scan.settle_grace_ms as i64 =>
            {
                metrics::counter!("reservation_resend_refused_total").increment(1);
                warn!(reservation_id = %rid, message_id = %event.message_id, order_id = %event.order_id,
                      send_attempt = attempt, send_outcome = "DEFINITE_FAILURE", error = %error,
                      "re-send refused by the broker; the buyer holds a 202, so it is retried until the reservation expires");
                self.resend_later(activity_id, &rid, &event.message_id, attempt, now_ms, error)
                    .await
            }
            // Refused after the reservation's validity: this copy is not stored, but an earlier
            // one may be, so PostgreSQL decides.
            SendOutcome::DefiniteFailure { error } => {
                match self.settle(activity_id, &rid, &event, now_ms).await {
                    Ok(verdict) => {
                        warn!(reservation_id = %rid, message_id = %event.message_id, order_id = %event.order_id,
                              request_id = %event.request_id, send_attempt = attempt,
                              send_outcome = "DEFINITE_FAILURE", error = %error, verdict,
                              "re-send refused after the reservation expired; settled from PostgreSQL");
                        return ("settled", rid);
                    }
                    Err(e) => {
                        warn!(reservation_id = %rid, message_id = %event.message_id, error = %e,
                              "could not settle a refused reservation from PostgreSQL; retried later");
                        self.resend_later(
                            activity_id,
                            &rid,
                            &event.message_id,
                            attempt,
                            now_ms,
                            error,
                        )
                        .await
                    }
                }
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
