//! The reservation re-send scanner (docs/architecture/recovery.md#recovery-paths): leases due
//! reservations from each activity's pending index (Lua, a bounded batch, an owner and a
//! lease), re-sends ORDER_CREATE_REQUESTED with the **same message_id**, and marks the outcome:
//! CONFIRMED → MQ_SENT; UNKNOWN → rescheduled with exponential backoff and jitter (stock
//! kept); DEFINITE_FAILURE → retried while the reservation is valid, then settled from
//! PostgreSQL, never released on the broker's word alone: an earlier copy may be stored
//! (docs/architecture/hot-path.md#uncertain-sends). A dead scanner's leases expire and another
//! scanner takes the work over.

use std::sync::Arc;

use chrono::Utc;
use futures::StreamExt;
use tracing::{error, info, warn};

use crate::config::Settings;
use crate::domain::OrderCreateRequested;
use crate::mq::{Publisher, SendOutcome};
use crate::pg::outbox::backoff_ms;
use crate::redis::{RedisStore, Shard};

use super::copies::{event_from_reservation, Copies};
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
    /// (docs/architecture/messages.md#a-dead-brokers-messages).
    pub awaiting: AwaitingStats,
}

/// The reservation re-send scanner.
pub struct Scanner {
    /// The stores, the broker and the settings, shared with the awaiting watch.
    pub(super) copies: Copies,
    /// How far the order-create group got; without it confirmed sends are never sent again.
    progress: Option<Progress>,
}

impl Scanner {
    pub fn new(
        redis: RedisStore,
        pool: deadpool_postgres::Pool,
        publisher: Arc<dyn Publisher>,
        settings: Arc<Settings>,
    ) -> Self {
        Self {
            copies: Copies::new(redis, pool, publisher, settings),
            progress: None,
        }
    }

    /// Watches confirmed sends until the consumers took them, reading the group's progress
    /// from `progress` (docs/architecture/messages.md#a-dead-brokers-messages).
    pub fn with_progress(mut self, progress: Arc<dyn ProgressReader>) -> Self {
        self.progress = Some(Progress::new(progress));
        self
    }

    /// The order-create group's progress; `None` without a reader or a reading.
    async fn taken_until_ms(&self) -> Option<i64> {
        self.progress.as_ref()?.taken_until_ms().await
    }

    /// After a PostgreSQL failover (docs/architecture/recovery.md#after-a-postgresql-failover):
    /// every confirmed send still watched, whatever its age, is checked against the inbox the
    /// new primary holds, and those missing are sent again at once (or settled, past their
    /// validity and grace), instead of waiting for `scan.unconsumed_resend_ms` behind the
    /// group's progress. Commits the old primary acknowledged but never shipped are exactly
    /// such sends.
    pub async fn after_failover(&self) -> anyhow::Result<AwaitingStats> {
        let cutoff = chrono::Utc::now().timestamp_millis();
        let mut stats = AwaitingStats::default();
        for activity_id in self.copies.redis.activities().await? {
            for shard in self.copies.redis.shards(activity_id).await? {
                // Each round takes up to a batch below the cutoff and removes it or scores it
                // past the cutoff; a round that moves nothing (claims whose lease must run out
                // first) ends the shard's sweep: the regular passes finish it.
                loop {
                    let before = stats;
                    self.copies
                        .check_awaiting_before(shard, cutoff, &mut stats)
                        .await?;
                    if stats == before {
                        break;
                    }
                }
            }
        }
        Ok(stats)
    }

    /// One pass over every activity: claim what is due, re-send, record the outcome.
    pub async fn scan_once(&self) -> anyhow::Result<ScanStats> {
        let mut stats = ScanStats::default();
        let mut pending_total = 0i64;
        let mut oldest_ms: Option<i64> = None;
        let mut awaiting_total = 0u64;
        let watching = self.copies.settings.scan.unconsumed_resend_ms > 0;
        let taken_until = if watching {
            self.taken_until_ms().await
        } else {
            None
        };
        for activity_id in self.copies.redis.activities().await? {
            // A draw every waiting request left behind, before its winners are looked at.
            if let Err(e) = super::draws::draw_closed(
                &self.copies.redis,
                &self.copies.pool,
                &self.copies.settings,
                activity_id,
            )
            .await
            {
                warn!(activity_id, error = %e, "draw failed; tried again next pass");
            }
            let mut retire = true;
            for shard in self.copies.redis.shards(activity_id).await? {
                retire &= self.scan_shard(shard, &mut stats).await?;
                if !watching {
                    continue;
                }
                // Without a reading nothing is due (cutoff 0): the claim only counts.
                let awaiting = self
                    .copies
                    .check_awaiting(shard, taken_until.unwrap_or(0), &mut stats.awaiting)
                    .await?;
                awaiting_total += awaiting;
                retire &= awaiting == 0;
            }
            if retire {
                self.retire(activity_id).await?;
                stats.retired += 1;
                continue;
            }
            match super::rebalance::rebalance(&self.copies.redis, activity_id, &self.copies.owner)
                .await
            {
                Ok(m) => {
                    stats.moves += m.moves;
                    stats.moves_resumed += m.resumed;
                }
                // Whatever a failed pass left open, the next one finishes first.
                Err(e) => warn!(activity_id, error = %e, "leftover move failed; resumed next pass"),
            }
            let (count, oldest) = self
                .copies
                .redis
                .recovery()
                .pending_stats(activity_id)
                .await?;
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

    /// An activity that ended long ago with nothing pending: off the scanner's list, its keys
    /// given an expiry; no pass needs to look at it again.
    async fn retire(&self, activity_id: i64) -> anyhow::Result<()> {
        let keep_hours = self.copies.settings.retention.activity_keys_hours;
        let expiring = self
            .copies
            .redis
            .recovery()
            .retire_activity(activity_id, u64::from(keep_hours) * 3600)
            .await?;
        info!(
            activity_id,
            keys_expiring = expiring,
            keep_hours,
            "activity ended with nothing pending; off the scanner's list, its keys expire"
        );
        Ok(())
    }

    /// Claims what is due in one shard (an activity's stock bucket), re-sends it and records
    /// the outcomes; `true` when the shard has nothing pending and its activity ended long
    /// ago (it can retire).
    async fn scan_shard(&self, shard: Shard, stats: &mut ScanStats) -> anyhow::Result<bool> {
        let sc = &self.copies.settings.scan;
        let now_ms = Utc::now().timestamp_millis();
        let claimed = self
            .copies
            .redis
            .recovery()
            .claim_due(
                shard,
                now_ms,
                sc.scanner_batch,
                &self.copies.owner,
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
            self.copies.settings.api.resend_backoff_ms,
            self.copies.settings.scan.resend_backoff_cap_ms,
        );
        self.copies
            .redis
            .sends()
            .schedule_resend(activity_id, rid, message_id, now_ms + wait as i64, error)
            .await?;
        Ok(())
    }

    /// A copy refused after the reservation's validity: PostgreSQL settles it (`None`), or,
    /// when it cannot be asked, the re-send is tried again later.
    async fn settle_refused(
        &self,
        activity_id: i64,
        rid: &str,
        event: &OrderCreateRequested,
        now_ms: i64,
        error: &str,
    ) -> Option<anyhow::Result<()>> {
        let attempt = event.retry_count + 1;
        match self.copies.settle(activity_id, rid, event, now_ms).await {
            Ok(verdict) => {
                warn!(reservation_id = %rid, message_id = %event.message_id, order_id = %event.order_id,
                      request_id = %event.request_id, send_attempt = attempt,
                      send_outcome = "DEFINITE_FAILURE", error = %error, verdict,
                      "re-send refused after the reservation expired; settled from PostgreSQL");
                None
            }
            Err(e) => {
                warn!(reservation_id = %rid, message_id = %event.message_id, error = %e,
                      "could not settle a refused reservation from PostgreSQL; retried later");
                let id = &event.message_id;
                Some(
                    self.resend_later(activity_id, rid, id, attempt, now_ms, error)
                        .await,
                )
            }
        }
    }

    async fn resend(
        &self,
        activity_id: i64,
        fields: std::collections::HashMap<String, String>,
    ) -> (&'static str, String) {
        let rid = fields.get("reservation_id").cloned().unwrap_or_default();
        let Some(event) =
            event_from_reservation(&fields, self.copies.settings.mq.order_event_schema)
        else {
            error!(reservation_id = %rid, activity_id, "reservation hash is incomplete; cannot re-send");
            return ("invalid", rid);
        };
        let attempt = event.retry_count + 1;
        let outcome = self.copies.send_copy(&event).await;
        metrics::counter!("reservation_resend_total", "outcome" => outcome.label()).increment(1);
        let now_ms = Utc::now().timestamp_millis();
        let label = outcome.label();
        let result = match &outcome {
            SendOutcome::Confirmed { broker_msg_id } => self
                .copies
                .redis
                .sends()
                .mark_sent(activity_id, &rid, &event.message_id, broker_msg_id, now_ms)
                .await
                .map(|_| ())
                .map_err(anyhow::Error::from),
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
                        + self.copies.settings.scan.settle_grace_ms as i64 =>
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
                match self
                    .settle_refused(activity_id, &rid, &event, now_ms, error)
                    .await
                {
                    Some(result) => result,
                    None => return ("settled", rid),
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
