//! `seckill timeout-cancel`: consumes the delay topic
//! (docs/architecture/recovery.md#timeout-cancel-and-payment). A CANCEL_ORDER_IF_UNPAID message
//! only says "now you may check": the conditional update in PostgreSQL decides. A paid order
//! is a counted no-op; a message that arrives before `expires_at` is retried later, never
//! dropped; only a cancel that happened returns the unit (PostgreSQL final stock, ledger, and
//! the Redis release through compensation).
//!
//! Each delivered batch becomes one transaction (`pg::cancel_tx`), with the order consumer's
//! discipline (`services::batch_tx`): at most `config::budget::cancel_budget` at once, bounded in time,
//! retried in-process while transient, split into one per message on failure. With
//! `events.order_canceled = "transaction"`, a batch's ORDER_CANCELED events are transaction
//! messages (docs/architecture/messages.md#delivering-events): drafted, stored as half messages
//! together, written by the batch's transaction, and ended with its outcome.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use tracing::{debug, info, warn};

use crate::config::EventDelivery;
use crate::config::Settings;
use crate::domain::events::{sweep_cancel_event_id, CancelOrderIfUnpaid};
use crate::domain::CancelOutcome;
use crate::mq::{BatchHandler, ConsumeDecision, Delivery};
use crate::mq::{HalfMessage, LocalOutcome, TransactionPublisher};
use crate::pg::cancel_tx::{
    cancel_batch, cancel_batch_with, draft_canceled, CancelDrafts, CancelNames, CancelRequest,
};
use crate::pg::errors::TxError;
use crate::pg::order_state::StateNames;
use crate::roles::runtime::RoleRuntime;
use crate::services::batch_tx::TxSlots;
use crate::services::half_messages::half_message;

pub struct TimeoutCancelHandler {
    slots: TxSlots,
    names: CancelNames,
    /// ORDER_CANCELED as transaction messages, and the local transaction's bound.
    transactions: Option<(Arc<dyn TransactionPublisher>, chrono::Duration)>,
}

/// What one sweep did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sweep {
    /// Unpaid orders past deadline + grace it found.
    pub found: usize,
    /// How many of them it cancelled (the rest were paid or cancelled meanwhile).
    pub canceled: usize,
    /// It found as many as it may take at once: more may be due.
    pub full: bool,
}

/// A delivered message, decoded: a cancel to try, or why not.
enum Parsed {
    Cancel(CancelOrderIfUnpaid),
    /// Not a cancel message: quarantined with its raw body.
    Poison(String),
}

impl TimeoutCancelHandler {
    /// `budget` transactions at once, on `pool` (`budget + 1` connections).
    pub fn new(pool: deadpool_postgres::Pool, settings: &Settings, budget: usize) -> Self {
        let n = settings.names();
        Self {
            slots: TxSlots::new(pool, settings, budget, "cancel"),
            names: CancelNames {
                consumer_group: n.timeout_group.clone(),
                source_topic: n.order_timeout_topic.clone(),
                state: StateNames {
                    order_event_topic: n.order_event_topic.clone(),
                    compensate_topic: n.compensate_topic.clone(),
                },
            },
            transactions: None,
        }
    }

    /// Sends ORDER_CANCELED through `tx` as transaction messages, each batch's local
    /// transaction bounded by `local_timeout_ms`.
    pub fn with_transactions(
        mut self,
        tx: Arc<dyn TransactionPublisher>,
        local_timeout_ms: u64,
    ) -> Self {
        self.transactions = Some((tx, chrono::Duration::milliseconds(local_timeout_ms as i64)));
        self
    }

    /// One batch's transaction, its ORDER_CANCELED events as transaction messages when so
    /// configured: the events of the orders it would cancel are drafted and stored as half
    /// messages together; the batch writes the drafted ones that still hold; each half is
    /// ended with what became of its event. An order whose half was not stored gets its event
    /// through the outbox.
    async fn cancel(
        &self,
        client: &mut deadpool_postgres::Client,
        part: &[CancelRequest],
    ) -> Result<Vec<CancelOutcome>, TxError> {
        let Some((tx, local_timeout)) = &self.transactions else {
            return cancel_batch(client, &self.names, part).await;
        };
        let mut order_ids: Vec<&str> = part.iter().map(|r| r.order_id.as_str()).collect();
        order_ids.sort_unstable();
        order_ids.dedup();
        let drafted = draft_canceled(client, &order_ids).await?;
        if drafted.is_empty() {
            return cancel_batch(client, &self.names, part).await;
        }
        let deadline = Utc::now() + *local_timeout;
        let msgs = drafted
            .iter()
            .map(|d| half_message(&d.row(&self.names.state), deadline))
            .collect();
        let mut halves: Vec<(EventKey, Box<dyn HalfMessage>)> = Vec::new();
        let mut drafts = CancelDrafts {
            by_order: Default::default(),
            deadline,
        };
        for (d, begun) in drafted.into_iter().zip(tx.begin_many(msgs).await) {
            match begun {
                Ok(half) => {
                    let key = (
                        d.event.base.order.activity_id,
                        d.event.base.event_id.clone(),
                    );
                    halves.push((key, half));
                    drafts
                        .by_order
                        .insert(d.event.base.order.order_id.clone(), d);
                }
                Err(outcome) => {
                    warn!(order_id = %d.event.base.order.order_id, outcome = outcome.label(),
                        error = ?outcome, "half message not stored; ORDER_CANCELED goes through the outbox");
                    delivered("half_failed", 1);
                }
            }
        }
        let result = cancel_batch_with(client, &self.names, part, Some(&drafts)).await;
        let written: std::collections::HashSet<String> = match &result {
            Ok((_, written)) => written.iter().cloned().collect(),
            Err(_) => Default::default(),
        };
        if result.is_ok() {
            fail::fail_point!(
                "tx-cancel-after-commit-before-end",
                |_| std::process::abort()
            );
        }
        let outcome_of = |event_id: &str| match &result {
            Ok(_) if written.contains(event_id) => LocalOutcome::Commit,
            Ok(_) => LocalOutcome::Rollback,
            // The commit may or may not have happened: the check-back reads which.
            Err(_) => LocalOutcome::Unknown,
        };
        let ended: Vec<_> = halves
            .into_iter()
            .map(|(key, half)| {
                let outcome = outcome_of(&key.1);
                (key, half, outcome)
            })
            .collect();
        end_halves(client, ended).await;
        result.map(|(outcomes, _)| outcomes)
    }

    /// What each message of a batch came to: `Ok(None)` = poison (quarantined); `Err` = the
    /// transaction that held it failed (retry later). Early messages never open a transaction.
    pub async fn process(&self, batch: &[Delivery]) -> Vec<Result<Option<CancelOutcome>, TxError>> {
        let parsed: Vec<Parsed> = batch
            .iter()
            .map(
                |d| match serde_json::from_slice::<CancelOrderIfUnpaid>(&d.body) {
                    Ok(m) => Parsed::Cancel(m),
                    Err(e) => Parsed::Poison(e.to_string()),
                },
            )
            .collect();
        let mut out: Vec<Result<Option<CancelOutcome>, TxError>> =
            (0..batch.len()).map(|_| Ok(None)).collect();
        let now = Utc::now();
        let mut due: Vec<(usize, CancelRequest)> = Vec::new();
        for (i, p) in parsed.iter().enumerate() {
            match p {
                Parsed::Poison(why) => out[i] = self.quarantine(&batch[i], why).await,
                // Early delivery (by this process's clock): no transaction at all.
                Parsed::Cancel(m) if m.expires_at > now => {
                    out[i] = Ok(Some(CancelOutcome::NotYetExpired {
                        expires_at: m.expires_at,
                    }))
                }
                Parsed::Cancel(m) => due.push((
                    i,
                    CancelRequest {
                        message_id: m.event_id.clone(),
                        order_id: m.order_id.clone(),
                    },
                )),
            }
        }
        if due.is_empty() {
            return out;
        }
        let requests: Vec<CancelRequest> = due.iter().map(|(_, r)| r.clone()).collect();
        let decided = self
            .slots
            .split_on_failure(requests.len(), |range| {
                let part = &requests[range];
                self.slots
                    .run(async move |client| self.cancel(client, part).await)
            })
            .await;
        for ((i, _), outcome) in due.iter().zip(decided) {
            out[*i] = outcome.map(Some);
        }
        out
    }

    /// One sweep: the orders still unpaid `grace` after their deadline, oldest first, up to
    /// `batch_size × budget`, cancelled through the same transaction as the timer's messages
    /// (in batches of `batch_size`, under the same slots), each claimed in the inbox under its
    /// sweep id. Returns how many it found and how many it cancelled; the timers of the ones it
    /// cancelled later find them cancelled.
    pub async fn sweep_once(&self, grace: Duration, batch_size: usize) -> Result<Sweep, TxError> {
        let limit = (batch_size.max(1) * self.slots.limiter().limit().max(1)) as i64;
        let due: Vec<String> = {
            let client = self.slots.pool().get().await?;
            crate::pg::cancel_tx::overdue_orders(&**client, grace, limit).await?
        };
        let requests: Vec<CancelRequest> = due
            .iter()
            .map(|order_id| CancelRequest {
                message_id: sweep_cancel_event_id(order_id),
                order_id: order_id.clone(),
            })
            .collect();
        let chunks = requests.chunks(batch_size.max(1)).map(|chunk| {
            self.slots.split_on_failure(chunk.len(), move |range| {
                let part = &chunk[range];
                self.slots
                    .run(async move |client| self.cancel(client, part).await)
            })
        });
        let mut canceled = 0;
        for outcomes in futures::future::join_all(chunks).await {
            for outcome in outcomes {
                let label = match &outcome {
                    Ok(o) => o.label(),
                    Err(e) => e.class(),
                };
                metrics::counter!("order_cancel_sweep_total", "result" => label).increment(1);
                if matches!(outcome, Ok(CancelOutcome::Canceled { .. })) {
                    canceled += 1;
                }
            }
        }
        Ok(Sweep {
            found: due.len(),
            canceled,
            full: due.len() as i64 >= limit,
        })
    }

    async fn quarantine(&self, d: &Delivery, why: &str) -> Result<Option<CancelOutcome>, TxError> {
        let client = self.slots.pool().get().await?;
        crate::services::poison::quarantine(&**client, &self.names.consumer_group, d, why).await?;
        Ok(None)
    }
}

#[async_trait::async_trait]
impl BatchHandler for TimeoutCancelHandler {
    async fn handle(&self, batch: Vec<Delivery>) -> ConsumeDecision {
        let started = Instant::now();
        metrics::histogram!("mq_consume_batch_size", "topic" => "order_timeout")
            .record(batch.len() as f64);
        let outcomes = self.process(&batch).await;
        metrics::histogram!("mq_consume_process_seconds", "topic" => "order_timeout")
            .record(started.elapsed().as_secs_f64());
        // A retried batch re-runs its processed messages too: the inbox makes them no-ops.
        let mut decision = ConsumeDecision::Ack;
        for (d, outcome) in batch.iter().zip(&outcomes) {
            let message_id = d.properties.get("message_id").unwrap_or("");
            let order_id = d.keys.split(' ').next().unwrap_or("");
            match outcome {
                Ok(Some(o)) => {
                    metrics::counter!("order_cancel_total", "result" => o.label()).increment(1);
                    if let CancelOutcome::NotYetExpired { expires_at } = o {
                        info!(order_id, message_id, expires_at = %expires_at,
                              "cancel message arrived early; redelivered later");
                        decision = ConsumeDecision::Retry;
                    } else {
                        debug!(
                            order_id,
                            message_id,
                            decision = o.label(),
                            delivery_attempt = d.reconsume_times,
                            "cancel-if-unpaid processed"
                        );
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    metrics::counter!("order_cancel_total", "result" => e.class()).increment(1);
                    warn!(order_id, message_id, broker_msg_id = %d.broker_msg_id,
                          error_class = e.class(), error = %e,
                          "cancel failed; will be redelivered");
                    decision = ConsumeDecision::Retry;
                }
            }
        }
        decision
    }
}

/// Sweeps at most this many times in a row per interval, however much is due.
const SWEEPS_PER_INTERVAL: usize = 50;

/// `seckill timeout-cancel`.
/// `event_delivery_total{family="order_canceled", mode="transaction", outcome}`.
fn delivered(outcome: &'static str, n: u64) {
    metrics::counter!("event_delivery_total", "family" => "order_canceled",
        "mode" => "transaction", "outcome" => outcome)
    .increment(n);
}

/// The group's backlog (due timers not consumed yet, retries included), every 5 s until
/// `stop`.
fn export_backlog(
    probe: crate::mq::LagProbe,
    names: &crate::mq::Names,
    stop: tokio_util::sync::CancellationToken,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    let (group, topic) = (
        names.timeout_group.clone(),
        names.order_timeout_topic.clone(),
    );
    async move {
        loop {
            crate::mq::lag::export_backlog(&probe, &group, &topic).await;
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(Duration::from_secs(5)) => {}
            }
        }
    }
}

/// One interval's sweep: a full sweep means more may be due, so it looks again at once
/// (bounded per interval).
async fn sweep_round(sweeper: &TimeoutCancelHandler, grace: Duration, batch: usize) {
    for _ in 0..SWEEPS_PER_INTERVAL {
        match sweeper.sweep_once(grace, batch).await {
            Ok(sweep) => {
                if sweep.canceled > 0 {
                    info!(
                        found = sweep.found,
                        canceled = sweep.canceled,
                        "sweep cancelled orders whose timer was late"
                    );
                }
                if !sweep.full {
                    break;
                }
            }
            Err(e) => {
                warn!(error = %e, "sweep failed; next interval");
                break;
            }
        }
    }
}

pub async fn run(settings: Settings) -> anyhow::Result<()> {
    let names = settings.names();
    let budget = crate::config::budget::cancel_budget(&settings.pg);
    let pool = crate::pg::connect_pool(&settings.pg, budget + 1).await?;
    let mut handler = TimeoutCancelHandler::new(pool.clone(), &settings, budget);
    let watch_pool = pool.clone();
    if settings.events.order_canceled() == EventDelivery::Transaction {
        // Every batch in flight may hold a half per message (a batch takes its halves'
        // slots together, so batches never wait on each other).
        let in_flight = budget.max(1) * settings.consumer.batch_size.max(1);
        let tx = crate::services::half_messages::start(&settings, pool, in_flight).await?;
        handler = handler.with_transactions(tx, settings.events.transaction_local_timeout_ms);
    }
    let handler = Arc::new(handler);
    let sweeper = handler.clone();
    let role = RoleRuntime::start(
        "timeout-cancel",
        "timeout.metrics_listen",
        settings.timeout.metrics_listen,
    )
    .await?;
    role.watch_primary(&watch_pool, &settings.pg);
    // `budget` batches handed over at once, each up to `consumer.batch_size` messages.
    let consumer = crate::mq::start_consumer(
        &settings,
        &names.timeout_group,
        &names.order_timeout_topic,
        handler,
        budget,
        settings.consumer.batch_size,
    )
    .await?;
    // The group's backlog (due timers not consumed yet, retries included), every 5 s.
    let probe =
        crate::mq::LagProbe::new(&crate::mq::runtime()?, &settings.mq.name_server_list()).await?;
    let backlog = role.watchdog.spawn(
        "timeout_backlog",
        export_backlog(probe, names, role.shutdown.clone()),
    );
    role.serving();
    info!(group = %names.timeout_group, topic = %names.order_timeout_topic, budget,
          batch_size = settings.consumer.batch_size,
          sweep_grace_ms = settings.timeout.sweep_grace_ms, "timeout-cancel started");
    // The sweep, until SIGTERM or a dead loop; a sweep in progress finishes its transactions
    // first.
    let grace = Duration::from_millis(settings.timeout.sweep_grace_ms);
    let every = Duration::from_millis(settings.timeout.sweep_interval_ms);
    let died = {
        let signal = role.stop_requested();
        tokio::pin!(signal);
        loop {
            tokio::select! {
                died = &mut signal => break died,
                _ = tokio::time::sleep(every) => {}
            }
            sweep_round(&sweeper, grace, settings.consumer.batch_size).await;
        }
    };
    let grace = Duration::from_secs(settings.consumer.shutdown_grace_secs);
    let _ = tokio::time::timeout(grace, consumer.shutdown()).await;
    role.shutdown.cancel();
    let _ = backlog.await;
    role.finish(died).await
}

/// An outbox row's key: `(activity_id, event_id)`.
type EventKey = (i64, String);

/// Ends each half with what became of its event, `((activity_id, event_id), half, outcome)`,
/// then marks the committed ones SENT in one statement. Left TRANSACTION if the mark fails:
/// the check-back still answers COMMIT.
async fn end_halves(
    client: &deadpool_postgres::Client,
    halves: Vec<(EventKey, Box<dyn HalfMessage>, LocalOutcome)>,
) {
    let ends = halves
        .into_iter()
        .map(|((activity_id, event_id), half, outcome)| async move {
            (activity_id, event_id, outcome, half.end(outcome).await)
        });
    let mut sent = Vec::new();
    for (activity_id, event_id, outcome, broker_msg_id) in futures::future::join_all(ends).await {
        delivered(outcome.label(), 1);
        if outcome == LocalOutcome::Commit {
            sent.push(crate::pg::outbox::Sent {
                activity_id,
                event_id,
                broker_msg_id,
            });
        }
    }
    if let Err(e) = crate::pg::half_message_events::mark_sent(&***client, &sent).await {
        warn!(error = %e, "could not mark the cancel events sent");
    }
}
