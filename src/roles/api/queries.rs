//! The buyer's read routes (`GET /v1/reservations/{id}`, `GET /v1/orders/{id}`), owner-only.

use crate::domain::status::{HoldStatus, ReservationStatus};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use chrono::{TimeZone, Utc};

use super::bodies::{
    ReservationInRedis, ReservationOrdered, ReservationProjected, ReservationRejected,
};
use super::error::require_id;
use super::error::ApiError;
use super::request::IdPath;
use super::state::ApiState;
use crate::pg::queries;

fn reservation_not_found() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "RESERVATION_NOT_FOUND",
        "no such reservation",
    )
}

fn order_not_found() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "ORDER_NOT_FOUND",
        "no such order (it may still be queued: see its reservation)",
    )
}

/// With token identity (`me` set), whether a thing held by `owner` may be shown.
fn mine(me: Option<i64>, owner: Option<i64>) -> bool {
    me.is_none() || owner == me
}

/// With token identity (`me` set), anything another buyer holds is answered as if it did not
/// exist (`not_found`), so ids cannot be probed.
fn owned(
    me: Option<i64>,
    owner: Option<i64>,
    not_found: impl FnOnce() -> ApiError,
) -> Result<(), ApiError> {
    if mine(me, owner) {
        Ok(())
    } else {
        Err(not_found())
    }
}

/// A buyer reads only their own reservation: another buyer's id answers 404, the same as an
/// unknown one, by the same path. Each store that finds it another buyer's is treated as one
/// that found nothing and the lookup goes on, so another buyer's id reads the projection,
/// PostgreSQL and the reservation hash in turn exactly as an unknown id does, and takes as long.
pub(super) async fn get_reservation(
    State(s): State<ApiState>,
    IdPath(reservation_id): IdPath<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    require_id("rsv", "reservation_id", &reservation_id)?;
    // Refuse a bad token before looking anything up.
    let me = s.buyer(&headers).await?;
    // The projection answers most polls without touching PostgreSQL (entries written before
    // the projection carried the buyer fall through to the order store).
    if let Ok(p) = s.redis.projections().projection(&reservation_id).await {
        if let (Some(status), Some(order_id), Some(owner)) =
            (p.get("status"), p.get("order_id"), p.get("user_id"))
        {
            if mine(me, owner.parse().ok()) {
                return Ok(Json(ReservationProjected {
                    reservation_id: &reservation_id,
                    order_id,
                    status,
                    version: p.get("version").and_then(|v| v.parse::<i64>().ok()),
                })
                .into_response());
            }
        }
    }
    if let Some(answer) = s
        .bounded_pg(async |client| from_order_store(client, me, &reservation_id).await)
        .await?
    {
        return Ok(answer);
    }
    // The id names its activity; an older one (`rsv_<ulid>`) has a location key instead.
    let activity_id = match crate::domain::ids::reservation_activity(&reservation_id) {
        Some(a) => Some(a),
        None => s
            .redis
            .intake()
            .legacy_location(&reservation_id)
            .await
            .map_err(|_| ApiError::unavailable("the reservation store"))?,
    };
    let fields = match activity_id {
        Some(a) => s
            .redis
            .reservation(a, &reservation_id)
            .await
            .map_err(|_| ApiError::unavailable("the reservation store"))?,
        None => Default::default(),
    };
    let get = |k: &str| fields.get(k).cloned().unwrap_or_default();
    if fields.is_empty() || !mine(me, get("user_id").parse().ok()) {
        return Err(reservation_not_found());
    }
    let status = match get("status").parse() {
        Ok(HoldStatus::Reserved) => "QUEUED",
        Ok(HoldStatus::Released) => HoldStatus::Released.as_str(),
        _ => "UNKNOWN",
    };
    let num = |k: &str| get(k).parse::<i64>().ok();
    let (order_id, mq_status) = (get("order_id"), get("mq_status"));
    Ok(Json(ReservationInRedis {
        reservation_id: &reservation_id,
        order_id: &order_id,
        status,
        mq_status: &mq_status,
        activity_id: num("activity_id"),
        sku_id: num("sku_id"),
        user_id: num("user_id"),
        valid_until: num("valid_until").and_then(|ms| Utc.timestamp_millis_opt(ms).single()),
    })
    .into_response())
}

/// A buyer reads only their own order: another buyer's id answers 404.
pub(super) async fn get_order(
    State(s): State<ApiState>,
    IdPath(order_id): IdPath<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    require_id("ord", "order_id", &order_id)?;
    let me = s.buyer(&headers).await?;
    let order = s
        .bounded_pg(async |client| {
            queries::order_by_id(&***client, &order_id)
                .await
                .map_err(|_| ApiError::unavailable("the order store"))
        })
        .await?;
    match order {
        Some(order) => {
            owned(me, Some(order.order.user_id), order_not_found)?;
            Ok(Json(order).into_response())
        }
        None => Err(order_not_found()),
    }
}

/// The reservation as PostgreSQL knows it, when it is `me`'s: its order, or its rejection
/// (`None`: neither yet, or another buyer's). Both reads run, pipelined, whatever they find,
/// so another buyer's reservation costs what an unknown one does.
async fn from_order_store(
    client: &deadpool_postgres::Object,
    me: Option<i64>,
    reservation_id: &str,
) -> Result<Option<Response>, ApiError> {
    // Both statements pipelined on the one connection: one round trip.
    let (order, decision) = tokio::try_join!(
        queries::order_by_reservation(&***client, reservation_id),
        queries::reservation_decision(&***client, reservation_id),
    )
    .map_err(|_| ApiError::unavailable("the order store"))?;
    if let Some(order) = order.filter(|o| mine(me, Some(o.order.user_id))) {
        return Ok(Some(
            Json(ReservationOrdered {
                reservation_id,
                order_id: &order.order.order_id,
                status: &order.status,
                activity_id: order.order.activity_id,
                sku_id: order.order.sku_id,
                user_id: order.order.user_id,
            })
            .into_response(),
        ));
    }
    let rejected = decision
        .filter(|d| d.status == ReservationStatus::Rejected.as_str() && mine(me, Some(d.user_id)));
    Ok(rejected.map(|d| {
        Json(ReservationRejected {
            reservation_id: &d.reservation_id,
            order_id: &d.order_id,
            status: ReservationStatus::Rejected.as_str(),
            reason: d.reject_reason.as_deref(),
            activity_id: d.activity_id,
            sku_id: d.sku_id,
            user_id: d.user_id,
        })
        .into_response()
    }))
}
