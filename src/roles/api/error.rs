//! The one error shape of the buyers' API: `{"error": {"code", "message"}}` with a stable code,
//! and how a refusal of the reserve script maps onto it.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::bodies::{ErrorBody, ErrorDetail};
use crate::domain::ids::is_valid_id;
use crate::domain::ValidationError;
use crate::redis::ReserveResult;

/// `Retry-After` of a fenced activity: its rebuild waits for the order backlog to drain.
const FENCED_RETRY_SECS: u64 = 5;

/// A JSON error with a stable code: `{"error": {"code", "message"}}`.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    /// Seconds for `Retry-After` (every 503 says 1 unless told otherwise).
    pub retry_after_secs: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            retry_after_secs: None,
        }
    }
    /// The same error, telling the caller when to retry.
    pub fn retry_after(mut self, secs: u64) -> Self {
        self.retry_after_secs = Some(secs);
        self
    }
    pub(super) fn invalid(e: ValidationError) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "INVALID_REQUEST", e.to_string())
    }
    /// A missing, forged or expired token: no detail, nothing written.
    pub(crate) fn unauthenticated() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "UNAUTHENTICATED",
            "a valid buyer token is required (Authorization: Bearer <token>)",
        )
    }
    pub(super) fn unavailable(what: &str) -> Self {
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
            Json(ErrorBody {
                error: ErrorDetail {
                    code: self.code,
                    message: &self.message,
                },
            }),
        )
            .into_response();
        let retry = match (self.retry_after_secs, self.status) {
            (Some(secs), _) => Some(secs),
            (None, StatusCode::SERVICE_UNAVAILABLE) => Some(1),
            (None, _) => None,
        };
        if self.code == "UNAUTHENTICATED" {
            resp.headers_mut().insert(
                "www-authenticate",
                axum::http::HeaderValue::from_static("Bearer"),
            );
        }
        if let Some(secs) = retry {
            resp.headers_mut()
                .insert("retry-after", axum::http::HeaderValue::from(secs));
        }
        resp
    }
}

/// The activity sells only to buyers holding a sale pass
/// (docs/architecture/hot-path.md#sale-passes).
pub(super) fn pass_required() -> ApiError {
    ApiError::new(
        StatusCode::FORBIDDEN,
        "PASS_REQUIRED",
        "this sale requires a sale pass (the Sale-Pass header), registered before the sale",
    )
}

/// A path id this system minted (`rsv_<ULID>`, `ord_<ULID>`), or a 400.
pub(super) fn require_id(prefix: &str, name: &str, id: &str) -> Result<(), ApiError> {
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

/// A refusal of the reserve script as the buyer sees it. The two successes (reserved, the
/// same request again) are answered 202 by the route and never come here; if one did, it is
/// a bug, answered 500 rather than a wrong refusal.
impl From<ReserveResult> for ApiError {
    fn from(r: ReserveResult) -> Self {
        match r {
            ReserveResult::AlreadyPurchased { .. } => ApiError::new(
                StatusCode::CONFLICT,
                "ALREADY_PURCHASED",
                "this buyer already holds a reservation for this SKU",
            ),
            ReserveResult::RequestIdReused { sku_id: first, .. } => ApiError::new(
                StatusCode::CONFLICT,
                "REQUEST_ID_REUSED",
                format!(
                    "this buyer already used this request_id for SKU {first} of the activity; \
                     a new purchase needs a new request_id"
                ),
            ),
            ReserveResult::SoldOut => ApiError::new(StatusCode::GONE, "SOLD_OUT", "sold out"),
            ReserveResult::NotStarted => ApiError::new(
                StatusCode::TOO_EARLY,
                "NOT_STARTED",
                "the sale has not started",
            ),
            ReserveResult::Ended => {
                ApiError::new(StatusCode::FORBIDDEN, "ENDED", "the sale has ended")
            }
            ReserveResult::RateLimited { retry_ms, .. } => ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "RATE_LIMITED",
                "too many requests; retry after the indicated delay",
            )
            .retry_after(retry_ms.div_ceil(1000).max(1)),
            ReserveResult::Paused { reason } => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "SALE_PAUSED",
                if reason.is_empty() {
                    "the sale is paused by an operator".to_string()
                } else {
                    format!("the sale is paused by an operator: {reason}")
                },
            ),
            ReserveResult::Fenced { .. } | ReserveResult::Lost { .. } => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "SALE_PAUSED",
                "the sale is paused while its reservations are rebuilt from the order database",
            )
            .retry_after(FENCED_RETRY_SECS),
            ReserveResult::Ramp { percent, secs } => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "SALE_PAUSED",
                format!(
                    "resuming after a rebuild: {percent}% of new reservations admitted, all in {secs}s"
                ),
            ),
            ReserveResult::NotFound => ApiError::new(
                StatusCode::NOT_FOUND,
                "ACTIVITY_NOT_FOUND",
                "no such activity or SKU",
            ),
            ReserveResult::Draw(_) | ReserveResult::Drawing { .. } => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "DRAW_PENDING",
                "the draw is not finished; ask again with the same request_id for its outcome",
            )
            .retry_after(1),
            ReserveResult::PassRequired => pass_required(),
            ReserveResult::PassUsed { sku_id, .. } => ApiError::new(
                StatusCode::CONFLICT,
                "PASS_USED",
                format!("this buyer's sale pass already holds a reservation of SKU {sku_id}"),
            ),
            ReserveResult::Reserved(_) | ReserveResult::Duplicate(_) => ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "INTERNAL",
                "unexpected reservation result",
            ),
        }
    }
}
