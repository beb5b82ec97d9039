//! Confirmed sends the consumers never took
//! (docs/architecture/messages.md#a-dead-brokers-messages).
//!
//! A broker that confirmed a message and then died holds it until it comes back: nobody can
//! read a dead master's queues. Every confirmed ORDER_CREATE_REQUESTED therefore stays in its
//! shard's awaiting index (scored by when its last copy went out) until the scanner has seen
//! the order-create group's inbox take it. A reservation still missing from the inbox
//! `scan.unconsumed_resend_ms` after the time up to which the group has taken everything on the
//! brokers that answer (a message still waiting in line there is not missing) is sent again with
//! the same message_id, so it reaches a live broker; the inbox makes whichever copy comes second a
//! duplicate. Past its validity and grace it is settled from PostgreSQL instead
//! (`pg::order_tx::withdraw`), which fences any copy still held by the dead broker.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use futures::StreamExt;
use tracing::{error, info, warn};

use crate::mq::LagProbe;
use crate::redis::reservation::ReservationHash;
use crate::redis::Shard;

use super::copies::{event_from_reservation, Copies};

/// Where the scanner reads how far the order-create group got.
#[async_trait::async_trait]
pub trait ProgressReader: Send + Sync {
    /// The time (epoch ms) before which the group has taken every order-create message
    /// stored on the brokers that answer; `None` when no broker answers.
    async fn taken_until_ms(&self) -> Option<i64>;
}

/// The order-create group's progress as the brokers report it.
pub struct BrokerProgress {
    pub probe: Arc<LagProbe>,
    pub group: String,
    pub topic: String,
}

#[async_trait::async_trait]
impl ProgressReader for BrokerProgress {
    async fn taken_until_ms(&self) -> Option<i64> {
        match self.probe.taken_until_ms(&self.group, &self.topic).await {
            Ok(ms) => Some(ms),
            Err(e) => {
                tracing::debug!(error = %e, "order-create progress unreadable on every broker");
                None
            }
        }
    }
}

/// How long a progress reading is reused within passes.
const PROGRESS_READ_EVERY: Duration = Duration::from_secs(1);

/// A group's progress, read at most once a second.
pub struct Progress {
    reader: Arc<dyn ProgressReader>,
    last: std::sync::Mutex<Option<(Instant, Option<i64>)>>,
}

impl Progress {
    pub fn new(reader: Arc<dyn ProgressReader>) -> Self {
        Self {
            reader,
            last: Default::default(),
        }
    }

    /// The last reading if younger than a second, a new one otherwise; `None` when
    /// unreadable (nothing is sent again blind).
    pub async fn taken_until_ms(&self) -> Option<i64> {
        let cached = *self.last.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((at, until)) = cached {
            if at.elapsed() < PROGRESS_READ_EVERY {
                return until;
            }
        }
        let until = self.reader.taken_until_ms().await;
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some((Instant::now(), until));
        until
    }
}

/// What one check of the awaiting index did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct AwaitingStats {
    /// Seen taken by the consumers (or released): no longer watched.
    pub consumed: usize,
    /// Not taken in time: sent again.
    pub resent: usize,
    /// Not taken before the reservation's validity and grace: settled from PostgreSQL.
    pub settled: usize,
    /// Of those settled, the ones PostgreSQL had no order for: a buyer answered 202 who gets
    /// none (alerted: docs/architecture/recovery.md#after-a-postgresql-failover).
    pub lost: usize,
}

impl AwaitingStats {
    /// Adds one pass to the running total and counts it.
    fn add(&mut self, pass: &AwaitingStats) {
        for (verdict, n) in [
            ("consumed", pass.consumed),
            ("resent", pass.resent),
            ("settled", pass.settled),
        ] {
            metrics::counter!("reservation_awaiting_checked_total", "verdict" => verdict)
                .increment(n as u64);
        }
        metrics::counter!("reservation_lost_past_horizon_total").increment(pass.lost as u64);
        self.consumed += pass.consumed;
        self.resent += pass.resent;
        self.settled += pass.settled;
        self.lost += pass.lost;
    }
}

/// Why a watched reservation needs no more watching, or what to do about it (pure).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Consumed,
    Resend,
    Settle,
}

/// The decision for one watched reservation (pure): consumed when the inbox has it; sent
/// again while it is valid (plus the settle grace); settled from PostgreSQL after.
pub fn verdict(in_inbox: bool, now_ms: i64, valid_until_ms: i64, settle_grace_ms: u64) -> Verdict {
    if in_inbox {
        Verdict::Consumed
    } else if now_ms < valid_until_ms + settle_grace_ms as i64 {
        Verdict::Resend
    } else {
        Verdict::Settle
    }
}

/// The awaiting index's cutoff (pure): a copy sent before it would have been taken by now on
/// any broker that answers, `resend_after_ms` before the time the group has taken everything
/// up to there.
pub fn cutoff_ms(now_ms: i64, resend_after_ms: u64, taken_until_ms: i64) -> i64 {
    now_ms.min(taken_until_ms) - resend_after_ms as i64
}

impl Copies {
    /// Checks one shard's confirmed sends that should have been taken by now; returns how many
    /// the index still watches.
    pub(super) async fn check_awaiting(
        &self,
        shard: Shard,
        taken_until_ms: i64,
        stats: &mut AwaitingStats,
    ) -> anyhow::Result<u64> {
        let sc = &self.settings.scan;
        let now_ms = Utc::now().timestamp_millis();
        let cutoff = cutoff_ms(now_ms, sc.unconsumed_resend_ms, taken_until_ms);
        self.check_awaiting_before(shard, cutoff, stats).await
    }

    /// Checks one shard's confirmed sends whose last copy went out before `cutoff` (epoch ms),
    /// up to `scan.scanner_batch` of them; returns how many the index still watches.
    pub(super) async fn check_awaiting_before(
        &self,
        shard: Shard,
        cutoff: i64,
        stats: &mut AwaitingStats,
    ) -> anyhow::Result<u64> {
        let sc = &self.settings.scan;
        let now_ms = Utc::now().timestamp_millis();
        let (remaining, claims) = self
            .redis
            .recovery()
            .claim_awaiting(shard, cutoff, sc.scanner_batch, sc.scanner_lease_ms)
            .await?;
        if claims.is_empty() {
            return Ok(remaining);
        }
        let parsed: Vec<_> = claims
            .iter()
            .filter_map(|f| Some((ReservationHash::parse(f)?, f)))
            .collect();
        let ids: Vec<String> = parsed.iter().map(|(r, _)| r.message_id.clone()).collect();
        let client = self.pool.get().await?;
        let taken = crate::pg::queries::in_inbox(
            &**client,
            shard.activity_id,
            &self.names.order_create_group,
            &ids,
        )
        .await?;
        drop(client);
        let mut done = Vec::new();
        let mut to_resend = Vec::new();
        let mut pass = AwaitingStats::default();
        for (r, fields) in parsed {
            let v = verdict(
                taken.contains(&r.message_id),
                now_ms,
                r.valid_until.timestamp_millis(),
                sc.settle_grace_ms,
            );
            match v {
                Verdict::Consumed => {
                    pass.consumed += 1;
                    done.push(r.reservation_id);
                }
                Verdict::Resend => {
                    let event = event_from_reservation(fields, self.settings.mq.order_event_schema);
                    to_resend.push((r, event));
                }
                Verdict::Settle => {
                    if let Some(lost) = self.settle_expired(shard, &r, fields, now_ms).await {
                        pass.settled += 1;
                        pass.lost += usize::from(lost);
                        done.push(r.reservation_id);
                    }
                }
            }
        }
        // The copies go out like the scanner's re-sends, send_concurrency at a time.
        let resent: Vec<String> = futures::stream::iter(to_resend)
            .map(|(r, event)| self.resend_unconsumed(r, event))
            .buffer_unordered(sc.send_concurrency)
            .collect()
            .await;
        pass.resent = resent.len();
        stats.add(&pass);
        // Re-sent ones stay watched, scored by their new copy; the rest leave the index.
        self.redis
            .recovery()
            .end_watch(shard, &done, &resent, Utc::now().timestamp_millis())
            .await?;
        Ok(remaining)
    }

    /// Settles a confirmed send that no consumer took before its reservation expired, from
    /// PostgreSQL: `Some(true)` when PostgreSQL had no order for it (the buyer, told 202, gets
    /// none: reported by name and counted in `reservation_lost_past_horizon_total`, never
    /// settled silently), `Some(false)` when it had one; `None` when it could not be settled
    /// (the lease runs out and a later pass tries again).
    async fn settle_expired(
        &self,
        shard: Shard,
        r: &ReservationHash,
        fields: &HashMap<String, String>,
        now_ms: i64,
    ) -> Option<bool> {
        let event = event_from_reservation(fields, self.settings.mq.order_event_schema)?;
        match self
            .settle(shard.activity_id, &r.reservation_id, &event, now_ms)
            .await
        {
            Ok("fenced") => {
                error!(activity_id = shard.activity_id, sku_id = event.sku_id,
                       user_id = event.user_id, reservation_id = %r.reservation_id,
                       order_id = %r.order_id, request_id = %r.request_id,
                       valid_until = %r.valid_until,
                       "a reservation answered 202 never became an order before its validity and grace \
                        (its message or its commit was lost: a dead broker, a PostgreSQL failover); \
                        withdrawn, the buyer gets no order");
                Some(true)
            }
            Ok(outcome) => {
                warn!(reservation_id = %r.reservation_id, message_id = %r.message_id,
                      order_id = %r.order_id, request_id = %r.request_id, verdict = outcome,
                      "a confirmed send never reached the consumers before the reservation expired; settled from PostgreSQL");
                Some(false)
            }
            Err(e) => {
                warn!(reservation_id = %r.reservation_id, error = %e,
                      "could not settle an unconsumed reservation; retried later");
                None
            }
        }
    }

    /// Sends a confirmed but unconsumed reservation again, same message_id; it stays watched
    /// whatever the outcome (an unconfirmed copy may be stored as well). Returns its id.
    async fn resend_unconsumed(
        &self,
        r: ReservationHash,
        event: Option<crate::domain::OrderCreateRequested>,
    ) -> String {
        let label = match event {
            Some(event) => self.send_copy(&event).await.label(),
            None => "invalid",
        };
        metrics::counter!("reservation_unconsumed_resend_total", "outcome" => label).increment(1);
        info!(reservation_id = %r.reservation_id, message_id = %r.message_id, order_id = %r.order_id,
              request_id = %r.request_id, send_outcome = label,
              "confirmed send not taken by the consumers in time (its broker may be down); sent again");
        r.reservation_id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reservation_in_the_inbox_is_consumed_whatever_its_age() {
        assert_eq!(verdict(true, 10_000, 5_000, 1_000), Verdict::Consumed);
        assert_eq!(verdict(true, 1_000, 5_000, 1_000), Verdict::Consumed);
    }

    #[test]
    fn a_missing_one_is_sent_again_while_valid_and_settled_after_the_grace() {
        assert_eq!(verdict(false, 4_999, 5_000, 1_000), Verdict::Resend);
        assert_eq!(verdict(false, 5_999, 5_000, 1_000), Verdict::Resend);
        assert_eq!(verdict(false, 6_000, 5_000, 1_000), Verdict::Settle);
    }

    #[test]
    fn the_cutoff_counts_the_backlog_on_the_brokers_that_answer() {
        // Caught up (the reading is about now): watched copies 10 s old are due.
        assert_eq!(cutoff_ms(100_000, 10_000, 100_050), 90_000);
        // Everything taken only up to 25 s ago: a copy sent 30 s ago may still be in line.
        assert_eq!(cutoff_ms(100_000, 10_000, 75_000), 65_000);
        // Nothing taken yet on some queue: nothing is due.
        assert!(cutoff_ms(100_000, 10_000, 0) < 0);
    }
}
