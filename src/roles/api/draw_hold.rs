//! Holding a request through its activity's draw (docs/architecture/hot-path.md#a-fair-start): a
//! request that entered the draw (or came while it was being drawn) waits for the window to
//! close, helps draw its SKU in its bucket, and then asks again with the same request: it won
//! (its reservation, to be sent now) or lost (SOLD_OUT). The wait is bounded by what is left of
//! the request's own time; past it the buyer is told to ask again with the same request_id,
//! which finds the same entry. A request that goes away loses nothing: the draw makes its
//! reservation all the same, and the scanner sends what nobody waiting sent.

use crate::domain::status::{HoldStatus, SendStatus};
use std::time::{Duration, Instant};

use chrono::Utc;

use super::error::ApiError;
use super::state::ApiState;
use crate::redis::{RateLimits, ReservationView, ReserveArgs, ReserveResult, Shard};

/// How long a request may wait for its draw, from the moment it arrived.
fn hold_bound(s: &ApiState) -> Duration {
    Duration::from_millis(s.settings.draw_hold_ms())
}

/// Pause between looks while another caller finishes drawing.
const RECHECK: Duration = Duration::from_millis(20);

/// What the draw came to for one request.
pub(super) enum Drawn {
    /// The request's reservation, drawn: its first send is this request's to make.
    Won(ReservationView),
    /// Whatever else the reservation script answered (a loss included, as SOLD_OUT).
    Other(ReserveResult),
}

/// Waits out the draw for `args`'s request (which `first` said is in one) and asks again.
pub(super) async fn hold(
    s: &ApiState,
    shard: Shard,
    args: &ReserveArgs<'_>,
    arrived: Instant,
    first: ReserveResult,
) -> Result<Drawn, ApiError> {
    let deadline = arrived + hold_bound(s);
    // The later asks are repeats of the same request: they take no abuse-limit token.
    let again = ReserveArgs {
        limits: RateLimits::default(),
        ..args.clone()
    };
    let started = Instant::now();
    let mut answer = first;
    loop {
        match answer {
            ReserveResult::Draw(ref v) => {
                wait_until(v.valid_until_ms, deadline).await?;
                draw(s, shard, args).await?;
            }
            ReserveResult::Duplicate(ref v) if v.status == HoldStatus::DrawPending.as_str() => {
                draw(s, shard, args).await?;
            }
            ReserveResult::Drawing { .. } => draw(s, shard, args).await?,
            ReserveResult::Duplicate(v) if v.status == HoldStatus::DrawLost.as_str() => {
                record(started, "lost");
                return Ok(Drawn::Other(ReserveResult::SoldOut));
            }
            ReserveResult::Duplicate(v)
                if v.status == HoldStatus::Reserved.as_str()
                    && v.mq_status == SendStatus::MqPending.as_str() =>
            {
                record(started, "won");
                return Ok(Drawn::Won(v));
            }
            other => return Ok(Drawn::Other(other)),
        }
        if Instant::now() >= deadline {
            metrics::counter!("draw_hold_total", "outcome" => "timeout").increment(1);
            return Err(still_drawing());
        }
        answer = s.redis.intake().reserve(&again).await.map_err(|e| {
            tracing::warn!(error = %e, request_id = %args.reservation.request_id,
                           "reserve script failed while holding for the draw");
            ApiError::unavailable("the reservation store")
        })?;
    }
}

fn record(started: Instant, outcome: &'static str) {
    metrics::counter!("draw_hold_total", "outcome" => outcome).increment(1);
    metrics::histogram!("draw_hold_seconds").record(started.elapsed().as_secs_f64());
}

/// Sleeps until the window closes at `closes_ms`, unless that is past the request's bound.
async fn wait_until(closes_ms: i64, deadline: Instant) -> Result<(), ApiError> {
    let left = Duration::from_millis((closes_ms - Utc::now().timestamp_millis()).max(0) as u64);
    if Instant::now() + left > deadline {
        metrics::counter!("draw_hold_total", "outcome" => "timeout").increment(1);
        return Err(still_drawing());
    }
    tokio::time::sleep(left).await;
    Ok(())
}

/// Draws the request's SKU in its bucket to the end (with every other caller doing the same),
/// or waits a moment when the window is not closed yet on Redis's clock.
async fn draw(s: &ApiState, shard: Shard, args: &ReserveArgs<'_>) -> Result<(), ApiError> {
    let state = s
        .redis
        .draws()
        .draw_all(
            shard,
            args.reservation.sku_id,
            first_send_due(s),
            s.settings.api.reservation_valid_secs,
        )
        .await
        .map_err(|e| {
            tracing::warn!(error = %e, activity_id = args.reservation.activity_id,
                           sku_id = args.reservation.sku_id, "draw failed");
            ApiError::unavailable("the reservation store")
        })?;
    if state.open {
        tokio::time::sleep(RECHECK).await;
    }
    Ok(())
}

/// When the scanner may send a winner's reservation that no waiting request sent: after the
/// time one of them takes to send it.
pub(super) fn first_send_due(s: &ApiState) -> i64 {
    Utc::now().timestamp_millis()
        + (s.settings.mq.send_timeout_ms + s.settings.api.resend_backoff_ms) as i64
}

fn still_drawing() -> ApiError {
    ApiError::new(
        axum::http::StatusCode::SERVICE_UNAVAILABLE,
        "DRAW_PENDING",
        "the draw is not finished; ask again with the same request_id for its outcome",
    )
    .retry_after(1)
}
