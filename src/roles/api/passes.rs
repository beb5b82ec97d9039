//! Sale passes at the API (docs/architecture/hot-path.md#sale-passes): registration
//! (`POST /v1/activities/{id}/passes`), its proof-of-work challenge
//! (`POST /v1/activities/{id}/passes/challenges`), and the check a reservation's `Sale-Pass`
//! header gets before the reserve script runs.

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use chrono::Utc;
use tracing::{info, warn};

use super::bodies::{PassChallenge, SalePass};
use super::error::ApiError;
use super::limits;
use super::request::IdPath;
use super::state::ApiState;
use crate::auth::pass::{self, PASS_HEADER};
use crate::domain::request::parse_path_id;
use crate::http::PeerAddr;
use crate::pg::passes::{PassPolicy, Registered};

/// How long an instance believes an activity's pass policy it read (a registration window or
/// a limit changed before the sale reaches every instance within this).
const POLICY_FRESH: Duration = Duration::from_secs(1);

/// The body of both routes: who registers (only where the deployment believes the body's
/// `user_id`) and, for a registration, the solved challenge.
#[derive(Debug, Default)]
struct PassRequest {
    user_id: Option<i64>,
    pow: Option<serde_json::Value>,
}

fn unavailable() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "PASSES_UNAVAILABLE",
        "sale passes cannot be issued or checked here (no passes.secrets)",
    )
}

fn refused(status: StatusCode, code: &'static str, message: &str) -> ApiError {
    metrics::counter!("pass_registrations_total", "result" => code).increment(1);
    ApiError::new(status, code, message)
}

/// The activity's policy, read at most once per [`POLICY_FRESH`]; 404 for an unknown activity,
/// 409 for one that sells without passes.
async fn policy(s: &ApiState, activity_id: i64) -> Result<PassPolicy, ApiError> {
    let cached = s.passes.policies.lock().ok().and_then(|m| {
        m.get(&activity_id)
            .filter(|(at, _)| at.elapsed() < POLICY_FRESH)
            .map(|(_, p)| p.clone())
    });
    let found = match cached {
        Some(p) => p,
        None => {
            let read = s
                .bounded_pg(async |c| {
                    crate::pg::passes::policy(&***c, activity_id)
                        .await
                        .map_err(|_| ApiError::unavailable("the order store"))
                })
                .await?;
            if let Ok(mut m) = s.passes.policies.lock() {
                m.insert(activity_id, (Instant::now(), read.clone()));
            }
            read
        }
    };
    match found {
        None => Err(refused(
            StatusCode::NOT_FOUND,
            "ACTIVITY_NOT_FOUND",
            "no such activity",
        )),
        Some(None) => Err(refused(
            StatusCode::CONFLICT,
            "PASSES_NOT_REQUIRED",
            "this activity sells without passes",
        )),
        Some(Some(p)) => Ok(p),
    }
}

/// Registration is open now for `p`, or why not.
fn open_now(p: &PassPolicy) -> Result<(), ApiError> {
    let now = Utc::now();
    if now < p.opens_at {
        return Err(refused(
            StatusCode::TOO_EARLY,
            "REGISTRATION_NOT_OPEN",
            &format!("pass registration opens at {}", p.opens_at.to_rfc3339()),
        ));
    }
    if now >= p.closes_at {
        return Err(refused(
            StatusCode::FORBIDDEN,
            "REGISTRATION_CLOSED",
            "pass registration has closed",
        ));
    }
    Ok(())
}

/// The path's activity, the caller (token first, the body where trusted) and the body.
async fn caller(
    s: &ApiState,
    activity: &str,
    headers: &HeaderMap,
    body: Body,
) -> Result<(i64, i64, PassRequest), ApiError> {
    let activity_id = parse_path_id(activity, "activity_id").map_err(ApiError::invalid)?;
    let token_buyer = s.buyer(headers).await?;
    let bytes = super::request::read_body(s, body).await?;
    let req = parse_request(&bytes)?;
    let user_id = super::request::the_buyer(token_buyer, req.user_id)?;
    if s.passes.secrets.is_empty() {
        return Err(unavailable());
    }
    Ok((activity_id, user_id, req))
}

/// The body of both routes: empty, or a JSON object whose `user_id` is a positive integer and
/// whose `pow` is an object (each may be left out or null); anything else is a 400.
fn parse_request(bytes: &[u8]) -> Result<PassRequest, ApiError> {
    let bad = |why: &str| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "INVALID_REQUEST",
            format!("body: {why}"),
        )
    };
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(PassRequest::default());
    }
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|_| bad("not JSON"))?;
    let serde_json::Value::Object(mut body) = value else {
        return Err(bad("not a JSON object"));
    };
    let user_id = match body.remove("user_id") {
        None | Some(serde_json::Value::Null) => None,
        Some(v) => Some(
            v.as_i64()
                .filter(|u| *u > 0)
                .ok_or_else(|| bad("user_id must be a positive integer"))?,
        ),
    };
    let pow = match body.remove("pow") {
        None | Some(serde_json::Value::Null) => None,
        Some(v @ serde_json::Value::Object(_)) => Some(v),
        Some(_) => return Err(bad("pow must be an object (a solved challenge)")),
    };
    Ok(PassRequest { user_id, pow })
}

/// `POST /v1/activities/{id}/passes/challenges`: a proof-of-work challenge for this buyer and
/// activity, its work grown with this instance's load.
pub(super) async fn challenge(
    State(s): State<ApiState>,
    IdPath(activity): IdPath<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let (activity_id, user_id, _) = caller(&s, &activity, &headers, body).await?;
    let p = policy(&s, activity_id).await?;
    open_now(&p)?;
    if p.pow_difficulty <= 0 {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "POW_NOT_REQUIRED",
            "this activity's registration asks no proof of work",
        ));
    }
    let (challenge, difficulty) = s
        .passes
        .pow
        .challenge(activity_id, user_id, p.pow_difficulty as u32)
        .ok_or_else(unavailable)?;
    metrics::counter!("pass_challenges_total").increment(1);
    Ok(Json(PassChallenge {
        challenge: &challenge,
        difficulty,
    })
    .into_response())
}

/// `POST /v1/activities/{id}/passes`: issues the buyer's pass (201), or answers the one they
/// hold (200), within the activity's registration window and limit.
pub(super) async fn register(
    State(s): State<ApiState>,
    IdPath(activity): IdPath<String>,
    peer: Option<Extension<PeerAddr>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let (activity_id, user_id, req) = caller(&s, &activity, &headers, body).await?;
    let p = policy(&s, activity_id).await?;
    open_now(&p)?;
    if p.pow_difficulty > 0 {
        proof_of_work(&s, req.pow, activity_id, user_id)?;
    }
    let peer = peer.map(|Extension(PeerAddr(p))| p);
    let client_addr = limits::client_addr(peer, &headers, &s.settings.api.trusted_proxies)
        .map(|a| a.to_string())
        .unwrap_or_default();
    let fresh_id = format!("sp_{}", ulid::Ulid::new());
    let outcome = s
        .bounded_pg(async |c| {
            crate::pg::passes::register(c, activity_id, user_id, &fresh_id, &client_addr)
                .await
                .map_err(|e| {
                    warn!(activity_id, user_id, error = %e, "pass registration failed");
                    ApiError::unavailable("the order store")
                })
        })
        .await?;
    let (status, pass_id, issued_at) = match outcome {
        Registered::Issued { pass_id, issued_at } => (StatusCode::CREATED, pass_id, issued_at),
        Registered::Held { pass_id, issued_at } => (StatusCode::OK, pass_id, issued_at),
        Registered::Exhausted => {
            return Err(refused(
                StatusCode::GONE,
                "PASSES_EXHAUSTED",
                "every pass of this activity is issued",
            ))
        }
    };
    let result = if status == StatusCode::CREATED {
        "issued"
    } else {
        "held"
    };
    metrics::counter!("pass_registrations_total", "result" => result).increment(1);
    info!(activity_id, user_id, pass_id = %pass_id, result, "sale pass registration");
    let signed = pass::sign(&s.passes.secrets[0], activity_id, user_id, &pass_id);
    let body = SalePass {
        pass: &signed,
        pass_id: &pass_id,
        activity_id,
        user_id,
        issued_at,
    };
    Ok((status, Json(body)).into_response())
}

/// The registration's proof of work: present, solving a challenge made for this buyer and
/// activity, not expired.
fn proof_of_work(
    s: &ApiState,
    pow: Option<serde_json::Value>,
    activity_id: i64,
    user_id: i64,
) -> Result<(), ApiError> {
    let Some(pow) = pow else {
        return Err(refused(
            StatusCode::FORBIDDEN,
            "POW_REQUIRED",
            "this registration needs a proof of work: solve a challenge from \
             POST /v1/activities/{activity_id}/passes/challenges and send it as `pow`",
        ));
    };
    let payload: altcha::Payload = serde_json::from_value(pow).map_err(|_| {
        refused(
            StatusCode::FORBIDDEN,
            "POW_INVALID",
            "pow is not a solved challenge",
        )
    })?;
    s.passes
        .pow
        .verify(&payload, activity_id, user_id)
        .map_err(|f| {
            metrics::counter!("pass_pow_refused_total", "reason" => f.label()).increment(1);
            let message = match f {
                crate::auth::pow::PowFailure::Expired => "the challenge expired; ask another",
                _ => "pow does not solve a challenge made for this buyer and activity",
            };
            refused(StatusCode::FORBIDDEN, "POW_INVALID", message)
        })
}

/// The pass a reservation carries, checked before the reserve script: its id (`""` when none),
/// 403 `PASS_INVALID` for a pass not signed for this buyer and activity, 403 `PASS_REQUIRED`
/// when the activity is known to require one and none came. That it buys once is the
/// script's to enforce.
pub(super) async fn sale_pass(
    s: &ApiState,
    headers: &HeaderMap,
    activity_id: i64,
    user_id: i64,
) -> Result<String, ApiError> {
    // A sale open to all ignores a pass sent along.
    if !required(s, activity_id).await {
        return Ok(String::new());
    }
    let Some(sent) = headers.get(PASS_HEADER) else {
        metrics::counter!("pass_refused_total", "reason" => "missing").increment(1);
        return Err(super::error::pass_required());
    };
    // Without secrets nothing was ever signed here: every pass is refused as not ours.
    let sent = sent.to_str().unwrap_or_default().trim();
    pass::verify(&s.passes.secrets, sent, activity_id, user_id)
        .map(str::to_string)
        .map_err(|f| {
            metrics::counter!("pass_refused_total", "reason" => f.label()).increment(1);
            ApiError::new(
                StatusCode::FORBIDDEN,
                "PASS_INVALID",
                "the Sale-Pass is not a pass issued to this buyer for this activity",
            )
        })
}

/// Whether the activity requires passes, as far as this instance knows without asking Redis
/// each time: known once the sale has started (when it is fixed); until then, and when Redis
/// cannot say, `false`, and the reserve script decides.
async fn required(s: &ApiState, activity_id: i64) -> bool {
    if let Some(r) = s
        .passes
        .required
        .read()
        .ok()
        .and_then(|m| m.get(&activity_id).copied())
    {
        return r;
    }
    let Ok((Some(starts), required)) = s.redis.passes().passes_required(activity_id).await else {
        return false;
    };
    if starts <= Utc::now().timestamp_millis() {
        if let Ok(mut m) = s.passes.required.write() {
            m.insert(activity_id, required);
        }
    }
    required
}
