//! `seckill api`: the buyers' HTTP API and the hot path (§2, §11–13).
//!
//! A reservation request mints its ids first, reserves atomically in Redis with one Lua
//! script, then sends ORDER_CREATE_REQUESTED with a bounded synchronous send and turns the
//! outcome into a Lua state transition: CONFIRMED → MQ_SENT; UNKNOWN → stays MQ_PENDING
//! with a re-send scheduled (stock is never given back); DEFINITE_FAILURE → MQ_FAILED and
//! the reservation released once. The buyer gets 202 QUEUED and polls the GET endpoints.

use std::future::IntoFuture;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{to_bytes, Body};
use axum::extract::{FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use chrono::{TimeZone, Utc};
use serde_json::json;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::config::{Names, Settings};
use crate::domain::event::TAG_CREATE_ORDER;
use crate::domain::ids::{is_valid_id, new_traceparent, parse_traceparent};
use crate::domain::request::parse_path_id;
use crate::domain::{
    Ids, OrderCreateRequested, ReserveRequest, TraceContext, ValidationError,
    EVENT_ORDER_CREATE_REQUESTED, SCHEMA_VERSION,
};
use crate::mq::{order_create_message, Publisher, SendOutcome};
use crate::pg::queries;
use crate::redis::{RedisStore, ReservationView, ReserveArgs, ReserveResult};
use crate::telemetry::{metrics_handle, Readiness};

/// Everything a request handler needs; cheap to clone.
#[derive(Clone)]
pub struct ApiState {
    pub settings: Arc<Settings>,
    pub names: Arc<Names>,
    pub redis: RedisStore,
    pub pg: deadpool_postgres::Pool,
    pub publisher: Arc<dyn Publisher>,
    /// Bounds reservation requests in flight; beyond it the API sheds load with 503.
    pub inflight: Arc<Semaphore>,
    pub ready: Readiness,
    /// Fail-closed admission, updated by the background checker.
    pub admission: Arc<crate::roles::admission::Admission>,
    /// Where the checker reads the order-create lag (`None`: pending age only).
    pub lag: Option<crate::roles::admission::LagSource>,
}

/// A JSON error with a stable code: `{"error": {"code", "message"}}`.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }
    fn invalid(e: ValidationError) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "INVALID_REQUEST", e.to_string())
    }
    fn unavailable(what: &str) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "UNAVAILABLE",
            format!("{what} is unavailable; retry with the same request_id"),
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (
            self.status,
            Json(json!({"error": {"code": self.code, "message": self.message}})),
        )
            .into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            resp.headers_mut()
                .insert("retry-after", axum::http::HeaderValue::from_static("1"));
        }
        resp
    }
}

/// The buyers' router plus `/metrics`, `/healthz`, `/readyz`.
pub fn router(state: ApiState) -> Router {
    let handle = metrics_handle();
    Router::new()
        .route(
            "/v1/activities/{activity_id}/skus/{sku_id}/reservations",
            post(reserve),
        )
        .route("/v1/reservations/{reservation_id}", get(get_reservation))
        .route("/v1/orders/{order_id}", get(get_order))
        .route("/v1/orders/{order_id}/pay", post(pay_order))
        .route("/metrics", get(move || async move { handle.render() }))
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

async fn readyz(State(s): State<ApiState>) -> Response {
    if s.ready.get() && s.redis.ping().await.is_ok() {
        (StatusCode::OK, "ready").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready").into_response()
    }
}

fn queued_body(v: &ReservationView, duplicate: bool) -> serde_json::Value {
    json!({
        "status": "QUEUED",
        "reservation_id": v.reservation_id,
        "order_id": v.order_id,
        "valid_until": Utc.timestamp_millis_opt(v.valid_until_ms).single(),
        "duplicate": duplicate,
    })
}

/// `Path` whose rejection (a segment that is not UTF-8, say) is the same JSON 400 as every
/// other bad input, never axum's plain-text one.
struct IdPath<T>(T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned + Send> FromRequestParts<S> for IdPath<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        Path::<T>::from_request_parts(parts, state)
            .await
            .map(|Path(t)| IdPath(t))
            .map_err(|e| {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "INVALID_REQUEST",
                    format!("bad path: {}", e.body_text()),
                )
            })
    }
}

async fn reserve(
    State(s): State<ApiState>,
    IdPath((activity, sku)): IdPath<(String, String)>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let started = Instant::now();
    let (result, resp) = match reserve_inner(&s, &activity, &sku, &headers, body).await {
        Ok((label, resp)) => (label, resp),
        Err(e) => (e.code, e.into_response()),
    };
    metrics::counter!("reservation_total", "result" => result).increment(1);
    metrics::histogram!("http_request_duration_seconds", "route" => "reserve")
        .record(started.elapsed().as_secs_f64());
    resp
}

/// The ORDER_CREATE_REQUESTED event of a fresh reservation (first send, from the API).
pub fn reservation_event(
    a: &ReserveArgs<'_>,
    quantity: i32,
    valid_until_ms: i64,
    trace: TraceContext,
) -> OrderCreateRequested {
    let reserved_at = Utc
        .timestamp_millis_opt(a.now_ms)
        .single()
        .unwrap_or_else(Utc::now);
    OrderCreateRequested {
        schema_version: SCHEMA_VERSION,
        event_type: EVENT_ORDER_CREATE_REQUESTED.to_string(),
        message_id: a.message_id.to_owned(),
        message_key: a.reservation_id.to_owned(),
        request_id: a.request_id.to_owned(),
        reservation_id: a.reservation_id.to_owned(),
        order_id: a.order_id.to_owned(),
        activity_id: a.activity_id,
        sku_id: a.sku_id,
        user_id: a.user_id,
        quantity,
        reservation_created_at: reserved_at,
        reservation_valid_until: Utc
            .timestamp_millis_opt(valid_until_ms)
            .single()
            .unwrap_or(reserved_at),
        created_at: Utc::now(),
        retry_count: 0,
        replay_count: 0,
        producer: "seckill-api".to_string(),
        trace,
    }
}

async fn reserve_inner(
    s: &ApiState,
    activity: &str,
    sku: &str,
    headers: &HeaderMap,
    body: Body,
) -> Result<(&'static str, Response), ApiError> {
    let _permit = s.inflight.clone().try_acquire_owned().map_err(|_| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "OVERLOADED",
            "too many requests in flight; retry shortly",
        )
    })?;
    let activity_id = parse_path_id(activity, "activity_id").map_err(ApiError::invalid)?;
    let sku_id = parse_path_id(sku, "sku_id").map_err(ApiError::invalid)?;
    if let Some(reason) = s.admission.paused() {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "SALE_PAUSED",
            format!("new reservations are paused: {reason}"),
        ));
    }
    let max = s.settings.api.max_body_bytes;
    let bytes = to_bytes(body, max)
        .await
        .map_err(|_| ApiError::invalid(ValidationError::TooLarge(max)))?;
    let req = ReserveRequest::parse(&bytes).map_err(ApiError::invalid)?;

    // Ids and trace first: every later retry of this reservation reuses them.
    let ids = Ids::generate();
    let (trace_id, span_id, traceparent) = headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .and_then(|tp| parse_traceparent(tp).map(|(t, sp)| (t, sp, tp.trim().to_string())))
        .unwrap_or_else(new_traceparent);
    let now = Utc::now();
    let now_ms = now.timestamp_millis();
    let api = &s.settings.api;
    let send_timeout = s.settings.mq.send_timeout_ms;
    // The scanner must not pick the reservation up while this request is still sending it.
    let next_retry_at_ms = now_ms + (send_timeout + api.resend_backoff_ms) as i64;

    let args = ReserveArgs {
        activity_id,
        sku_id,
        user_id: req.user_id,
        request_id: &req.request_id,
        reservation_id: &ids.reservation_id,
        message_id: &ids.message_id,
        order_id: &ids.order_id,
        now_ms,
        next_retry_at_ms,
        traceparent: &traceparent,
        valid_secs: api.reservation_valid_secs,
    };
    let result = s
        .redis
        .reserve(&args)
        .await
        .map_err(|e| {
            warn!(error = %e, request_id = %req.request_id, user_id = req.user_id, "reserve script failed");
            ApiError::unavailable("the reservation store")
        })?;
    let view = match result {
        ReserveResult::Reserved(v) => v,
        ReserveResult::Duplicate(v) => {
            return Ok((
                "duplicate_request",
                (StatusCode::ACCEPTED, Json(queued_body(&v, true))).into_response(),
            ))
        }
        ReserveResult::AlreadyPurchased { .. } => {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "ALREADY_PURCHASED",
                "this buyer already holds a reservation for this SKU",
            ))
        }
        ReserveResult::RequestIdReused { sku_id: first, .. } => {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "REQUEST_ID_REUSED",
                format!(
                    "this buyer already used this request_id for SKU {first} of the activity; \
                     a new purchase needs a new request_id"
                ),
            ))
        }
        ReserveResult::SoldOut => {
            return Err(ApiError::new(StatusCode::GONE, "SOLD_OUT", "sold out"))
        }
        ReserveResult::NotStarted => {
            return Err(ApiError::new(
                StatusCode::TOO_EARLY,
                "NOT_STARTED",
                "the sale has not started",
            ))
        }
        ReserveResult::Ended => {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "ENDED",
                "the sale has ended",
            ))
        }
        ReserveResult::Paused => {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "SALE_PAUSED",
                "the sale is paused by an operator",
            ))
        }
        ReserveResult::NotFound => {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "ACTIVITY_NOT_FOUND",
                "no such activity or SKU",
            ))
        }
    };

    // Injection point of §29.3: the process dies after the reservation, before the send
    // (`FAILPOINTS=api-after-reserve-before-send=return` aborts like a SIGKILL).
    fail::fail_point!("api-after-reserve-before-send", |_| std::process::abort());

    let event = reservation_event(
        &args,
        req.quantity,
        view.valid_until_ms,
        TraceContext {
            trace_id: trace_id.clone(),
            span_id,
            traceparent: traceparent.clone(),
        },
    );
    let msg = order_create_message(&s.names.order_create_topic, &event);
    let topic = s.names.order_create_topic.clone();
    let send_started = Instant::now();
    let location_ttl = api.reservation_valid_secs + crate::redis::RESERVATION_TTL_MARGIN_SECS;
    let (outcome, location) = tokio::join!(
        s.publisher.send(msg, send_timeout),
        s.redis
            .set_location(&ids.reservation_id, activity_id, location_ttl)
    );
    let send_latency = send_started.elapsed();
    metrics::counter!("mq_publish_total", "topic" => "order_create", "outcome" => outcome.label())
        .increment(1);
    metrics::histogram!("mq_publish_latency_seconds", "topic" => "order_create")
        .record(send_latency.as_secs_f64());
    if let Err(e) = location {
        // Only lookups by id need it; the GET falls back to PostgreSQL once the order exists.
        warn!(reservation_id = %ids.reservation_id, error = %e, "could not record reservation location");
    }
    let done_ms = Utc::now().timestamp_millis();
    match &outcome {
        SendOutcome::Confirmed { broker_msg_id } => {
            // Injection point of §29.3: the broker stored the message, the process dies before
            // recording it (`api-after-send-before-mark=return` aborts like a SIGKILL).
            fail::fail_point!("api-after-send-before-mark", |_| std::process::abort());
            let cas = s
                .redis
                .mark_sent(
                    activity_id,
                    &ids.reservation_id,
                    &ids.message_id,
                    broker_msg_id,
                    done_ms,
                )
                .await;
            // A failed CAS is harmless: the scanner re-sends with the same message_id and the
            // consumer's inbox absorbs the duplicate.
            if let Err(e) = &cas {
                warn!(reservation_id = %ids.reservation_id, message_id = %ids.message_id, error = %e,
                      "mark MQ_SENT failed; the scanner will re-send");
            }
            debug!(
                message_id = %ids.message_id, reservation_id = %ids.reservation_id,
                order_id = %ids.order_id, request_id = %req.request_id, user_id = req.user_id,
                activity_id, sku_id, topic = %topic, tag = TAG_CREATE_ORDER, send_attempt = 1,
                send_outcome = "CONFIRMED", broker_message_id = %broker_msg_id,
                send_latency_ms = send_latency.as_secs_f64() * 1000.0, trace_id = %trace_id,
                "reservation queued"
            );
            Ok((
                "queued",
                (StatusCode::ACCEPTED, Json(queued_body(&view, false))).into_response(),
            ))
        }
        SendOutcome::Unknown { error } => {
            metrics::counter!("mq_publish_unknown_total", "topic" => "order_create").increment(1);
            let next = done_ms + api.resend_backoff_ms as i64;
            if let Err(e) = s
                .redis
                .schedule_resend(
                    activity_id,
                    &ids.reservation_id,
                    &ids.message_id,
                    next,
                    error,
                )
                .await
            {
                // The reservation still sits in the pending index with its first retry time.
                warn!(reservation_id = %ids.reservation_id, error = %e, "schedule re-send failed");
            }
            info!(
                message_id = %ids.message_id, reservation_id = %ids.reservation_id,
                order_id = %ids.order_id, request_id = %req.request_id, user_id = req.user_id,
                activity_id, sku_id, topic = %topic, send_attempt = 1, send_outcome = "UNKNOWN",
                error_class = "send_unknown", error = %error, trace_id = %trace_id,
                send_latency_ms = send_latency.as_secs_f64() * 1000.0,
                "send result unknown; reservation kept MQ_PENDING for re-send"
            );
            Ok((
                "queued_unknown",
                (StatusCode::ACCEPTED, Json(queued_body(&view, false))).into_response(),
            ))
        }
        SendOutcome::DefiniteFailure { error } => {
            let released = s
                .redis
                .mark_failed(
                    activity_id,
                    sku_id,
                    &ids.reservation_id,
                    &ids.message_id,
                    error,
                    done_ms,
                )
                .await;
            tracing::error!(
                message_id = %ids.message_id, reservation_id = %ids.reservation_id,
                order_id = %ids.order_id, request_id = %req.request_id, user_id = req.user_id,
                activity_id, sku_id, topic = %topic, send_attempt = 1,
                send_outcome = "DEFINITE_FAILURE", error_class = "send_definite_failure",
                error = %error, release = ?released.as_ref().ok(), trace_id = %trace_id,
                "order queue refused the message; reservation released"
            );
            Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "ORDER_QUEUE_UNAVAILABLE",
                "the order queue refused the request; nothing was reserved, retry later",
            ))
        }
    }
}

/// A path id this system minted (`rsv_<ULID>`, `ord_<ULID>`), or a 400.
fn require_id(prefix: &str, name: &str, id: &str) -> Result<(), ApiError> {
    if is_valid_id(prefix, id) {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "INVALID_REQUEST",
            format!("{name} must look like {prefix}_<ULID>"),
        ))
    }
}

async fn get_reservation(
    State(s): State<ApiState>,
    IdPath(reservation_id): IdPath<String>,
) -> Result<Response, ApiError> {
    require_id("rsv", "reservation_id", &reservation_id)?;
    // The projection answers most polls without touching PostgreSQL.
    if let Ok(p) = s.redis.projection(&reservation_id).await {
        if let (Some(status), Some(order_id)) = (p.get("status"), p.get("order_id")) {
            return Ok(Json(json!({
                "reservation_id": reservation_id,
                "order_id": order_id,
                "status": status,
                "version": p.get("version").and_then(|v| v.parse::<i64>().ok()),
            }))
            .into_response());
        }
    }
    let client =
        s.pg.get()
            .await
            .map_err(|_| ApiError::unavailable("the order store"))?;
    if let Some(order) = queries::order_by_reservation(&**client, &reservation_id)
        .await
        .map_err(|_| ApiError::unavailable("the order store"))?
    {
        return Ok(Json(json!({
            "reservation_id": reservation_id,
            "order_id": order.order_id,
            "status": order.status,
            "activity_id": order.activity_id,
            "sku_id": order.sku_id,
            "user_id": order.user_id,
        }))
        .into_response());
    }
    if let Some(d) = queries::reservation_decision(&**client, &reservation_id)
        .await
        .map_err(|_| ApiError::unavailable("the order store"))?
    {
        if d.status == "REJECTED" {
            return Ok(Json(json!({
                "reservation_id": d.reservation_id,
                "order_id": d.order_id,
                "status": "REJECTED",
                "reason": d.reject_reason,
                "activity_id": d.activity_id,
                "sku_id": d.sku_id,
                "user_id": d.user_id,
            }))
            .into_response());
        }
    }
    drop(client);
    let activity_id = s
        .redis
        .location(&reservation_id)
        .await
        .map_err(|_| ApiError::unavailable("the reservation store"))?;
    let fields = match activity_id {
        Some(a) => s
            .redis
            .reservation(a, &reservation_id)
            .await
            .map_err(|_| ApiError::unavailable("the reservation store"))?,
        None => Default::default(),
    };
    if fields.is_empty() {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "RESERVATION_NOT_FOUND",
            "no such reservation",
        ));
    }
    let get = |k: &str| fields.get(k).cloned().unwrap_or_default();
    let status = match get("status").as_str() {
        "RESERVED" => "QUEUED",
        "RELEASED" => "RELEASED",
        _ => "UNKNOWN",
    };
    let num = |k: &str| get(k).parse::<i64>().ok();
    Ok(Json(json!({
        "reservation_id": reservation_id,
        "order_id": get("order_id"),
        "status": status,
        "mq_status": get("mq_status"),
        "activity_id": num("activity_id"),
        "sku_id": num("sku_id"),
        "user_id": num("user_id"),
        "valid_until": num("valid_until").and_then(|ms| Utc.timestamp_millis_opt(ms).single()),
    }))
    .into_response())
}

async fn get_order(
    State(s): State<ApiState>,
    IdPath(order_id): IdPath<String>,
) -> Result<Response, ApiError> {
    require_id("ord", "order_id", &order_id)?;
    let client =
        s.pg.get()
            .await
            .map_err(|_| ApiError::unavailable("the order store"))?;
    match queries::order_by_id(&**client, &order_id)
        .await
        .map_err(|_| ApiError::unavailable("the order store"))?
    {
        Some(order) => Ok(Json(order).into_response()),
        None => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "ORDER_NOT_FOUND",
            "no such order (it may still be queued: see its reservation)",
        )),
    }
}

async fn pay_order(
    State(s): State<ApiState>,
    IdPath(order_id): IdPath<String>,
    body: Body,
) -> Result<Response, ApiError> {
    use crate::pg::order_state::{pay, PayOutcome, StateNames};
    require_id("ord", "order_id", &order_id)?;
    let max = s.settings.api.max_body_bytes;
    let bytes = to_bytes(body, max)
        .await
        .map_err(|_| ApiError::invalid(ValidationError::TooLarge(max)))?;
    let v: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::invalid(ValidationError::Json(e.to_string())))?;
    let payment_id = match v.get("payment_id") {
        Some(serde_json::Value::String(p))
            if !p.is_empty()
                && p.len() <= 64
                && p.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b)) =>
        {
            p.clone()
        }
        Some(_) => {
            return Err(ApiError::invalid(ValidationError::Field {
                field: "payment_id",
                reason: "must be 1-64 characters of A-Z a-z 0-9 - _ . :",
            }))
        }
        None => return Err(ApiError::invalid(ValidationError::Missing("payment_id"))),
    };
    let names = StateNames {
        order_event_topic: s.names.order_event_topic.clone(),
        compensate_topic: s.names.compensate_topic.clone(),
    };
    let mut client =
        s.pg.get()
            .await
            .map_err(|_| ApiError::unavailable("the order store"))?;
    let outcome = pay(&mut client, &order_id, &payment_id, &names)
        .await
        .map_err(|e| {
            warn!(order_id = %order_id, error = %e, "payment transaction failed");
            ApiError::unavailable("the order store")
        })?;
    metrics::counter!("order_pay_total", "result" => match &outcome {
        PayOutcome::Paid { .. } => "paid",
        PayOutcome::AlreadyPaidSame => "repeat",
        PayOutcome::AlreadyPaidOther => "paid_other",
        PayOutcome::Canceled => "canceled",
        PayOutcome::Expired => "expired",
        PayOutcome::NotFound => "not_found",
    })
    .increment(1);
    let paid = |repeat: bool| {
        Json(json!({"order_id": order_id, "status": "PAID", "payment_id": payment_id, "repeat": repeat}))
            .into_response()
    };
    match outcome {
        PayOutcome::Paid { .. } => {
            info!(order_id = %order_id, payment_id = %payment_id, "order paid");
            Ok(paid(false))
        }
        PayOutcome::AlreadyPaidSame => Ok(paid(true)),
        PayOutcome::AlreadyPaidOther => Err(ApiError::new(
            StatusCode::CONFLICT,
            "ALREADY_PAID",
            "the order was paid with another payment",
        )),
        PayOutcome::Canceled => Err(ApiError::new(
            StatusCode::CONFLICT,
            "ORDER_CANCELED",
            "the order was cancelled; the payment must be refunded",
        )),
        PayOutcome::Expired => Err(ApiError::new(
            StatusCode::CONFLICT,
            "ORDER_EXPIRED",
            "the payment window has closed",
        )),
        PayOutcome::NotFound => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "ORDER_NOT_FOUND",
            "no such order",
        )),
    }
}

/// Builds the state from settings: Redis, PostgreSQL (reads) and the publisher.
pub async fn build_state(
    settings: Arc<Settings>,
    publisher: Arc<dyn Publisher>,
) -> anyhow::Result<ApiState> {
    let redis = RedisStore::connect(&settings.redis).await?;
    let pg = crate::pg::connect_pool(&settings.pg, settings.pg.api_pool_size).await?;
    Ok(ApiState {
        names: Arc::new(settings.names()),
        inflight: Arc::new(Semaphore::new(settings.api.max_inflight)),
        settings,
        redis,
        pg,
        publisher,
        ready: Readiness::default(),
        admission: Default::default(),
        lag: None,
    })
}

/// Serves until `shutdown` fires, then stops accepting and drains in-flight requests
/// (bounded by `api.shutdown_grace_secs`).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: ApiState,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let grace = Duration::from_secs(state.settings.api.shutdown_grace_secs);
    let api = &state.settings.api;
    let bound = Duration::from_secs_f64(api.reservation_valid_secs as f64 * api.fail_closed_share);
    tokio::spawn(crate::roles::admission::run_checker(
        state.admission.clone(),
        state.redis.clone(),
        state.lag.clone(),
        bound,
        Duration::from_millis(api.admission_check_ms),
        shutdown.clone(),
    ));
    state.ready.set(true);
    let ready = state.ready.clone();
    let app = router(state);
    let stop = shutdown.clone();
    let server = axum::serve(listener, app).with_graceful_shutdown(async move {
        stop.cancelled().await;
        ready.set(false);
    });
    let mut server = std::pin::pin!(server.into_future());
    tokio::select! {
        r = &mut server => return r.map_err(Into::into),
        _ = shutdown.cancelled() => {}
    }
    match tokio::time::timeout(grace, server).await {
        Ok(r) => r.map_err(Into::into),
        Err(_) => {
            warn!(
                grace_secs = grace.as_secs(),
                "shutdown grace elapsed with requests in flight"
            );
            Ok(())
        }
    }
}

/// `seckill api`.
pub async fn run(settings: Settings) -> anyhow::Result<()> {
    let settings = Arc::new(settings);
    let mq = crate::mq::hot_path_publisher(&settings).await?;
    let mut state = build_state(settings.clone(), mq).await?;
    let names = settings.names();
    state.lag = Some(crate::roles::admission::LagSource {
        probe: Arc::new(
            crate::mq::rocketmq::LagProbe::new(&crate::mq::runtime()?, &settings.mq.name_server)
                .await?,
        ),
        group: names.order_create_group,
        topic: names.order_create_topic,
    });
    let addr = settings.api.listen;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("api.listen: cannot bind {addr}: {e}"))?;
    info!(%addr, topic = %state.names.order_create_topic, "api listening");
    let shutdown = CancellationToken::new();
    let trigger = shutdown.clone();
    tokio::spawn(async move {
        crate::telemetry::shutdown_signal().await;
        info!("shutdown signal: draining in-flight requests");
        trigger.cancel();
    });
    serve(listener, state, shutdown).await?;
    info!("api stopped");
    Ok(())
}
