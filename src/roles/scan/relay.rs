//! The outbox relay (docs/architecture/recovery.md#recovery-paths): claims PENDING outbox rows
//! without blocking other relays, sends them (delayed ones with their deliver time), marks them
//! SENT with the broker id, backs off on failure and marks a row DEAD after
//! `scan.relay_max_attempts` (ERROR log, `outbox_dead_total`). It wakes on the writers' NOTIFY
//! (`listen`) and polls as a fallback.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use futures::{StreamExt, TryStreamExt};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::config::Settings;
use crate::mq::{OutMessage, Publisher, SendOutcome};
use crate::pg::outbox::outbox_message;
use crate::pg::outbox::{self, backoff_ms, OutboxRow};

use super::unconsumed::{Progress, ProgressReader};

/// The outbox relay.
pub struct Relay {
    pool: deadpool_postgres::Pool,
    publisher: Arc<dyn Publisher>,
    pub(super) settings: Arc<Settings>,
    /// Whether DEAD rows may exist (the last count saw some, or a row went DEAD since): the
    /// requeue after a confirmed send runs only then, not on every pass.
    dead_seen: AtomicBool,
    /// The compensation group's progress: releases it never took are sent again
    /// (docs/architecture/messages.md#a-dead-brokers-messages); `None`: never.
    release_progress: Option<Progress>,
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
            dead_seen: AtomicBool::new(true),
            release_progress: None,
        }
    }

    /// Sends again the releases the compensation group has not taken
    /// `scan.unconsumed_resend_ms` after its progress on the brokers that answer.
    pub fn with_release_progress(mut self, progress: Arc<dyn ProgressReader>) -> Self {
        self.release_progress = Some(Progress::new(progress));
        self
    }

    /// One look for confirmed releases nobody consumed in time; puts them back for the next
    /// pass. Returns how many.
    pub async fn requeue_unconsumed(&self) -> anyhow::Result<usize> {
        let Some(progress) = &self.release_progress else {
            return Ok(0);
        };
        let Some(until) = progress.taken_until_ms().await else {
            return Ok(0);
        };
        let sc = &self.settings.scan;
        let cutoff = super::unconsumed::cutoff_ms(
            Utc::now().timestamp_millis(),
            sc.unconsumed_resend_ms,
            until,
        );
        let Some(cutoff) = chrono::DateTime::from_timestamp_millis(cutoff) else {
            return Ok(0);
        };
        let client = self.pool.get().await?;
        let ids =
            outbox::requeue_unconsumed_releases(&**client, cutoff, sc.relay_batch as i64).await?;
        if !ids.is_empty() {
            metrics::counter!("outbox_unconsumed_requeue_total", "tag" => "RELEASE_RESERVATION")
                .increment(ids.len() as u64);
            warn!(count = ids.len(), first_event_id = %ids[0],
                  "releases confirmed but not consumed in time (their broker may be down); sent again");
        }
        Ok(ids.len())
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
        // Fault-injection point: the relay dies after the send, before marking SENT.
        fail::fail_point!("relay-after-send-before-mark", |_| std::process::abort());
        let mut sent: Vec<outbox::Sent> = Vec::new();
        let mut failed: Vec<outbox::Failure> = Vec::new();
        for (row, outcome) in outcomes {
            metrics::counter!("outbox_publish_total", "tag" => tag_label(&row.tag), "outcome" => outcome.label())
                .increment(1);
            let refused = matches!(outcome, SendOutcome::DefiniteFailure { .. });
            match outcome {
                SendOutcome::Confirmed { broker_msg_id } => sent.push(outbox::Sent {
                    activity_id: row.activity_id,
                    event_id: row.event_id,
                    broker_msg_id,
                }),
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
                        activity_id: row.activity_id,
                        event_id: row.event_id,
                        error,
                        backoff_ms: wait as i64,
                        dead,
                        refused,
                    });
                }
            }
        }
        if failed.iter().any(|f| f.dead) {
            self.dead_seen.store(true, Ordering::Relaxed);
        }
        // Both outcomes in one round trip (pipelined on the one connection).
        let (marked, failures) = futures::join!(
            outbox::mark_sent(&**client, &sent),
            outbox::mark_failed(&**client, &failed)
        );
        marked?;
        failures?;
        if !sent.is_empty() && self.dead_seen.load(Ordering::Relaxed) {
            // The broker answers again: rows that died while it did not come back by themselves.
            self.requeue_after_recovery(&client).await;
        }
        Ok(claimed)
    }

    /// Brings back rows that went DEAD because the broker did not answer, now that it does.
    /// A failure here is logged and retried on the next confirmed send, never fatal.
    async fn requeue_after_recovery(&self, client: &tokio_postgres::Client) {
        match outbox::requeue_broker_dead(client, self.settings.scan.relay_batch as i64).await {
            Ok(0) => {}
            Ok(n) => {
                metrics::counter!("outbox_auto_requeue_total").increment(n);
                info!(
                    rows = n,
                    "broker answers again: DEAD outbox rows back to PENDING"
                );
            }
            Err(e) => warn!(error = %e, "requeue of DEAD outbox rows failed; next pass retries"),
        }
    }

    /// With nothing else to send, one DEAD row (dead for want of a broker) goes back to PENDING
    /// as a probe: once it is confirmed the others follow. Returns whether one did.
    pub async fn probe_dead(&self) -> anyhow::Result<bool> {
        let client = self.pool.get().await?;
        let n = outbox::requeue_broker_dead(&**client, 1).await?;
        if n > 0 {
            metrics::counter!("outbox_auto_requeue_total").increment(n);
        }
        Ok(n > 0)
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

    /// Updates the backlog gauges (and the refunds owed).
    pub async fn observe(&self) -> anyhow::Result<()> {
        let mut client = self.pool.get().await?;
        let lead = self.settings.scan.timer_lead_secs as f64;
        let tx = client.transaction().await?;
        outbox::on_partial_indexes(&tx).await?;
        // Both readings in one round trip (tokio-postgres pipelines concurrent queries on one
        // connection); the refunds owed ride along
        // (docs/architecture/recovery.md#refund-obligations).
        let (b, r) = tokio::try_join!(
            outbox::backlog(&*tx, lead),
            crate::pg::refunds::backlog(&*tx)
        )?;
        tx.commit().await?;
        metrics::gauge!("outbox_pending").set(b.due as f64);
        metrics::gauge!("outbox_pending_oldest_age_seconds").set(b.oldest_due_age_secs);
        metrics::gauge!("outbox_not_yet_due").set(b.not_yet_due as f64);
        metrics::gauge!("outbox_dead").set(b.dead as f64);
        metrics::gauge!("outbox_in_transaction").set(b.in_transaction as f64);
        if b.dead == 0 {
            self.dead_seen.store(false, Ordering::Relaxed);
        }
        metrics::gauge!("refund_obligations_pending").set(r.pending as f64);
        metrics::gauge!("refund_obligations_pending_cents").set(r.pending_cents as f64);
        metrics::gauge!("refund_obligations_oldest_age_seconds").set(r.oldest_age_secs);
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
pub(super) async fn listen(
    settings: Arc<Settings>,
    wake: Arc<Notify>,
    shutdown: CancellationToken,
) {
    // One connection at a time, however often it is replaced (`pools::SCAN_RELAY_LISTEN`).
    metrics::gauge!("pg_pool_capacity")
        .increment(crate::config::budget::pools::SCAN_RELAY_LISTEN as f64);
    while !shutdown.is_cancelled() {
        match crate::pg::connect_one(&settings.pg).await {
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
                if outbox::listen(&client).await.is_ok() {
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
