//! `seckill api`: the buyers' HTTP API and the hot path
//! (docs/architecture/hot-path.md#the-hot-path).
//!
//! A reservation request mints its ids first, reserves atomically in Redis with one Lua
//! script, then sends ORDER_CREATE_REQUESTED with a bounded synchronous send and turns the
//! outcome into a Lua state transition: CONFIRMED → MQ_SENT; UNKNOWN → stays MQ_PENDING
//! with a re-send scheduled (stock is never given back); DEFINITE_FAILURE → MQ_FAILED and
//! the reservation released once. The buyer gets 202 QUEUED and polls the GET endpoints.
//!
//! - `reserve`: the reservation route, parse → admit → reserve → send and record;
//! - `queries`: the buyer's GET routes (owner-only);
//! - `payments`: the payment provider's signed notifications;
//! - `error`: the JSON error every route answers with, and how results map onto it;
//! - `admin`: the operators' listener (pause, resume, status, outbox requeue), audited;
//! - `admin_refunds`: the admin listener's refund routes (list, mark refunded);
//! - `admin_guard`: the admin listener's throttle of failed logins;
//! - `admission`: fail-closed admission, the background check that pauses new reservations
//!   (the whole API, or one activity); `gate`: one pause with its hysteresis and ramp;
//! - `limits`: per-address and per-buyer token buckets (429 RATE_LIMITED);
//! - `passes`: sale-pass registration, its proof of work, and a reservation's pass check;
//!   `pass_desk`: what the instance keeps for them;
//! - `request`: what every route reads of a request: the buyer, the body, the path's ids,
//!   the operator;
//! - `state`: what every handler holds (`ApiState`), with its bounded PostgreSQL call and the
//!   buyer a token names.

pub mod admin;
mod admin_guard;
mod admin_refunds;
mod admission;
pub mod bodies;
mod draw_hold;
mod error;
mod gate;
pub mod limits;
mod pass_desk;
mod passes;
mod payments;
mod queries;
mod request;
mod reserve;
mod sold_out;
mod state;

pub use admission::Admission;
pub use error::ApiError;
pub use reserve::reservation_event;
pub use sold_out::SoldOut;
pub use state::{ApiState, SentMarks};

use std::sync::Arc;
use std::time::Duration;

use secrecy::ExposeSecret;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::auth::buyer::BuyerAuth;
use crate::config::{BuyerIdentity, EventDelivery, Settings};
use crate::mq::lag::LagSource;
use crate::mq::Publisher;
use crate::redis::RedisStore;
use crate::shutdown::Watchdog;
use crate::telemetry::{metrics_handle, Readiness};

/// The buyers' router, with a bare `/healthz` and a `/readyz` that says ready or not and
/// nothing else: the metrics are on the ops listener (`api.metrics_listen`).
pub fn router(state: ApiState) -> Router {
    Router::new()
        .route(
            "/v1/activities/{activity_id}/skus/{sku_id}/reservations",
            post(reserve::reserve),
        )
        .route(
            "/v1/activities/{activity_id}/passes",
            post(passes::register),
        )
        .route(
            "/v1/activities/{activity_id}/passes/challenges",
            post(passes::challenge),
        )
        .route(
            "/v1/reservations/{reservation_id}",
            get(queries::get_reservation),
        )
        .route("/v1/orders/{order_id}", get(queries::get_order))
        .route("/v1/payments/notifications", post(payments::notification))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "NOT_FOUND", "no such route") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "METHOD_NOT_ALLOWED",
                "method not allowed on this route",
            )
        })
        .with_state(state)
}

/// How long `/readyz` waits for Redis: a probe gets its answer within a second even while
/// Redis hangs.
const READYZ_REDIS_BOUND: Duration = Duration::from_millis(800);

/// Ready while the API takes work, Redis answers and buyer tokens can be verified (the
/// identity provider's keys fetched once, when they come from `auth.jwks_url`).
async fn readyz(State(s): State<ApiState>) -> Response {
    let keys = s.auth.as_ref().is_none_or(|a| a.has_keys());
    let redis = tokio::time::timeout(READYZ_REDIS_BOUND, s.redis.ping()).await;
    if s.ready.get() && keys && matches!(redis, Ok(Ok(()))) {
        (StatusCode::OK, "ready").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready").into_response()
    }
}

pub async fn build_state(
    settings: Arc<Settings>,
    publisher: Arc<dyn Publisher>,
) -> anyhow::Result<ApiState> {
    let redis = RedisStore::connect(&settings.redis).await?;
    let pg = crate::pg::connect_pool(&settings.pg, settings.pg.api_pool_size).await?;
    let transactions = if settings.events.order_paid() == EventDelivery::Transaction {
        let in_flight = settings.events.transaction_in_flight;
        Some(crate::services::half_messages::start(&settings, pg.clone(), in_flight).await?)
    } else {
        None
    };
    let auth = match settings.auth.buyers {
        BuyerIdentity::Token => Some(Arc::new(BuyerAuth::from_settings(&settings.auth)?)),
        BuyerIdentity::Body => {
            warn!(
                "auth.buyers = \"body\": the body's user_id is believed as sent (development only)"
            );
            None
        }
    };
    Ok(ApiState {
        auth,
        sent_marks: Arc::new(state::sent_marks(&redis)),
        names: Arc::new(settings.names().clone()),
        inflight: Arc::new(Semaphore::new(settings.api.max_inflight)),
        admission: Arc::new(admission::Admission::with_ramp(Duration::from_secs(
            settings.api.resume_ramp_secs,
        ))),
        sold_out: Default::default(),
        passes: Arc::new(pass_desk::PassDesk::new(&settings)),
        settings,
        redis,
        pg,
        publisher,
        ready: Readiness::default(),
        lag: None,
        transactions,
    })
}

/// The API's listeners: the buyers', and the operators' ones a deployment keeps private.
pub struct Listeners {
    pub buyers: TcpListener,
    /// `/metrics`, `/healthz`, `/readyz` for Prometheus and probes (`api.metrics_listen`).
    pub ops: Option<TcpListener>,
    /// The admin routes (`api.admin_listen`), when `api.admin_token` is set.
    pub admin: Option<TcpListener>,
}

/// Serves the buyers' listener alone until `shutdown` fires (see [`serve_listeners`]).
pub async fn serve(
    listener: TcpListener,
    state: ApiState,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let listeners = Listeners {
        buyers: listener,
        ops: None,
        admin: None,
    };
    serve_listeners(listeners, state, shutdown).await
}

/// Serves until `shutdown` fires, then hands off (docs/architecture/roles.md#graceful-shutdown):
/// `/readyz` turns 503 at once while every listener keeps serving for `api.drain_delay_ms`,
/// so load balancers stop sending here before anything is refused; then the listeners close
/// and in-flight requests finish. `api.shutdown_grace_secs` bounds the whole of it. A
/// background task that dies (the admission check, the admin or ops listener) stops the
/// server the same way, and the result is an error naming it.
pub async fn serve_listeners(
    listeners: Listeners,
    state: ApiState,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let api = &state.settings.api;
    let grace = Duration::from_secs(api.shutdown_grace_secs);
    let drain_delay = Duration::from_millis(api.drain_delay_ms);
    // `stopping`: asked to stop (a signal or a dead task): not ready from then on.
    // `closing`: the drain delay later: the listeners and background loops end.
    let stopping = shutdown.child_token();
    let closing = CancellationToken::new();
    let watchdog = Watchdog::new(closing.clone(), state.ready.clone());
    watchdog.stop_on_death(stopping.clone());
    spawn_companions(&watchdog, &state, listeners.admin, listeners.ops, &closing);
    if let Some(auth) = &state.auth {
        auth.start(closing.clone());
    }
    state.ready.set(true);
    let ready = state.ready.clone();
    let transactions = state.transactions.clone();
    let limits = state.settings.api.http_limits();
    let app = router(state);
    let server = crate::http::serve(listeners.buyers, app, limits, closing.clone());
    let mut server = std::pin::pin!(server);
    let drained = tokio::select! {
        _ = &mut server => true,
        _ = stopping.cancelled() => false,
    };
    ready.set(false);
    let deadline = tokio::time::Instant::now() + grace;
    if !drained {
        info!(
            drain_delay_ms = drain_delay.as_millis() as u64,
            "not ready: serving on while the load balancers notice"
        );
        let drained = tokio::select! {
            _ = &mut server => true,
            _ = tokio::time::sleep(drain_delay.min(grace)) => false,
        };
        closing.cancel();
        info!("closing the listeners; draining in-flight requests");
        if !drained && tokio::time::timeout_at(deadline, server).await.is_err() {
            warn!(
                grace_secs = grace.as_secs(),
                "shutdown grace elapsed with requests in flight"
            );
        }
    }
    closing.cancel();
    if let Some(tx) = &transactions {
        // The payments still in flight end their halves first; the broker asks back about
        // any that did not.
        let at_least = tokio::time::Instant::now() + Duration::from_secs(1);
        if tokio::time::timeout_at(deadline.max(at_least), tx.shutdown())
            .await
            .is_err()
        {
            warn!("transaction producer did not stop within the grace");
        }
    }
    match watchdog.death() {
        Some(reason) => Err(anyhow::anyhow!(reason)),
        None => Ok(()),
    }
}

/// The API's background loops (the admission check, the sold-out poller) and its operators'
/// listeners, under the watchdog, each until `closing`.
fn spawn_companions(
    watchdog: &Watchdog,
    state: &ApiState,
    admin: Option<TcpListener>,
    ops: Option<TcpListener>,
    closing: &CancellationToken,
) {
    // The recorder is installed before anything is counted, whether or not an ops listener
    // serves it (an API embedded in a test or the bench reads it in-process).
    let metrics = metrics_handle();
    let api = &state.settings.api;
    let bound = Duration::from_secs_f64(api.reservation_valid_secs as f64 * api.fail_closed_share);
    watchdog.spawn(
        "admission",
        admission::run_checker(
            state.admission.clone(),
            state.redis.clone(),
            state.lag.clone(),
            admission::CheckerSettings {
                bound,
                every: Duration::from_millis(api.admission_check_ms),
                unreadable_probes: api.lag_unreadable_probes,
            },
            closing.clone(),
        ),
    );
    watchdog.spawn(
        "shard watch",
        crate::services::resync::watch_marks(
            state.redis.clone(),
            state.pg.clone(),
            Duration::from_millis(api.admission_check_ms),
            state.settings.redis.mode == crate::config::RedisMode::Cluster,
            closing.clone(),
        ),
    );
    if api.sold_out_poll_ms > 0 {
        watchdog.spawn(
            "sold-out poller",
            sold_out::run_poller(
                state.sold_out.clone(),
                state.redis.clone(),
                Duration::from_millis(api.sold_out_poll_ms),
                closing.clone(),
            ),
        );
    }
    if let Some(admin) = admin {
        let app = admin::router(state.clone());
        let limits = crate::http::Limits::ADMIN;
        watchdog.spawn(
            "admin listener",
            crate::http::serve(admin, app, limits, closing.clone()),
        );
    }
    if let Some(ops) = ops {
        let app = crate::telemetry::ops_router(metrics, state.ready.clone());
        let limits = crate::http::Limits::OPS;
        watchdog.spawn(
            "ops listener",
            crate::http::serve(ops, app, limits, closing.clone()),
        );
    }
}

/// Binds `api.listen`, `api.metrics_listen` and, with a token, `api.admin_listen`; a port
/// that cannot be bound fails start-up naming its key.
async fn bind_listeners(api: &crate::config::ApiSettings) -> anyhow::Result<Listeners> {
    async fn bind(key: &str, addr: std::net::SocketAddr) -> anyhow::Result<TcpListener> {
        TcpListener::bind(addr)
            .await
            .map_err(|e| anyhow::anyhow!("{key}: cannot bind {addr}: {e}"))
    }
    let admin = if api.admin_token.expose_secret().is_empty() {
        info!("api.admin_token is empty: no admin listener");
        None
    } else {
        info!(addr = %api.admin_listen, "admin listener");
        Some(bind("api.admin_listen", api.admin_listen).await?)
    };
    Ok(Listeners {
        buyers: bind("api.listen", api.listen).await?,
        ops: Some(bind("api.metrics_listen", api.metrics_listen).await?),
        admin,
    })
}

/// `seckill api`.
pub async fn run(settings: Settings) -> anyhow::Result<()> {
    let settings = Arc::new(settings);
    let mq = crate::mq::hot_path_publisher(&settings).await?;
    let mut state = build_state(settings.clone(), mq).await?;
    let names = settings.names();
    state.lag = Some(LagSource {
        probe: Arc::new(
            crate::mq::LagProbe::new(&crate::mq::runtime()?, &settings.mq.name_server_list())
                .await?,
        ),
        group: names.order_create_group.clone(),
        topic: names.order_create_topic.clone(),
    });
    let listeners = bind_listeners(&settings.api).await?;
    info!(
        addr = %settings.api.listen, metrics = %settings.api.metrics_listen,
        topic = %state.names.order_create_topic, "api listening"
    );
    let shutdown = CancellationToken::new();
    // Which server the pool writes to; a failover seen is counted and logged.
    let every = Duration::from_millis(settings.pg.primary_check_ms);
    crate::pg::primary::spawn(state.pg.clone(), every, shutdown.clone());
    let trigger = shutdown.clone();
    tokio::spawn(async move {
        crate::shutdown::shutdown_signal().await;
        info!("shutdown signal: draining in-flight requests");
        trigger.cancel();
    });
    serve_listeners(listeners, state, shutdown).await?;
    info!("api stopped");
    Ok(())
}
