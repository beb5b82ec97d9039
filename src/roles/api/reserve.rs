//! The reservation route: parse → admit → reserve in Redis → send ORDER_CREATE_REQUESTED and
//! record the send's outcome (docs/architecture/hot-path.md#the-hot-path).

use crate::domain::status::HoldStatus;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use chrono::{TimeZone, Utc};
use tracing::{debug, info, warn};

use super::bodies::Queued;
use super::error::ApiError;
use super::limits;
use super::request::IdPath;
use super::state::ApiState;
use crate::domain::ids::{new_traceparent, parse_traceparent};
use crate::domain::order_create::TAG_CREATE_ORDER;
use crate::domain::order_create::{ReservationFacts, ReservationRef};
use crate::domain::request::parse_path_id;
use crate::domain::{Ids, OrderCreateRequested, ReserveRequest, TraceContext};
use crate::http::PeerAddr;
use crate::mq::{order_create_message, SendOutcome};
use crate::redis::{RateLimits, ReservationView, ReserveArgs, ReserveResult, SentMark, Shard};

fn queued_body(v: &ReservationView, duplicate: bool) -> Queued<'_> {
    Queued {
        status: "QUEUED",
        reservation_id: &v.reservation_id,
        order_id: &v.order_id,
        valid_until: Utc.timestamp_millis_opt(v.valid_until_ms).single(),
        duplicate,
    }
}

pub(super) async fn reserve(
    State(s): State<ApiState>,
    IdPath((activity, sku)): IdPath<(String, String)>,
    peer: Option<Extension<PeerAddr>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let started = Instant::now();
    let peer = peer.map(|Extension(PeerAddr(p))| p);
    let (result, resp) = match reserve_inner(&s, &activity, &sku, peer, &headers, body).await {
        Ok((label, resp)) => (label, resp),
        Err(e) => (e.code, e.into_response()),
    };
    metrics::counter!("reservation_total", "result" => result).increment(1);
    metrics::histogram!("http_request_duration_seconds", "route" => "reserve")
        .record(started.elapsed().as_secs_f64());
    resp
}

/// The ORDER_CREATE_REQUESTED event of a fresh reservation (first send, from the API), in
/// schema `schema` (`mq.order_event_schema`).
pub fn reservation_event(
    a: &ReserveArgs<'_>,
    quantity: i32,
    valid_until_ms: i64,
    schema: i32,
    trace: TraceContext,
) -> OrderCreateRequested {
    let reserved_at = Utc
        .timestamp_millis_opt(a.now_ms)
        .single()
        .unwrap_or_else(Utc::now);
    let facts = ReservationFacts {
        reservation: a.reservation,
        quantity,
        created_at: reserved_at,
        valid_until: Utc
            .timestamp_millis_opt(valid_until_ms)
            .single()
            .unwrap_or(reserved_at),
        channel: Some(a.channel).filter(|c| !c.is_empty()),
    };
    OrderCreateRequested::new(&facts, schema, "seckill-api", 0, trace)
}

async fn reserve_inner(
    s: &ApiState,
    activity: &str,
    sku: &str,
    peer: Option<std::net::SocketAddr>,
    headers: &HeaderMap,
    body: Body,
) -> Result<(&'static str, Response), ApiError> {
    let arrived = Instant::now();
    let activity_id = parse_path_id(activity, "activity_id").map_err(ApiError::invalid)?;
    let sku_id = parse_path_id(sku, "sku_id").map_err(ApiError::invalid)?;
    let api = &s.settings.api;
    // Who is asking, before anything is read or written: a forged, expired or missing token
    // costs one signature check and nothing else.
    let token_buyer = s.buyer(headers).await?;
    // The abuse limits' buckets are taken by the reserve script itself, in the same call.
    let client_addr = limits::client_addr(peer, headers, &api.trusted_proxies)
        .map(|a| a.to_string())
        .unwrap_or_default();
    admit(s, activity_id)?;
    let req = read_request(s, body).await?;
    let user_id = super::request::the_buyer(token_buyer, req.user_id)?;
    let pass_id = super::passes::sale_pass(s, headers, activity_id, user_id).await?;
    // The stock bucket the buyer reserves in (docs/architecture/redis.md#stock-buckets): the
    // activity's count of buckets is read once per process.
    let shard = s
        .redis
        .home_shard(activity_id, user_id)
        .await
        .map_err(|e| {
            warn!(error = %e, activity_id, user_id, "stock buckets not read");
            ApiError::unavailable("the reservation store")
        })?;
    // A SKU known sold out (in the buyer's bucket) is answered from memory, unless the buyer
    // is one of its winners (docs/architecture/hot-path.md#sold-out-from-memory).
    if api.sold_out_poll_ms > 0 && s.sold_out.answers(shard, sku_id, user_id) {
        metrics::counter!("reservation_sold_out_from_memory_total").increment(1);
        return Err(ApiError::from(ReserveResult::SoldOut));
    }
    let _permit = inflight_permit(s)?;
    // Ids and trace first: every later retry of this reservation reuses them.
    let ids = Ids::generate(activity_id, shard.bucket);
    let trace = trace_context(headers);
    let args = ReserveArgs {
        pass_id: &pass_id,
        ..reserve_args(
            s,
            &ids,
            &req,
            (activity_id, sku_id, user_id),
            &client_addr,
            &trace,
        )
    };
    let mut result = reserve_in_redis(s, &args).await?;
    if in_draw(&result) {
        match super::draw_hold::hold(s, shard, &args, arrived, result).await? {
            super::draw_hold::Drawn::Won(v) => {
                return send_won(s, &args, req.quantity, &v, &trace).await
            }
            super::draw_hold::Drawn::Other(r) => result = r,
        }
    }
    let view = match result {
        ReserveResult::Reserved(v) => v,
        ReserveResult::Duplicate(v) => {
            return Ok((
                "duplicate_request",
                (StatusCode::ACCEPTED, Json(queued_body(&v, true))).into_response(),
            ))
        }
        ReserveResult::Lost { signal, reason } => {
            lost(s, activity_id, signal, &reason).await;
            return Err(ApiError::from(ReserveResult::Lost { signal, reason }));
        }
        refused => return Err(refusal(s, shard, sku_id, refused)),
    };
    send_and_record(s, &args, req.quantity, &view, &trace).await
}

/// One of the requests in flight. Taken once the body is in: a client that stalls mid-body
/// holds a connection (bounded by the listener's limits), never one of the permits real buyers
/// need.
fn inflight_permit(s: &ApiState) -> Result<tokio::sync::OwnedSemaphorePermit, ApiError> {
    s.inflight.clone().try_acquire_owned().map_err(|_| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "OVERLOADED",
            "too many requests in flight; retry shortly",
        )
    })
}

/// Whether the request is in its activity's draw (entered, being drawn, or drawn and lost).
fn in_draw(r: &ReserveResult) -> bool {
    match r {
        ReserveResult::Draw(_) | ReserveResult::Drawing { .. } => true,
        ReserveResult::Duplicate(v) => matches!(
            v.status.parse(),
            Ok(HoldStatus::DrawPending | HoldStatus::DrawLost)
        ),
        _ => false,
    }
}

/// The first send of a reservation the draw gave this request: its own ids (minted when the
/// request entered, maybe by an earlier attempt), reserved when the draw made it.
async fn send_won(
    s: &ApiState,
    args: &ReserveArgs<'_>,
    quantity: i32,
    v: &ReservationView,
    trace: &TraceContext,
) -> Result<(&'static str, Response), ApiError> {
    let won = ReserveArgs {
        reservation: ReservationRef {
            message_id: &v.message_id,
            reservation_id: &v.reservation_id,
            order_id: &v.order_id,
            ..args.reservation
        },
        now_ms: v.created_at_ms,
        ..args.clone()
    };
    send_and_record(s, &won, quantity, v, trace).await
}

/// Redis answered behind what this process saw it answer: the activity is fenced until its
/// rebuild (docs/architecture/redis.md#when-redis-forgets). A fence that cannot be recorded is
/// logged; the shard's own mark, set by the script, still refuses every reservation.
async fn lost(s: &ApiState, activity_id: i64, signal: &'static str, reason: &str) {
    let by = crate::services::resync::actor("api");
    if let Err(e) =
        crate::services::resync::raise(&s.pg, &s.redis, activity_id, signal, reason, &by).await
    {
        warn!(activity_id, error = %format!("{e:#}"), "fence not recorded; the scanner records it from Redis");
    }
}

/// What the reservation script is asked, with the ids minted before it runs.
fn reserve_args<'a>(
    s: &ApiState,
    ids: &'a Ids,
    req: &'a ReserveRequest,
    (activity_id, sku_id, user_id): (i64, i64, i64),
    client_addr: &'a str,
    trace: &'a TraceContext,
) -> ReserveArgs<'a> {
    let api = &s.settings.api;
    let now_ms = Utc::now().timestamp_millis();
    // The scanner must not pick the reservation up while this request is still sending it.
    let next_retry_at_ms = now_ms + (s.settings.mq.send_timeout_ms + api.resend_backoff_ms) as i64;
    ReserveArgs {
        reservation: ReservationRef {
            message_id: &ids.message_id,
            request_id: &req.request_id,
            reservation_id: &ids.reservation_id,
            order_id: &ids.order_id,
            activity_id,
            sku_id,
            user_id,
        },
        now_ms,
        next_retry_at_ms,
        traceparent: &trace.traceparent,
        valid_secs: api.reservation_valid_secs,
        limits: RateLimits {
            client_addr,
            address_rate_per_sec: api.address_rate_per_sec,
            address_burst: api.address_burst,
            buyer_rate_per_sec: api.buyer_rate_per_sec,
            buyer_burst: api.buyer_burst,
        },
        channel: req.channel.as_deref().unwrap_or_default(),
        pass_id: "",
    }
}

/// The answer to a reservation the script refused, counted; a sold-out answer is remembered
/// for the buyer's bucket.
fn refusal(s: &ApiState, shard: Shard, sku_id: i64, refused: ReserveResult) -> ApiError {
    match refused {
        ReserveResult::RateLimited { by, retry_ms } => {
            metrics::counter!("rate_limited_total", "by" => if by == "ip" { "ip" } else { "u" })
                .increment(1);
            ApiError::from(ReserveResult::RateLimited { by, retry_ms })
        }
        ReserveResult::SoldOut => {
            if s.settings.api.sold_out_poll_ms > 0 {
                s.sold_out.note(shard, sku_id);
            }
            ApiError::from(ReserveResult::SoldOut)
        }
        refused => ApiError::from(refused),
    }
}

/// A sale the fail-closed check has paused (the whole API, or this activity) takes no new
/// reservation, and one resuming takes only its ramp's share.
fn admit(s: &ApiState, activity_id: i64) -> Result<(), ApiError> {
    match s.admission.refusal(activity_id) {
        Some(reason) => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "SALE_PAUSED",
            format!("new reservations are paused: {reason}"),
        )),
        None => Ok(()),
    }
}

/// The body, bounded by `api.max_body_bytes`, parsed and validated.
async fn read_request(s: &ApiState, body: Body) -> Result<ReserveRequest, ApiError> {
    let bytes = super::request::read_body(s, body).await?;
    ReserveRequest::parse(&bytes).map_err(ApiError::invalid)
}

/// The caller's `traceparent` when it is valid, a fresh one otherwise.
fn trace_context(headers: &HeaderMap) -> TraceContext {
    let (trace_id, span_id, traceparent) = headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .and_then(|tp| parse_traceparent(tp).map(|(t, sp)| (t, sp, tp.trim().to_string())))
        .unwrap_or_else(new_traceparent);
    TraceContext {
        trace_id,
        span_id,
        traceparent,
    }
}

/// The reserve script; a Redis failure is a 503 that loses nothing (the buyer retries with the
/// same request_id).
async fn reserve_in_redis(s: &ApiState, args: &ReserveArgs<'_>) -> Result<ReserveResult, ApiError> {
    s.redis.intake().reserve(args).await.map_err(|e| {
        warn!(error = %e, request_id = %args.reservation.request_id, user_id = args.reservation.user_id, "reserve script failed");
        ApiError::unavailable("the reservation store")
    })
}

/// Sends the reservation's ORDER_CREATE_REQUESTED (bounded) and records the outcome in Redis:
/// CONFIRMED → MQ_SENT, UNKNOWN → a re-send scheduled, DEFINITE_FAILURE → released.
async fn send_and_record(
    s: &ApiState,
    args: &ReserveArgs<'_>,
    quantity: i32,
    view: &ReservationView,
    trace: &TraceContext,
) -> Result<(&'static str, Response), ApiError> {
    // Fault-injection point: the process dies after the reservation, before the send
    // (`FAILPOINTS=api-after-reserve-before-send=return` aborts like a SIGKILL).
    fail::fail_point!("api-after-reserve-before-send", |_| std::process::abort());

    let trace_id = trace.trace_id.clone();
    let schema = s.settings.mq.order_event_schema;
    let event = reservation_event(args, quantity, view.valid_until_ms, schema, trace.clone());
    let msg = order_create_message(&s.names.order_create_topic, &event);
    let send_timeout = s.settings.mq.send_timeout_ms;
    let send_started = Instant::now();
    let outcome = s.publisher.send(msg, send_timeout).await;
    let sent = Sent {
        latency: send_started.elapsed(),
        done_ms: Utc::now().timestamp_millis(),
        trace_id,
    };
    metrics::counter!("mq_publish_total", "topic" => "order_create", "outcome" => outcome.label())
        .increment(1);
    metrics::histogram!("mq_publish_latency_seconds", "topic" => "order_create")
        .record(sent.latency.as_secs_f64());
    match &outcome {
        SendOutcome::Confirmed { broker_msg_id } => {
            s.admission.note_sent();
            record_confirmed(s, &args.reservation, broker_msg_id, &sent).await;
            Ok((
                "queued",
                (StatusCode::ACCEPTED, Json(queued_body(view, false))).into_response(),
            ))
        }
        SendOutcome::Unknown { error } => {
            record_unknown(s, &args.reservation, error, &sent).await;
            Ok((
                "queued_unknown",
                (StatusCode::ACCEPTED, Json(queued_body(view, false))).into_response(),
            ))
        }
        SendOutcome::DefiniteFailure { error } => {
            if record_definite_failure(s, &args.reservation, error, &sent).await {
                return Err(ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "ORDER_QUEUE_UNAVAILABLE",
                    "the order queue refused the request; nothing was reserved, retry later",
                ));
            }
            // A scanner re-sent it meanwhile and that copy's fate is unknown: the reservation
            // is kept, as for an unknown outcome.
            Ok((
                "queued_unknown",
                (StatusCode::ACCEPTED, Json(queued_body(view, false))).into_response(),
            ))
        }
    }
}

/// What the first send of a reservation took, for its log line.
struct Sent {
    latency: Duration,
    done_ms: i64,
    trace_id: String,
}

/// The broker stored the message: MQ_PENDING → MQ_SENT. A failed CAS is harmless: the scanner
/// re-sends with the same message_id and the consumer's inbox absorbs the duplicate.
async fn record_confirmed(s: &ApiState, r: &ReservationRef<'_>, broker_msg_id: &str, sent: &Sent) {
    // Fault-injection point: the broker stored the message, the process dies before recording
    // it (`api-after-send-before-mark=return` aborts like a SIGKILL).
    fail::fail_point!("api-after-send-before-mark", |_| std::process::abort());
    let mark = SentMark {
        activity_id: r.activity_id,
        reservation_id: r.reservation_id.to_owned(),
        message_id: r.message_id.to_owned(),
        broker_msg_id: broker_msg_id.to_owned(),
        sent_at_ms: sent.done_ms,
    };
    let error = match s.sent_marks.submit(vec![mark]).await {
        Some(mut verdicts) => verdicts.pop().and_then(Result::err),
        None => Some("the batch that carried it ended without an answer".to_owned()),
    };
    if let Some(e) = error {
        warn!(reservation_id = %r.reservation_id, message_id = %r.message_id, error = %e,
              "mark MQ_SENT failed; the scanner will re-send");
    }
    debug!(
        message_id = %r.message_id, reservation_id = %r.reservation_id,
        order_id = %r.order_id, request_id = %r.request_id, user_id = r.user_id,
        activity_id = r.activity_id, sku_id = r.sku_id, topic = %s.names.order_create_topic,
        tag = TAG_CREATE_ORDER, send_attempt = 1,
        send_outcome = "CONFIRMED", broker_message_id = %broker_msg_id,
        send_latency_ms = sent.latency.as_secs_f64() * 1000.0, trace_id = %sent.trace_id,
        "reservation queued"
    );
}

/// The broker may or may not have stored it: the reservation stays MQ_PENDING with a re-send
/// scheduled, and its unit is never given back on this path.
async fn record_unknown(s: &ApiState, r: &ReservationRef<'_>, error: &str, sent: &Sent) {
    metrics::counter!("mq_publish_unknown_total", "topic" => "order_create").increment(1);
    let next = sent.done_ms + s.settings.api.resend_backoff_ms as i64;
    if let Err(e) = s
        .redis
        .sends()
        .schedule_resend(r.activity_id, r.reservation_id, r.message_id, next, error)
        .await
    {
        // The reservation still sits in the pending index with its first retry time.
        warn!(reservation_id = %r.reservation_id, error = %e, "schedule re-send failed");
    }
    info!(
        message_id = %r.message_id, reservation_id = %r.reservation_id,
        order_id = %r.order_id, request_id = %r.request_id, user_id = r.user_id,
        activity_id = r.activity_id, sku_id = r.sku_id, topic = %s.names.order_create_topic,
        send_attempt = 1, send_outcome = "UNKNOWN",
        error_class = "send_unknown", error = %error, trace_id = %sent.trace_id,
        send_latency_ms = sent.latency.as_secs_f64() * 1000.0,
        "send result unknown; reservation kept MQ_PENDING for re-send"
    );
}

/// The broker refused the message for good: MQ_FAILED and the reservation released once.
/// `false` when it was not released: a scanner's re-send of the same reservation is in
/// flight or ended UNKNOWN, so a copy may be stored
/// (docs/architecture/hot-path.md#uncertain-sends); or Redis could not be asked, and the
/// reservation stays pending for the scanner.
async fn record_definite_failure(
    s: &ApiState,
    r: &ReservationRef<'_>,
    error: &str,
    sent: &Sent,
) -> bool {
    let verdict = s
        .redis
        .sends()
        .mark_failed(
            r.activity_id,
            r.sku_id,
            r.reservation_id,
            r.message_id,
            error,
            sent.done_ms,
        )
        .await;
    let released = verdict
        .as_deref()
        .is_ok_and(|v| v == HoldStatus::Released.as_str());
    tracing::error!(
        message_id = %r.message_id, reservation_id = %r.reservation_id,
        order_id = %r.order_id, request_id = %r.request_id, user_id = r.user_id,
        activity_id = r.activity_id, sku_id = r.sku_id, topic = %s.names.order_create_topic,
        send_attempt = 1, send_outcome = "DEFINITE_FAILURE",
        error_class = "send_definite_failure",
        error = %error, release = ?verdict.as_ref().ok(), trace_id = %sent.trace_id,
        "order queue refused the message; reservation {}",
        if released { "released" } else { "kept for the scanner" }
    );
    released
}
