//! Transaction messages (docs/architecture/messages.md#delivering-events) over the client's
//! `TransactionMQProducer`.
//!
//! The client drives a transaction message itself: it sends the half message, calls the
//! listener's synchronous `execute_local_transaction` on its blocking lane, and sends the end
//! (commit / rollback / unknown) one way. The caller's local transaction is async PostgreSQL
//! work, so [`RocketTransactionProducer::begin`] turns that around: the send runs as a task,
//! the callback tells `begin` the half is stored and then waits on a channel for the outcome
//! the caller passes to [`HalfMessage::end`]. A caller that never ends (dropped, or slower than
//! the local timeout plus a margin) leaves the end UNKNOWN: the broker asks back, and the
//! [`TransactionChecker`] answers from PostgreSQL alone.

use std::any::Any;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::anyhow;
use rocketmq_client_rust::{LocalTransactionState, TransactionListener, TransactionMQProducer};
use rocketmq_model::common::message::message_ext::MessageExt;
use rocketmq_model::common::message::MessageTrait;
use tokio::sync::{oneshot, OwnedSemaphorePermit, RwLock, Semaphore};

use crate::mq::{
    HalfMessage, LocalOutcome, OutMessage, SendOutcome, TransactionChecker, TransactionPublisher,
};

use super::classify::outcome_from_error;
use super::consumer::to_delivery;
use super::producer::to_message;
use super::runtime::SlotReservation;
use super::*;

/// Settings of a [`RocketTransactionProducer`].
#[derive(Debug, Clone)]
pub struct TransactionOptions {
    pub name_srv: String,
    /// The transaction producer group: the broker asks any live member about a half.
    pub group: String,
    /// Topics it sends to, routed at start: the broker asks only producers it has a
    /// heartbeat from, and the client heartbeats only to brokers of routes it knows, so an
    /// instance that has sent nothing yet still answers check-backs.
    pub topics: Vec<String>,
    /// Bound of the half message's send.
    pub send_timeout_ms: u64,
    /// Client retries of a half refused before it was stored (as [`ProducerOptions::retries`]).
    pub retries: u32,
    /// How long the client's callback waits for the caller's outcome once the half is stored:
    /// the local transaction's own bound plus a margin. Past it the end is UNKNOWN.
    pub outcome_wait: Duration,
    /// Transaction messages in flight at once (each holds a blocking-lane thread while its
    /// local transaction runs); `begin` waits for a slot past it.
    pub in_flight: usize,
    /// Check-backs answered at once.
    pub check_threads: u32,
    /// Bound of one check-back answer; past it the answer is UNKNOWN (asked again).
    pub check_timeout: Duration,
}

/// [`TransactionPublisher`] over a started `TransactionMQProducer`.
pub struct RocketTransactionProducer {
    // Every send holds a read guard for its whole transaction; `shutdown` takes the write
    // guard, so it waits for the transactions in flight.
    producer: Arc<RwLock<TransactionMQProducer>>,
    in_flight: Arc<Semaphore>,
    /// `in_flight`'s size.
    capacity: usize,
    outcome_wait: Duration,
    _slots: SlotReservation,
    _runtime: MqRuntime,
}

/// What `begin` hands the client's callback through the send's `arg`.
struct Bridge {
    stored: Mutex<Option<oneshot::Sender<()>>>,
    outcome: Mutex<Option<std::sync::mpsc::Receiver<LocalOutcome>>>,
    wait: Duration,
}

struct Listener {
    checker: Arc<dyn TransactionChecker>,
    /// The caller's runtime: check-backs run there, never on the client's own.
    app: tokio::runtime::Handle,
    check_timeout: Duration,
}

fn state(outcome: LocalOutcome) -> LocalTransactionState {
    match outcome {
        LocalOutcome::Commit => LocalTransactionState::CommitMessage,
        LocalOutcome::Rollback => LocalTransactionState::RollbackMessage,
        LocalOutcome::Unknown => LocalTransactionState::Unknown,
    }
}

fn take<T>(slot: &Mutex<Option<T>>) -> Option<T> {
    match slot.lock() {
        Ok(mut g) => g.take(),
        Err(poisoned) => poisoned.into_inner().take(),
    }
}

impl TransactionListener for Listener {
    fn execute_local_transaction(
        &self,
        _msg: &dyn MessageTrait,
        arg: Option<&(dyn Any + Send + Sync)>,
    ) -> LocalTransactionState {
        let Some(bridge) = arg.and_then(|a| a.downcast_ref::<Bridge>()) else {
            tracing::warn!("transaction message sent without its bridge; ending it UNKNOWN");
            return LocalTransactionState::Unknown;
        };
        let outcome = take(&bridge.outcome);
        if let Some(stored) = take(&bridge.stored) {
            let _ = stored.send(());
        }
        // A blocking-lane thread, not a runtime worker: waiting here stalls no executor.
        let outcome = outcome
            .and_then(|rx| rx.recv_timeout(bridge.wait).ok())
            .unwrap_or(LocalOutcome::Unknown);
        metrics::counter!("mq_transaction_end_total", "outcome" => outcome.label()).increment(1);
        state(outcome)
    }

    fn check_local_transaction(&self, msg: &MessageExt) -> LocalTransactionState {
        let delivery = to_delivery(msg);
        let message_id = delivery.properties.get("message_id").map(str::to_owned);
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let checker = Arc::clone(&self.checker);
        self.app.spawn(async move {
            let _ = tx.send(checker.check(&delivery).await);
        });
        let answer = rx
            .recv_timeout(self.check_timeout)
            .unwrap_or(LocalOutcome::Unknown);
        metrics::counter!("mq_transaction_check_total", "answer" => answer.label()).increment(1);
        tracing::info!(
            message_id = message_id.unwrap_or_default(),
            answer = answer.label(),
            "transaction check-back answered"
        );
        state(answer)
    }
}

impl RocketTransactionProducer {
    /// Builds and starts the producer; `checker` answers the broker's check-backs. Call from
    /// inside the Tokio runtime the checks should run on.
    pub async fn start(
        runtime: &MqRuntime,
        opts: TransactionOptions,
        checker: Arc<dyn TransactionChecker>,
    ) -> anyhow::Result<Self> {
        let slots = runtime.reserve_slots(opts.in_flight + opts.check_threads as usize)?;
        let listener = Listener {
            checker,
            app: tokio::runtime::Handle::current(),
            check_timeout: opts.check_timeout,
        };
        let mut producer = TransactionMQProducer::builder(runtime.client_runtime())
            .producer_group(opts.group.clone())
            .name_server_addr(opts.name_srv.clone())
            .topics(opts.topics.clone())
            .send_msg_timeout(u32::try_from(opts.send_timeout_ms).unwrap_or(u32::MAX))
            .retry_times_when_send_failed(opts.retries)
            .transaction_listener(listener)
            .check_thread_pool_min_size(opts.check_threads)
            .check_thread_pool_max_size(opts.check_threads)
            .check_request_hold_max(2_000)
            .build();
        producer.start().await.map_err(|e| {
            anyhow!(
                "starting transaction producer {} against {}: {e}",
                opts.group,
                opts.name_srv
            )
        })?;
        Ok(Self {
            producer: Arc::new(RwLock::new(producer)),
            in_flight: Arc::new(Semaphore::new(opts.in_flight)),
            capacity: opts.in_flight,
            outcome_wait: opts.outcome_wait,
            _slots: slots,
            _runtime: runtime.clone(),
        })
    }
}

/// A stored half message: the client's callback waits on `outcome`.
struct RocketHalf {
    outcome: std::sync::mpsc::SyncSender<LocalOutcome>,
    send: tokio::task::JoinHandle<
        rocketmq_client_rust::ClientResult<rocketmq_client_rust::TransactionSendResult>,
    >,
    _permit: OwnedSemaphorePermit,
}

#[async_trait::async_trait]
impl HalfMessage for RocketHalf {
    async fn end(self: Box<Self>, outcome: LocalOutcome) -> String {
        // The callback may have given up waiting (its end went out UNKNOWN): the check-back
        // decides then.
        let _ = self.outcome.send(outcome);
        match self.send.await {
            Ok(Ok(r)) => r
                .send_result
                .and_then(|s| s.msg_id)
                .map(|id| id.to_string())
                .unwrap_or_default(),
            _ => String::new(),
        }
    }
}

impl RocketTransactionProducer {
    /// Stores `msg` as a half message, holding `permit` until its end.
    async fn begin_with(
        &self,
        msg: OutMessage,
        permit: OwnedSemaphorePermit,
    ) -> Result<Box<dyn HalfMessage>, SendOutcome> {
        let message = to_message(msg, false).map_err(|e| outcome_from_error(&e))?;
        let (stored_tx, stored_rx) = oneshot::channel();
        let (outcome_tx, outcome_rx) = std::sync::mpsc::sync_channel(1);
        let bridge = Bridge {
            stored: Mutex::new(Some(stored_tx)),
            outcome: Mutex::new(Some(outcome_rx)),
            wait: self.outcome_wait,
        };
        let producer = Arc::clone(&self.producer).read_owned().await;
        let send = tokio::spawn(async move {
            producer
                .send_message_in_transaction(message, Some(bridge))
                .await
        });
        if stored_rx.await.is_ok() {
            return Ok(Box::new(RocketHalf {
                outcome: outcome_tx,
                send,
                _permit: permit,
            }));
        }
        // The callback never ran: the half was not stored, or stored with a status the client
        // rolls back at once (flush or replica timeout), or stored but the callback could not
        // be scheduled (its end went out UNKNOWN: the check-back decides).
        Err(match send.await {
            Ok(Ok(r)) => SendOutcome::Unknown {
                error: format!(
                    "half message ended {:?} without the local transaction",
                    r.local_transaction_state
                ),
            },
            Ok(Err(e)) => outcome_from_error(&e),
            Err(e) => SendOutcome::Unknown {
                error: format!("half message send task: {e}"),
            },
        })
    }
}

fn shut_down() -> SendOutcome {
    SendOutcome::DefiniteFailure {
        error: "the transaction producer is shut down".to_owned(),
    }
}

#[async_trait::async_trait]
impl TransactionPublisher for RocketTransactionProducer {
    async fn begin(&self, msg: OutMessage) -> Result<Box<dyn HalfMessage>, SendOutcome> {
        let Ok(permit) = Arc::clone(&self.in_flight).acquire_owned().await else {
            return Err(shut_down());
        };
        self.begin_with(msg, permit).await
    }

    async fn begin_many(
        &self,
        msgs: Vec<OutMessage>,
    ) -> Vec<Result<Box<dyn HalfMessage>, SendOutcome>> {
        // More than the producer may ever hold at once would wait for itself: those go
        // without a half (their callers send them the outbox way).
        let n = msgs.len().min(self.capacity);
        let mut permits = Arc::clone(&self.in_flight)
            .acquire_many_owned(n as u32)
            .await
            .ok();
        let begun = msgs.into_iter().enumerate().map(|(i, msg)| {
            let permit = permits
                .as_mut()
                .and_then(|p| if i < n { p.split(1) } else { None });
            async move {
                match permit {
                    Some(permit) => self.begin_with(msg, permit).await,
                    None => Err(SendOutcome::DefiniteFailure {
                        error: "more half messages than events.transaction_in_flight".to_owned(),
                    }),
                }
            }
        });
        futures::future::join_all(begun).await
    }

    /// Stops taking transactions, waits for those in flight to end, stops the producer
    /// (idempotent).
    async fn shutdown(&self) {
        self.in_flight.close();
        let mut producer = self.producer.write().await;
        producer.shutdown().await;
    }
}
