//! The buyer's read routes (`GET /v1/reservations/{id}`, `GET /v1/orders/{id}`) and payment
//! (`POST /v1/orders/{id}/pay`).

use axum::body::{to_bytes, Body};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use chrono::{TimeZone, Utc};
use serde_json::json;
use tracing::{info, warn};

use super::error::require_id;
use super::{ApiError, ApiState, IdPath};
use crate::domain::PayOutcome;
use crate::domain::ValidationError;
use crate::pg::order_state::{pay, StateNames};
use crate::pg::queries;

pub(super) async fn get_reservation(
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
            "order_id": order.order.order_id,
            "status": order.status,
            "activity_id": order.order.activity_id,
            "sku_id": order.order.sku_id,
            "user_id": order.order.user_id,
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

pub(super) async fn get_order(
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

pub(super) async fn pay_order(
    State(s): State<ApiState>,
    IdPath(order_id): IdPath<String>,
    body: Body,
) -> Result<Response, ApiError> {
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
