//! The admin listener (`api.admin_listen`, docs/architecture/security.md#admin-surface): sale
//! status, pause and resume (per activity or SKU), the requeue of DEAD outbox rows, and the refunds
//! owed (`admin_refunds`). Every route needs `Authorization: Bearer <api.admin_token>` (compared in
//! constant time, never logged); every action writes an `admin_audit` row. It listens apart from
//! the buyers, so a load balancer never exposes it.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use tracing::{info, warn};

use std::time::Instant;

use super::admin_guard::{AdminGuard, Admission, Verdict};
use super::error::ApiError;
use super::request::{admin_actor as actor, json_body, IdPath};
use super::state::ApiState;
use crate::domain::request::parse_path_id;
use crate::domain::ValidationError;
use crate::http::PeerAddr;
use crate::pg::{audit, outbox};

/// What the admin routes' gate holds: the API's state and the failed-login throttle.
#[derive(Clone)]
struct Gate {
    state: ApiState,
    guard: AdminGuard,
}

pub fn router(state: ApiState) -> Router {
    let gate = Gate {
        state: state.clone(),
        guard: AdminGuard::default(),
    };
    Router::new()
        .route("/admin/v1/sales/{activity_id}", get(status))
        .route("/admin/v1/sales/{activity_id}/pause", post(pause))
        .route("/admin/v1/sales/{activity_id}/resume", post(resume))
        .route("/admin/v1/outbox/requeue", post(requeue))
        .route("/admin/v1/refunds", get(super::admin_refunds::list))
        .route(
            "/admin/v1/refunds/{payment_id}/refunded",
            post(super::admin_refunds::mark_refunded),
        )
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "NOT_FOUND", "no such route") })
        .layer(axum::middleware::from_fn_with_state(gate, require_admin))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(state)
}

/// Refuses any call without the admin token (401, nothing done, the token never logged), and
/// throttles an address that keeps trying (`super::admin_guard`).
async fn require_admin(State(gate): State<Gate>, req: Request, next: Next) -> Response {
    let ip = req
        .extensions()
        .get::<PeerAddr>()
        .map_or(std::net::IpAddr::from([0, 0, 0, 0]), |p| p.0.ip());
    let mut attempt = match gate.guard.admit(ip, Instant::now()) {
        Admission::Compare(attempt) => attempt,
        Admission::Busy => return auth_failure("busy", throttled(1)),
    };
    let header = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    if crate::auth::admin_token_matches(&gate.state.settings.api.admin_token, header) {
        gate.guard.succeeded(&attempt);
        drop(attempt);
        return next.run(req).await;
    }
    match gate.guard.failed(&mut attempt, Instant::now()) {
        Verdict::Refused => auth_failure(
            "refused",
            ApiError::new(
                StatusCode::UNAUTHORIZED,
                "UNAUTHENTICATED",
                "the admin token is required (Authorization: Bearer <api.admin_token>)",
            ),
        ),
        Verdict::Tarpit(delay) => match gate.guard.tarpit_slot() {
            Some(slot) => {
                tokio::time::sleep(delay).await;
                drop((slot, attempt));
                auth_failure("tarpit", throttled(delay.as_secs().max(1)))
            }
            None => auth_failure("throttled", throttled(1)),
        },
    }
}

/// A failed login's answer, counted by how it was answered.
fn auth_failure(result: &'static str, e: ApiError) -> Response {
    metrics::counter!("admin_auth_failures_total", "result" => result).increment(1);
    e.into_response()
}

fn throttled(retry_after_secs: u64) -> ApiError {
    ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        "RATE_LIMITED",
        "too many failed admin logins from this address; retry later, one at a time",
    )
    .retry_after(retry_after_secs)
}

async fn audit_row(
    s: &ApiState,
    actor: &str,
    action: &str,
    target: &str,
    detail: &Value,
) -> Result<(), ApiError> {
    s.bounded_pg(async |client| {
        audit::record(&***client, actor, action, target, detail)
            .await
            .map_err(|e| {
                warn!(error = %e, action, target, "audit row not written; action refused");
                ApiError::unavailable("the order store")
            })
    })
    .await
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PauseBody {
    /// What buyers are told (`503 SALE_PAUSED: <reason>`).
    reason: String,
    /// One SKU only; the whole activity when absent.
    sku_id: Option<i64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ResumeBody {
    sku_id: Option<i64>,
}

fn target(activity_id: i64, sku_id: Option<i64>) -> String {
    match sku_id {
        Some(sku) => format!("activity:{activity_id}/sku:{sku}"),
        None => format!("activity:{activity_id}"),
    }
}

fn activity(raw: &str) -> Result<i64, ApiError> {
    parse_path_id(raw, "activity_id").map_err(ApiError::invalid)
}

/// Pauses or resumes in Redis (every API instance sees it on the next reservation), after the
/// audit row is written: an action that cannot be audited is not taken.
async fn set_paused(
    s: &ApiState,
    actor: &str,
    activity_id: i64,
    sku_id: Option<i64>,
    reason: Option<&str>,
) -> Result<Response, ApiError> {
    if sku_id.is_some_and(|sku| sku <= 0) {
        return Err(ApiError::invalid(ValidationError::Field {
            field: "sku_id",
            reason: "must be a positive integer",
        }));
    }
    let action = if reason.is_some() { "pause" } else { "resume" };
    let t = target(activity_id, sku_id);
    audit_row(s, actor, action, &t, &json!({"reason": reason})).await?;
    let found = s
        .redis
        .stock()
        .set_paused(activity_id, sku_id, reason)
        .await
        .map_err(|_| ApiError::unavailable("the reservation store"))?;
    if !found {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "ACTIVITY_NOT_FOUND",
            "no such activity or SKU in Redis (create or warm it first)",
        ));
    }
    info!(actor, action, target = %t, reason = reason.unwrap_or(""), "sale {action}d by an operator");
    Ok(Json(json!({"target": t, "paused": reason.is_some(), "reason": reason})).into_response())
}

async fn pause(
    State(s): State<ApiState>,
    IdPath(raw): IdPath<String>,
    peer: Option<Extension<PeerAddr>>,
    body: Body,
) -> Result<Response, ApiError> {
    let activity_id = activity(&raw)?;
    let b: PauseBody = json_body(&s, body).await?;
    let reason = b.reason.trim();
    if reason.is_empty() || reason.len() > 200 {
        return Err(ApiError::invalid(ValidationError::Field {
            field: "reason",
            reason: "must be 1-200 characters (buyers are told it)",
        }));
    }
    set_paused(&s, &actor(peer), activity_id, b.sku_id, Some(reason)).await
}

async fn resume(
    State(s): State<ApiState>,
    IdPath(raw): IdPath<String>,
    peer: Option<Extension<PeerAddr>>,
    body: Body,
) -> Result<Response, ApiError> {
    let activity_id = activity(&raw)?;
    let b: ResumeBody = json_body(&s, body).await?;
    set_paused(&s, &actor(peer), activity_id, b.sku_id, None).await
}

/// The sale as operators see it: pauses, stock in Redis, reservations waiting for their order,
/// and the fail-closed admission.
async fn status(
    State(s): State<ApiState>,
    IdPath(raw): IdPath<String>,
) -> Result<Response, ApiError> {
    let activity_id = activity(&raw)?;
    let redis_down = |_| ApiError::unavailable("the reservation store");
    let skus: Vec<i64> = s
        .bounded_pg(async |client| {
            crate::pg::queries::activity_skus(&***client, activity_id)
                .await
                .map_err(|_| ApiError::unavailable("the order store"))
        })
        .await?;
    if skus.is_empty() {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "ACTIVITY_NOT_FOUND",
            "no such activity",
        ));
    }
    let mut out = Vec::with_capacity(skus.len());
    for sku in skus {
        let stock = s
            .redis
            .stock()
            .sku_stock(activity_id, sku)
            .await
            .map_err(redis_down)?;
        let paused = s
            .redis
            .stock()
            .paused(activity_id, Some(sku))
            .await
            .map_err(redis_down)?;
        out.push(json!({
            "sku_id": sku,
            "total": stock.map(|(t, _)| t),
            "remaining": stock.map(|(_, r)| r),
            "paused": paused,
        }));
    }
    Ok(Json(json!({
        "activity_id": activity_id,
        "paused": s.redis.stock().paused(activity_id, None).await.map_err(redis_down)?,
        "skus": out,
        "pending_reservations": s.redis.recovery().pending_count(activity_id).await.map_err(redis_down)?,
        "admission_paused": s.admission.paused(),
        "activity_admission_paused": s.admission.activity_paused(activity_id),
    }))
    .into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RequeueBody {
    /// These DEAD rows...
    event_ids: Option<Vec<String>>,
    /// ...or every DEAD row (one of the two).
    #[serde(default)]
    all_dead: bool,
}

async fn requeue(
    State(s): State<ApiState>,
    peer: Option<Extension<PeerAddr>>,
    body: Body,
) -> Result<Response, ApiError> {
    let b: RequeueBody = json_body(&s, body).await?;
    let ids = match (b.event_ids, b.all_dead) {
        (Some(ids), false) if !ids.is_empty() && ids.len() <= 10_000 => Some(ids),
        (None, true) => None,
        _ => {
            return Err(ApiError::invalid(ValidationError::Field {
                field: "event_ids",
                reason: "give 1-10000 event_ids, or all_dead: true (not both)",
            }))
        }
    };
    let actor = actor(peer);
    let requeued = s
        .bounded_pg(async |client| {
            requeue_audited(client, &actor, ids.as_deref())
                .await
                .map_err(|e| {
                    warn!(error = %e, "outbox requeue failed");
                    ApiError::unavailable("the order store")
                })
        })
        .await?;
    info!(
        actor,
        rows = requeued.len(),
        "DEAD outbox rows requeued by an operator"
    );
    Ok(Json(json!({"requeued": requeued})).into_response())
}

/// The requeue and its audit row, in one transaction.
async fn requeue_audited(
    client: &mut deadpool_postgres::Object,
    actor: &str,
    ids: Option<&[String]>,
) -> anyhow::Result<Vec<String>> {
    let c: &mut tokio_postgres::Client = client;
    let tx = c.transaction().await?;
    let requeued = outbox::requeue_dead(&tx, ids).await?;
    audit::record(
        &tx,
        actor,
        "outbox_requeue",
        "event_outbox",
        &json!({"requeued": requeued}),
    )
    .await?;
    tx.commit().await?;
    Ok(requeued)
}
