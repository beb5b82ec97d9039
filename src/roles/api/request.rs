//! What every route reads of a request: the buyer it is for, its body (bounded), the ids in
//! its path (a bad one is the same JSON 400 as any bad input) and, on the admin listener, the
//! operator.

use axum::extract::{FromRequestParts, Path};
use axum::http::request::Parts;
use axum::http::StatusCode;

use super::error::ApiError;
use super::state::ApiState;

/// The buyer a request is for: the token's when there is one (a body naming someone else is
/// refused), else the body's where the deployment trusts it.
pub(super) fn the_buyer(token: Option<i64>, body: Option<i64>) -> Result<i64, ApiError> {
    match (token, body) {
        (Some(token), Some(body)) if token != body => Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "FORBIDDEN",
            "user_id is not the buyer the token names",
        )),
        (Some(token), _) => Ok(token),
        (None, Some(body)) => Ok(body),
        (None, None) => Err(ApiError::invalid(crate::domain::ValidationError::Missing(
            "user_id",
        ))),
    }
}

/// A request body, bounded by `api.max_body_bytes` (400 `INVALID_REQUEST` past it).
pub(super) async fn read_body(
    s: &ApiState,
    body: axum::body::Body,
) -> Result<axum::body::Bytes, ApiError> {
    let max = s.settings.api.max_body_bytes;
    axum::body::to_bytes(body, max)
        .await
        .map_err(|_| ApiError::invalid(crate::domain::ValidationError::TooLarge(max)))
}

/// Who did an admin action, for its audit row: the admin listener's peer.
pub(super) fn admin_actor(peer: Option<axum::Extension<crate::http::PeerAddr>>) -> String {
    match peer {
        Some(axum::Extension(crate::http::PeerAddr(p))) => format!("admin-api@{p}"),
        None => "admin-api".to_string(),
    }
}

/// An admin route's JSON body (`{}` when empty), bounded like every body.
pub(super) async fn json_body<T: serde::de::DeserializeOwned>(
    s: &ApiState,
    body: axum::body::Body,
) -> Result<T, ApiError> {
    let bytes = read_body(s, body).await?;
    let bytes = if bytes.is_empty() {
        &b"{}"[..]
    } else {
        &bytes[..]
    };
    serde_json::from_slice(bytes)
        .map_err(|e| ApiError::invalid(crate::domain::ValidationError::Json(e.to_string())))
}

/// `Path` whose rejection (a segment that is not UTF-8, say) is the same JSON 400 as every
/// other bad input, never axum's plain-text one.
pub(super) struct IdPath<T>(pub(super) T);

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
