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

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        "mq_publish_total",
        "Sends by topic and outcome (confirmed, unknown, definite_failure)"
    );
    describe_histogram!(
        "mq_publish_latency_seconds",
        Unit::Seconds,
        "Broker send latency"
    );
    describe_counter!(
        "mq_publish_unknown_total",
        "Sends whose result is unknown (re-sent later, stock kept)"
    );
    describe_counter!("reservation_total", "Reservation attempts by result");
    describe_counter!(
        "reservation_resend_refused_total",
        "Scanner re-sends the broker refused while the reservation was still valid: retried, not released"
    );
    describe_counter!(
        "reservation_sold_out_from_memory_total",
        "Requests for a SKU known sold out answered SOLD_OUT without Redis (not from its winners)"
    );
    describe_gauge!(
        "sold_out_flags",
        "SKUs this API instance answers SOLD_OUT from memory"
    );
    describe_counter!(
        "reservation_unconsumed_resend_total",
        "Confirmed sends the order-create inbox never saw in time (a dead broker may hold them) sent again, same message_id, by outcome"
    );
    describe_counter!(
        "outbox_unconsumed_requeue_total",
        "Confirmed outbox events the consumers never took in time (a dead broker may hold them) put back to be sent again, by tag"
    );
    describe_counter!(
        "redis_cluster_redirect_retry_total",
        "Pipelines of Redis scripts sent again because the cluster answered a redirection or cluster-down (a failover moving a slot)"
    );
    describe_counter!(
        "reservation_awaiting_checked_total",
        "Watched confirmed sends checked against the order-create inbox, by verdict (consumed, resent, settled)"
    );
    describe_gauge!(
        "reservation_awaiting_consumption",
        "Confirmed sends not yet seen in the order-create inbox (watched by the scanner)"
    );
    describe_counter!(
        "reservation_settled_total",
        "Reservations whose re-send was refused after validity + grace, settled from PostgreSQL, by verdict (fenced: released once; consumed: a copy reached the consumer)"
    );
    describe_gauge!(
        "mq_consumer_lag_messages",
        "Unconsumed messages of a consumer group, its retry topic included, by topic"
    );
    describe_gauge!(
        "mq_consumer_lag_seconds",
        "Age of the oldest unconsumed message of a consumer group (retry topic included), by topic"
    );
    describe_gauge!(
        "mq_consumer_retry_lag_messages",
        "Failed deliveries due again and not consumed yet (the group's %RETRY% topic), by topic"
    );
    describe_counter!(
        "mq_consumer_lag_read_errors_total",
        "Backlog readings the broker did not answer, by topic"
    );
    describe_counter!(
        "mq_consume_repeated_failure_total",
        "Deliveries that failed for the third time or more in a row, by topic: stuck work, long before the DLQ"
    );
    describe_histogram!(
        "order_reservation_to_order_seconds",
        Unit::Seconds,
        "From Redis's acceptance of a reservation to its committed order (the 3 s SLO)"
    );
    describe_counter!(
        "role_task_failures_total",
        "Background tasks of this role that died (the role then stops and exits non-zero)"
    );
    describe_histogram!(
        "http_request_duration_seconds",
        Unit::Seconds,
        "API latency by route"
    );
    describe_counter!("mq_consume_total", "Consumed messages by topic and result");
    describe_histogram!(
        "mq_consume_process_seconds",
        Unit::Seconds,
        "Listener call duration per batch"
    );
    describe_gauge!("mq_consumer_inflight", "Batches being processed");
    describe_gauge!(
        "mq_consumer_ready",
        "Messages of the group on the broker, not pulled yet (lag minus the client's cache)"
    );
    describe_gauge!(
        "mq_consumer_cached_messages",
        "Messages the consumer has pulled and not ACKed yet (its local cache)"
    );
    describe_counter!(
        "mq_dlq_replay_total",
        "DLQ replays by result (confirmed, unknown, definite_failure, refused), from the audit table"
    );
    describe_counter!(
        "mq_duplicate_message_total",
        "Messages already processed (inbox hit)"
    );
    describe_counter!(
        "mq_business_reject_total",
        "Reservations rejected by the order transaction, by reason"
    );
    describe_counter!(
        "mq_quarantine_total",
        "Poison messages quarantined, by reason"
    );
    describe_counter!(
        "mq_ack_failure_total",
        "ACKs the MQ client failed to deliver after commit, by kind (offset_commit, send_back); the redelivery hits the inbox"
    );
    describe_histogram!(
        "order_cancel_delay_seconds",
        Unit::Seconds,
        "From an order's payment deadline to its timeout cancel (timer or sweep)"
    );
    describe_counter!(
        "order_cancel_sweep_total",
        "Orders the timeout sweep found unpaid past deadline + grace, by what came of them"
    );
    describe_histogram!(
        "order_tx_latency_seconds",
        Unit::Seconds,
        "Order transaction latency (begin to commit), by kind: create (order consumer), cancel (timeout cancel)"
    );
    describe_gauge!(
        "order_tx_paced",
        "1 while pacing holds the order consumer to one transaction (consumer.pace_age_ms)"
    );
    describe_counter!(
        "order_tx_retry_total",
        "Order transactions rolled back by a transient failure (lost connection, deadlock, timeout) and attempted again in-process, by kind"
    );
    describe_histogram!(
        "pg_pool_wait_seconds",
        Unit::Seconds,
        "Wait for a pooled PostgreSQL connection"
    );
    describe_gauge!("pg_pool_acquired", "PostgreSQL connections in use");
    describe_counter!("pg_deadlock_total", "Deadlocks seen");
    describe_counter!(
        "pg_serialization_retry_total",
        "Serialization failures seen"
    );
    describe_counter!(
        "inventory_condition_update_miss_total",
        "Units refused by the conditional stock update"
    );
    describe_gauge!(
        "worker_budget",
        "PostgreSQL transactions this process may run at once"
    );
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
