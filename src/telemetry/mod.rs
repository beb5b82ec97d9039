//! Logs and metrics, initialised once per process. Logs are structured (`tracing`, JSON with
//! `telemetry.json = true`) and carry the business ids as fields; metrics use the names of
//! docs/architecture/observability.md#observability with bounded labels (never an id) and are
//! served on `/metrics` by every long-running role.

mod catalog;

pub use catalog::{Kind, Metric, METRICS};

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
    // A second init (tests) is harmless: the first subscriber stays. The subscriber's most
    // verbose level also becomes the `log` crate's (`try_init`), which is what keeps the
    // libraries that log through `log` (tokio-postgres: a trace line per protocol message)
    // from paying for a record nobody writes.
    let _ = subscriber(filter, settings.json, writer, terminal).try_init();
}

/// The process's subscriber: the formatted log lines under `filter`, and the MQ client's ACK
/// failures turned into metrics. Its `max_level_hint` is `filter`'s (the ACK-failure layer
/// wants errors only and says so).
fn subscriber<W>(
    filter: EnvFilter,
    json: bool,
    writer: W,
    terminal: bool,
) -> impl tracing::Subscriber + Send + Sync
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    // Colour only on a terminal: a log file or journald gets plain text, never ANSI codes.
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(writer)
        .with_target(true)
        .with_ansi(terminal);
    let fmt = if json {
        fmt.json().flatten_event(true).boxed()
    } else {
        fmt.boxed()
    };
    let ack_failures =
        filter_fn(|m| *m.level() == Level::ERROR && m.target().starts_with(MQ_CLIENT_TARGET))
            .with_max_level_hint(Level::ERROR);
    tracing_subscriber::registry()
        .with(fmt.with_filter(filter))
        .with(AckFailureLayer.with_filter(ack_failures))
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
    fn the_subscriber_is_no_more_verbose_than_its_filter() {
        // What `try_init` hands to the `log` crate as its max level: at "info", the
        // libraries' debug and trace records are skipped before any record is built.
        use tracing::level_filters::LevelFilter;
        use tracing::Subscriber;
        let at = |f: &str| subscriber(EnvFilter::new(f), false, std::io::sink, false);
        assert_eq!(at("info").max_level_hint(), Some(LevelFilter::INFO));
        assert_eq!(at("warn").max_level_hint(), Some(LevelFilter::WARN));
        assert_eq!(
            at("info,seckill=debug").max_level_hint(),
            Some(LevelFilter::DEBUG)
        );
    }

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
