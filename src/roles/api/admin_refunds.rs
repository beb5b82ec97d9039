//! The admin listener's refund routes (docs/architecture/recovery.md#refund-obligations), for the
//! shop's refund worker and for operators: `GET /admin/v1/refunds` lists the refunds owed (oldest
//! first; `?all=true` adds those refunded, `?limit=`), and `POST
//! /admin/v1/refunds/{payment_id}/refunded` with `{"reference": "<provider refund id>"}` marks one
//! REFUNDED, audited in the same transaction; repeating it answers the same row with `"repeat":
//! true`.

use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::json;
use tracing::{info, warn};

use super::error::ApiError;
use super::request::{admin_actor as actor, json_body, IdPath};
use super::state::ApiState;
use crate::domain::ValidationError;
use crate::http::PeerAddr;
use crate::pg::refunds::{self, Marked};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ListQuery {
    #[serde(default)]
    all: bool,
    limit: Option<i64>,
}

pub(super) async fn list(
    State(s): State<ApiState>,
    Query(q): Query<ListQuery>,
) -> Result<Response, ApiError> {
    let limit = q.limit.unwrap_or(1000);
    if !(1..=10_000).contains(&limit) {
        return Err(ApiError::invalid(ValidationError::Field {
            field: "limit",
            reason: "must be 1-10000",
        }));
    }
    let rows = s
        .bounded_pg(async |client| {
            refunds::list(&***client, !q.all, limit)
                .await
                .map_err(|_| ApiError::unavailable("the order store"))
        })
        .await?;
    Ok(Json(json!({ "refunds": rows })).into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MarkBody {
    /// The provider's refund id.
    reference: String,
}

pub(super) async fn mark_refunded(
    State(s): State<ApiState>,
    IdPath(payment_id): IdPath<String>,
    peer: Option<Extension<PeerAddr>>,
    body: Body,
) -> Result<Response, ApiError> {
    let b: MarkBody = json_body(&s, body).await?;
    if !refunds::valid_reference(&b.reference) {
        return Err(ApiError::invalid(ValidationError::Field {
            field: "reference",
            reason: "must be 1-128 printable characters",
        }));
    }
    let actor = actor(peer);
    let durable = s.settings.payments.require_sync_standby;
    let marked = s
        .bounded_pg(async |client| {
            if durable {
                mark_durable_or_refuse(client, &payment_id).await?;
            }
            let c: &mut tokio_postgres::Client = client;
            refunds::mark_refunded_audited(c, &payment_id, &b.reference, &actor)
                .await
                .map_err(|e| {
                    warn!(error = %e, payment_id, "refund mark failed");
                    ApiError::unavailable("the order store")
                })
        })
        .await?;
    match marked {
        Marked::Refunded(o) => {
            info!(actor, payment_id = %o.payment_id, order_id = %o.order_id,
                amount_cents = o.amount_cents, reference = %b.reference, "refund marked REFUNDED");
            Ok(Json(json!({"refund": o, "repeat": false})).into_response())
        }
        Marked::Already(o) => Ok(Json(json!({"refund": o, "repeat": true})).into_response()),
        Marked::NotFound => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "REFUND_NOT_FOUND",
            "no refund is owed for this payment id",
        )),
    }
}

/// With `payments.require_sync_standby`, a refund is marked only while the primary commits on a
/// synchronous standby: a mark lost in a failover would show the refund as owed again, and it
/// could be paid twice (docs/architecture/postgresql.md#failover). Otherwise 503
/// `REFUND_NOT_DURABLE`: nothing recorded, mark it again once the standby is back.
async fn mark_durable_or_refuse(
    client: &tokio_postgres::Client,
    payment_id: &str,
) -> Result<(), ApiError> {
    let sync = crate::pg::primary::has_sync_standby(client)
        .await
        .map_err(|e| {
            warn!(error = %e, payment_id, "could not read synchronous_standby_names");
            ApiError::unavailable("the order store")
        })?;
    if sync {
        return Ok(());
    }
    warn!(
        payment_id,
        "refund mark refused: the primary has no synchronous standby"
    );
    Err(ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "REFUND_NOT_DURABLE",
        "the order store has no synchronous standby: the mark would not survive a failover; mark it again once the standby is back",
    )
    .retry_after(30))
}
