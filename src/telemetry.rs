//! Logs and metrics, initialised once per process. Logs are structured (`tracing`, JSON with
//! `telemetry.json = true`) and carry the business ids as fields; metrics use the names of docs/ARCHITECTURE.md#observability
//! with bounded labels (never an id) and are served on `/metrics` by every long-running role.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use metrics::Unit;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio_util::sync::CancellationToken;
use tracing::Level;
use tracing_subscriber::filter::filter_fn;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::config::TelemetrySettings;

/// Installs the global log subscriber, writing to stdout (a role's log: a file or journald).
/// `RUST_LOG` overrides the configured level.
///
/// Next to the log output sits [`AckFailureLayer`], with its own filter, so the ACK-failure
/// count does not depend on the configured log level.
pub fn init_logs(settings: &TelemetrySettings) {
    init_logs_to(settings, std::io::stdout, std::io::stdout().is_terminal());
}

/// The same, writing to stderr: for tools whose stdout is their report (the operator tools,
/// `seckill-bench`).
pub fn init_logs_to_stderr(settings: &TelemetrySettings) {
    init_logs_to(settings, std::io::stderr, std::io::stderr().is_terminal());
}

fn init_logs_to<W>(settings: &TelemetrySettings, writer: W, terminal: bool)
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&settings.log_level));
    // Colour only on a terminal: a log file or journald gets plain text, never ANSI codes.
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(writer)
        .with_target(true)
        .with_ansi(terminal);
    let fmt = if settings.json {
        fmt.json().flatten_event(true).boxed()
    } else {
        fmt.boxed()
    };
    // A second init (tests) is harmless: the first subscriber stays.
    let _ = tracing_subscriber::registry()
        .with(fmt.with_filter(filter))
        .with(AckFailureLayer.with_filter(filter_fn(|m| {
            *m.level() == Level::ERROR && m.target().starts_with(MQ_CLIENT_TARGET)
        })))
        .try_init();
}

/// Log target prefix of the RocketMQ client crate.
const MQ_CLIENT_TARGET: &str = "rocketmq_client_rust";

/// Which ACK failed, from one of the MQ client's own error events, if it reports one.
///
/// A push consumer "ACKs" in two ways the client does not surface to the listener: it commits
/// the consumed offset to the broker (`offset_commit`; on failure the messages since the last
/// commit are redelivered and hit the inbox), and it sends a message to be retried back to the
/// broker (`send_back`; on failure the client retries it locally). Both are logged at ERROR
/// by the client with these messages (rocketmq-client-rust 1.0.0).
pub fn ack_failure_kind(target: &str, message: &str) -> Option<&'static str> {
    if !target.starts_with(MQ_CLIENT_TARGET) {
        return None;
    }
    if message.starts_with("updateConsumeOffsetToBroker exception") {
        Some("offset_commit")
    } else if message.starts_with("send message back") {
        Some("send_back")
    } else {
        None
    }
}

/// Counts the MQ client's ACK failures as `mq_ack_failure_total{kind}`.
pub struct AckFailureLayer;

impl<S: tracing::Subscriber> Layer<S> for AckFailureLayer {
    fn on_event(
        &self,
        event: &tracing::Event<'_>,
        _ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        let mut message = MessageField(String::new());
        event.record(&mut message);
        if let Some(kind) = ack_failure_kind(event.metadata().target(), &message.0) {
            metrics::counter!("mq_ack_failure_total", "kind" => kind).increment(1);
        }
    }
}

struct MessageField(String);

impl tracing::field::Visit for MessageField {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "message" {
            self.0 = value.to_owned();
        }
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}

static PROMETHEUS: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the Prometheus recorder once per process and returns its handle.
pub fn metrics_handle() -> PrometheusHandle {
    PROMETHEUS
        .get_or_init(|| {
            let seconds = &[
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0,
            ];
            // A cancel's lateness is seconds to minutes, not milliseconds.
            let lateness = &[0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0];
            // Reservation → order: the 3 s SLO is a bucket boundary, so its share is exact.
            let slo = &[
                0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0, 300.0,
            ];
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(
                    Matcher::Full("order_cancel_delay_seconds".to_string()),
                    lateness,
                )
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full("order_reservation_to_order_seconds".to_string()),
                        slo,
                    )
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Suffix("_seconds".to_string()), seconds)
                })
                .expect("static bucket lists are non-empty");
            match builder.install_recorder() {
                Ok(handle) => {
                    describe();
                    handle
                }
                // Another recorder is installed (only in tests): render an empty, private one.
                Err(_) => PrometheusBuilder::new().build_recorder().handle(),
            }
        })
        .clone()
}

/// How a metric is exported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// One exported metric and its description (the `# HELP` line).
#[derive(Debug, Clone, Copy)]
pub struct Metric {
    pub name: &'static str,
    pub kind: Kind,
    pub unit: Option<Unit>,
    pub help: &'static str,
}

/// Every metric the roles export, described once. `tests/it/metrics.rs` checks that every
/// name recorded in `src/` is listed here.
pub const METRICS: &[Metric] = &[
    Metric {
        name: "mq_publish_total",
        kind: Kind::Counter,
        unit: None,
        help: "Sends by topic and outcome (confirmed, unknown, definite_failure)",
    },
    Metric {
        name: "mq_publish_latency_seconds",
        kind: Kind::Histogram,
        unit: Some(Unit::Seconds),
        help: "Broker send latency",
    },
    Metric {
        name: "mq_publish_unknown_total",
        kind: Kind::Counter,
        unit: None,
        help: "Sends whose result is unknown (re-sent later, stock kept)",
    },
    Metric {
        name: "reservation_total",
        kind: Kind::Counter,
        unit: None,
        help: "Reservation attempts by result",
    },
    Metric {
        name: "reservation_resend_refused_total",
        kind: Kind::Counter,
        unit: None,
        help: "Scanner re-sends the broker refused while the reservation was still valid: retried, not released",
    },
    Metric {
        name: "reservation_sold_out_from_memory_total",
        kind: Kind::Counter,
        unit: None,
        help: "Requests for a SKU known sold out answered SOLD_OUT without Redis (not from its winners)",
    },
    Metric {
        name: "sold_out_flags",
        kind: Kind::Gauge,
        unit: None,
        help: "SKUs this API instance answers SOLD_OUT from memory",
    },
    Metric {
        name: "reservation_unconsumed_resend_total",
        kind: Kind::Counter,
        unit: None,
        help: "Confirmed sends the order-create inbox never saw in time (a dead broker may hold them) sent again, same message_id, by outcome",
    },
    Metric {
        name: "outbox_unconsumed_requeue_total",
        kind: Kind::Counter,
        unit: None,
        help: "Confirmed outbox events the consumers never took in time (a dead broker may hold them) put back to be sent again, by tag",
    },
    Metric {
        name: "redis_cluster_redirect_retry_total",
        kind: Kind::Counter,
        unit: None,
        help: "Pipelines of Redis scripts sent again because the cluster answered a redirection or cluster-down (a failover moving a slot)",
    },
    Metric {
        name: "reservation_awaiting_checked_total",
        kind: Kind::Counter,
        unit: None,
        help: "Watched confirmed sends checked against the order-create inbox, by verdict (consumed, resent, settled)",
    },
    Metric {
        name: "reservation_awaiting_consumption",
        kind: Kind::Gauge,
        unit: None,
        help: "Confirmed sends not yet seen in the order-create inbox (watched by the scanner)",
    },
    Metric {
        name: "reservation_settled_total",
        kind: Kind::Counter,
        unit: None,
        help: "Reservations whose re-send was refused after validity + grace, settled from PostgreSQL, by verdict (fenced: released once; consumed: a copy reached the consumer)",
    },
    Metric {
        name: "mq_consumer_lag_messages",
        kind: Kind::Gauge,
        unit: None,
        help: "Unconsumed messages of a consumer group, its retry topic included, by topic",
    },
    Metric {
        name: "mq_consumer_lag_seconds",
        kind: Kind::Gauge,
        unit: None,
        help: "Age of the oldest unconsumed message of a consumer group (retry topic included), by topic",
    },
    Metric {
        name: "mq_consumer_retry_lag_messages",
        kind: Kind::Gauge,
        unit: None,
        help: "Failed deliveries due again and not consumed yet (the group's %RETRY% topic), by topic",
    },
    Metric {
        name: "mq_consumer_lag_read_errors_total",
        kind: Kind::Counter,
        unit: None,
        help: "Backlog readings the broker did not answer, by topic",
    },
    Metric {
        name: "mq_consume_repeated_failure_total",
        kind: Kind::Counter,
        unit: None,
        help: "Deliveries that failed for the third time or more in a row, by topic: stuck work, long before the DLQ",
    },
    Metric {
        name: "order_reservation_to_order_seconds",
        kind: Kind::Histogram,
        unit: Some(Unit::Seconds),
        help: "From Redis's acceptance of a reservation to its committed order (the 3 s SLO)",
    },
    Metric {
        name: "role_task_failures_total",
        kind: Kind::Counter,
        unit: None,
        help: "Background tasks of this role that died (the role then stops and exits non-zero)",
    },
    Metric {
        name: "http_request_duration_seconds",
        kind: Kind::Histogram,
        unit: Some(Unit::Seconds),
        help: "API latency by route",
    },
    Metric {
        name: "mq_consume_total",
        kind: Kind::Counter,
        unit: None,
        help: "Consumed messages by topic and result",
    },
    Metric {
        name: "mq_consume_process_seconds",
        kind: Kind::Histogram,
        unit: Some(Unit::Seconds),
        help: "Listener call duration per batch",
    },
    Metric {
        name: "mq_consumer_inflight",
        kind: Kind::Gauge,
        unit: None,
        help: "Batches being processed",
    },
    Metric {
        name: "mq_consumer_ready",
        kind: Kind::Gauge,
        unit: None,
        help: "Messages of the group on the broker, not pulled yet (lag minus the client's cache)",
    },
    Metric {
        name: "mq_consumer_cached_messages",
        kind: Kind::Gauge,
        unit: None,
        help: "Messages the consumer has pulled and not ACKed yet (its local cache)",
    },
    Metric {
        name: "mq_dlq_replay_total",
        kind: Kind::Counter,
        unit: None,
        help: "DLQ replays by result (confirmed, unknown, definite_failure, refused), from the audit table",
    },
    Metric {
        name: "mq_duplicate_message_total",
        kind: Kind::Counter,
        unit: None,
        help: "Messages already processed (inbox hit)",
    },
    Metric {
        name: "mq_business_reject_total",
        kind: Kind::Counter,
        unit: None,
        help: "Reservations rejected by the order transaction, by reason",
    },
    Metric {
        name: "mq_quarantine_total",
        kind: Kind::Counter,
        unit: None,
        help: "Poison messages quarantined, by reason",
    },
    Metric {
        name: "mq_ack_failure_total",
        kind: Kind::Counter,
        unit: None,
        help: "ACKs the MQ client failed to deliver after commit, by kind (offset_commit, send_back); the redelivery hits the inbox",
    },
    Metric {
        name: "order_cancel_delay_seconds",
        kind: Kind::Histogram,
        unit: Some(Unit::Seconds),
        help: "From an order's payment deadline to its timeout cancel (timer or sweep)",
    },
    Metric {
        name: "order_cancel_sweep_total",
        kind: Kind::Counter,
        unit: None,
        help: "Orders the timeout sweep found unpaid past deadline + grace, by what came of them",
    },
    Metric {
        name: "order_tx_latency_seconds",
        kind: Kind::Histogram,
        unit: Some(Unit::Seconds),
        help: "Order transaction latency (begin to commit), by kind: create (order consumer), cancel (timeout cancel)",
    },
    Metric {
        name: "order_tx_paced",
        kind: Kind::Gauge,
        unit: None,
        help: "1 while pacing holds the order consumer to one transaction (consumer.pace_age_ms)",
    },
    Metric {
        name: "order_tx_retry_total",
        kind: Kind::Counter,
        unit: None,
        help: "Order transactions rolled back by a transient failure (lost connection, deadlock, timeout) and attempted again in-process, by kind",
    },
    Metric {
        name: "pg_pool_wait_seconds",
        kind: Kind::Histogram,
        unit: Some(Unit::Seconds),
        help: "Wait for a pooled PostgreSQL connection",
    },
    Metric {
        name: "pg_pool_acquired",
        kind: Kind::Gauge,
        unit: None,
        help: "PostgreSQL connections in use",
    },
    Metric {
        name: "pg_deadlock_total",
        kind: Kind::Counter,
        unit: None,
        help: "Deadlocks seen",
    },
    Metric {
        name: "pg_serialization_retry_total",
        kind: Kind::Counter,
        unit: None,
        help: "Serialization failures seen",
    },
    Metric {
        name: "inventory_condition_update_miss_total",
        kind: Kind::Counter,
        unit: None,
        help: "Units refused by the conditional stock update",
    },
    Metric {
        name: "worker_budget",
        kind: Kind::Gauge,
        unit: None,
        help: "PostgreSQL transactions this process may run at once",
    },
    Metric {
        name: "admin_auth_failures_total",
        kind: Kind::Counter,
        unit: None,
        help: "Admin requests refused for their token, by result (refused, busy, tarpit, throttled)",
    },
    Metric {
        name: "admission_lag_unreadable_total",
        kind: Kind::Counter,
        unit: None,
        help: "Admission checks that could not read the order-create lag (the sale pauses: fail closed)",
    },
    Metric {
        name: "auth_failures_total",
        kind: Kind::Counter,
        unit: None,
        help: "Buyer requests refused for their token, by reason",
    },
    Metric {
        name: "compensation_total",
        kind: Kind::Counter,
        unit: None,
        help: "RELEASE_RESERVATION messages handled, by result (released, already_released, missing, quarantined)",
    },
    Metric {
        name: "event_delivery_total",
        kind: Kind::Counter,
        unit: None,
        help: "ORDER_PAID and ORDER_CANCELED events written, by family and delivery (outbox or transaction message)",
    },
    Metric {
        name: "http_connection_errors_total",
        kind: Kind::Counter,
        unit: None,
        help: "HTTP connections closed on an error or a limit, by listener and reason (head timeout, head too large, write stalled, ...)",
    },
    Metric {
        name: "mq_consume_batch_split_total",
        kind: Kind::Counter,
        unit: None,
        help: "Consumer batches that failed whole and were split to find the failing message, by kind",
    },
    Metric {
        name: "mq_dlq_intake_total",
        kind: Kind::Counter,
        unit: None,
        help: "Dead letters recorded in PostgreSQL by the DLQ intake",
    },
    Metric {
        name: "mq_name_server_down_total",
        kind: Kind::Counter,
        unit: None,
        help: "Times a name server stopped answering, by name server",
    },
    Metric {
        name: "mq_transaction_check_total",
        kind: Kind::Counter,
        unit: None,
        help: "Broker check-backs of transaction messages answered, by answer (commit, rollback, unknown)",
    },
    Metric {
        name: "mq_transaction_end_total",
        kind: Kind::Counter,
        unit: None,
        help: "Transaction messages ended by the producer, by outcome",
    },
    Metric {
        name: "order_cancel_total",
        kind: Kind::Counter,
        unit: None,
        help: "Timeout cancels of unpaid orders, by result (canceled, already paid, not yet expired, ...)",
    },
    Metric {
        name: "order_pay_total",
        kind: Kind::Counter,
        unit: None,
        help: "Payment notifications handled, by result",
    },
    Metric {
        name: "order_tx_stock_fallback_total",
        kind: Kind::Counter,
        unit: None,
        help: "Order transactions whose optimistic stock update fell short and took the locked path",
    },
    Metric {
        name: "order_tx_timeout_total",
        kind: Kind::Counter,
        unit: None,
        help: "Transactions that exceeded consumer.tx_timeout_ms (connection dropped, batch retried), by kind",
    },
    Metric {
        name: "outbox_auto_requeue_total",
        kind: Kind::Counter,
        unit: None,
        help: "DEAD outbox rows put back to PENDING once the broker answered again",
    },
    Metric {
        name: "outbox_dead_total",
        kind: Kind::Counter,
        unit: None,
        help: "Outbox rows that exhausted their send attempts and went DEAD",
    },
    Metric {
        name: "outbox_publish_total",
        kind: Kind::Counter,
        unit: None,
        help: "Outbox relay sends, by tag and outcome",
    },
    Metric {
        name: "pg_call_timeout_total",
        kind: Kind::Counter,
        unit: None,
        help: "API calls to PostgreSQL abandoned past their bound (answered 503)",
    },
    Metric {
        name: "projection_apply_total",
        kind: Kind::Counter,
        unit: None,
        help: "Order events applied to the Redis projection, by result (applied, stale, quarantined)",
    },
    Metric {
        name: "rate_limited_total",
        kind: Kind::Counter,
        unit: None,
        help: "Reservations refused by the abuse limits, by bucket (ip: the client address, u: the buyer)",
    },
    Metric {
        name: "reservation_resend_total",
        kind: Kind::Counter,
        unit: None,
        help: "Scanner re-sends of unconfirmed reservations (same message_id), by outcome",
    },
    Metric {
        name: "retention_deleted_total",
        kind: Kind::Counter,
        unit: None,
        help: "Bookkeeping rows deleted past their retention, by table",
    },
    Metric {
        name: "stock_bucket_moved_units_total",
        kind: Kind::Counter,
        unit: None,
        help: "Units of stock moved between stock buckets by the rebalancer",
    },
    Metric {
        name: "stock_bucket_moves_resumed_total",
        kind: Kind::Counter,
        unit: None,
        help: "Bucket moves cut midway (debited, not credited) that a later pass finished",
    },
    Metric {
        name: "stock_bucket_moves_total",
        kind: Kind::Counter,
        unit: None,
        help: "Moves of stock between stock buckets",
    },
    Metric {
        name: "admission_paused",
        kind: Kind::Gauge,
        unit: None,
        help: "1 while this API refuses new reservations (fail-closed admission or an operator's pause)",
    },
    Metric {
        name: "admission_ramp_share",
        kind: Kind::Gauge,
        unit: None,
        help: "Share of new reservations admitted while a paused sale ramps back up (1: all)",
    },
    Metric {
        name: "http_connections_open",
        kind: Kind::Gauge,
        unit: None,
        help: "Open HTTP connections, by listener",
    },
    Metric {
        name: "mq_dlq_messages",
        kind: Kind::Gauge,
        unit: None,
        help: "OPEN dead letters recorded in PostgreSQL",
    },
    Metric {
        name: "mq_dlq_oldest_age_seconds",
        kind: Kind::Gauge,
        unit: Some(Unit::Seconds),
        help: "Age of the oldest OPEN dead letter",
    },
    Metric {
        name: "mq_name_server_up",
        kind: Kind::Gauge,
        unit: None,
        help: "1 while the name server answers, by name server",
    },
    Metric {
        name: "order_tx_concurrency_limit",
        kind: Kind::Gauge,
        unit: None,
        help: "Order transactions this process runs at once now (the adaptive limit within the worker budget)",
    },
    Metric {
        name: "outbox_dead",
        kind: Kind::Gauge,
        unit: None,
        help: "DEAD outbox rows (an operator requeues them)",
    },
    Metric {
        name: "outbox_in_transaction",
        kind: Kind::Gauge,
        unit: None,
        help: "Outbox rows beside a stored half message, waiting for the transaction message's end",
    },
    Metric {
        name: "outbox_not_yet_due",
        kind: Kind::Gauge,
        unit: None,
        help: "PENDING outbox rows held until shortly before they are due (timers)",
    },
    Metric {
        name: "outbox_pending",
        kind: Kind::Gauge,
        unit: None,
        help: "PENDING outbox rows due to be sent",
    },
    Metric {
        name: "outbox_pending_oldest_age_seconds",
        kind: Kind::Gauge,
        unit: Some(Unit::Seconds),
        help: "Age of the oldest due PENDING outbox row",
    },
    Metric {
        name: "reservation_mq_pending",
        kind: Kind::Gauge,
        unit: None,
        help: "Reservations whose message is not known to be stored yet (pending a send or a re-send)",
    },
    Metric {
        name: "reservation_mq_pending_oldest_age_seconds",
        kind: Kind::Gauge,
        unit: Some(Unit::Seconds),
        help: "Age of the oldest reservation whose message is not known to be stored",
    },
    Metric {
        name: "mq_consume_batch_size",
        kind: Kind::Histogram,
        unit: None,
        help: "Messages per batch a consumer handles",
    },
    Metric {
        name: "mq_publish_batch_size",
        kind: Kind::Histogram,
        unit: None,
        help: "Messages per broker call of the API's batched sends",
    },
    Metric {
        name: "order_tx_batch_size",
        kind: Kind::Histogram,
        unit: None,
        help: "Messages per order transaction",
    },
];

/// Registers the description of every metric in [`METRICS`].
fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    for m in METRICS {
        match (m.kind, m.unit) {
            (Kind::Counter, Some(u)) => describe_counter!(m.name, u, m.help),
            (Kind::Counter, None) => describe_counter!(m.name, m.help),
            (Kind::Gauge, Some(u)) => describe_gauge!(m.name, u, m.help),
            (Kind::Gauge, None) => describe_gauge!(m.name, m.help),
            (Kind::Histogram, Some(u)) => describe_histogram!(m.name, u, m.help),
            (Kind::Histogram, None) => describe_histogram!(m.name, m.help),
        }
    }
}

/// Readiness flag a role flips once its dependencies answer and it takes work.
#[derive(Clone, Default)]
pub struct Readiness {
    ready: Arc<AtomicBool>,
    /// Set once a part of the role died: not ready again until the process restarts.
    broken: Arc<AtomicBool>,
}

impl Readiness {
    pub fn set(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }
    pub fn get(&self) -> bool {
        self.ready.load(Ordering::SeqCst) && !self.broken.load(Ordering::SeqCst)
    }
    /// Not ready from now on, whatever `set` says later (see `shutdown::Watchdog`).
    pub fn break_for_good(&self) {
        self.broken.store(true, Ordering::SeqCst);
    }
}

/// `/metrics`, `/healthz` and `/readyz` for roles without an HTTP API.
pub fn ops_router(handle: PrometheusHandle, ready: Readiness) -> Router {
    Router::new()
        .route("/metrics", get(move || async move { handle.render() }))
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(|State(ready): State<Readiness>| async move {
                if ready.get() {
                    (StatusCode::OK, "ready")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "not ready")
                }
            }),
        )
        .with_state(ready)
}

/// Serves the ops router on `addr` (the setting `key`, named if it cannot bind) until
/// `shutdown` fires.
pub async fn serve_ops(
    key: &str,
    addr: SocketAddr,
    ready: Readiness,
    shutdown: CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("{key}: cannot bind {addr}: {e}"))?;
    let app = ops_router(metrics_handle(), ready);
    Ok(tokio::spawn(crate::http::serve(
        listener,
        app,
        crate::http::Limits::OPS,
        shutdown,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::layer::SubscriberExt;

    #[test]
    fn ack_failure_kinds_come_only_from_the_client_crate() {
        let store = "rocketmq_client_rust::consumer::store::remote_broker_offset_store";
        assert_eq!(
            ack_failure_kind(store, "updateConsumeOffsetToBroker exception, mq,boom"),
            Some("offset_commit")
        );
        assert_eq!(
            ack_failure_kind(
                "rocketmq_client_rust::consumer::consumer_impl::default_mq_push_consumer_impl",
                "send message back error: timeout"
            ),
            Some("send_back")
        );
        assert_eq!(
            ack_failure_kind(store, "fetchConsumeOffsetFromBroker exception"),
            None
        );
        assert_eq!(
            ack_failure_kind("seckill::roles", "updateConsumeOffsetToBroker exception"),
            None
        );
    }

    #[test]
    fn the_layer_counts_client_ack_failures_into_the_metric() {
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let subscriber = tracing_subscriber::registry().with(AckFailureLayer);
        metrics::with_local_recorder(&recorder, || {
            tracing::subscriber::with_default(subscriber, || {
                tracing::error!(
                    target: "rocketmq_client_rust::consumer::store::remote_broker_offset_store",
                    "updateConsumeOffsetToBroker exception, {},{}", "mq0", "connection refused"
                );
                tracing::error!(
                    target: "rocketmq_client_rust::consumer::consumer_impl::default_mq_push_consumer_impl",
                    "send message back error: {}", "timeout"
                );
                tracing::error!(target: "seckill", "unrelated error");
            })
        });
        let text = handle.render();
        assert!(
            text.contains(r#"mq_ack_failure_total{kind="offset_commit"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"mq_ack_failure_total{kind="send_back"} 1"#),
            "{text}"
        );
    }
}
