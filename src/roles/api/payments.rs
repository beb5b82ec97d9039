//! `POST /v1/payments/notifications`: the payment provider confirms a payment
//! (docs/architecture/security.md#security-model).
//!
//! Only the provider can: the raw body must carry a valid `Seckill-Signature` made with one of
//! `payments.webhook_secrets`, within `payments.tolerance_secs`, checked before the body is
//! parsed. The order is paid only for exactly its amount, a payment id settles at most one
//! order, and the same notification again gets the same answer (providers re-send until they
//! get a 2xx). A payment the order cannot take (cancelled, expired, paid with another payment,
//! another amount) is owed back: its refund obligation is written in the same transaction
//! (docs/architecture/recovery.md#refund-obligations). A PostgreSQL that hangs gets the provider a
//! 503 within the API's bound, and its re-send the same answer whether or not the payment
//! committed.

use crate::domain::status::OrderStatus;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use tracing::{info, warn};

use super::bodies::Paid;
use super::error::require_id;
use super::error::ApiError;
use super::state::ApiState;
use crate::auth::signature::{verify, SIGNATURE_HEADER};
use crate::domain::{PayOutcome, ValidationError};
use crate::mq::{LocalOutcome, TransactionPublisher};
use crate::pg::errors::TxError;
use crate::pg::half_message_events::mark_sent;
use crate::pg::order_state::{draft_paid, pay, pay_with, PaidRow, PayAttempt, Payment, StateNames};
use crate::services::half_messages::half_message;

/// The notification body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Notification {
    order_id: String,
    payment_id: String,
    amount_cents: i64,
}

fn valid_payment_id(p: &str) -> bool {
    !p.is_empty()
        && p.len() <= 64
        && p.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
}

pub(super) async fn notification(
    State(s): State<ApiState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let bytes = super::request::read_body(&s, body).await?;
    let signature = headers.get(SIGNATURE_HEADER).and_then(|v| v.to_str().ok());
    let payments = &s.settings.payments;
    let now = chrono::Utc::now().timestamp();
    if let Err(failure) = verify(
        &payments.webhook_secrets,
        signature,
        &bytes,
        now,
        payments.tolerance_secs,
    ) {
        metrics::counter!("order_pay_total", "result" => failure.label()).increment(1);
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "BAD_SIGNATURE",
            "the notification is not signed by the payment provider, or too old",
        ));
    }
    let n: Notification = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::invalid(ValidationError::Json(e.to_string())))?;
    require_id("ord", "order_id", &n.order_id)?;
    if !valid_payment_id(&n.payment_id) {
        return Err(ApiError::invalid(ValidationError::Field {
            field: "payment_id",
            reason: "must be 1-64 characters of A-Z a-z 0-9 - _ . :",
        }));
    }
    if n.amount_cents < 0 {
        return Err(ApiError::invalid(ValidationError::Field {
            field: "amount_cents",
            reason: "must not be negative",
        }));
    }
    let outcome = s
        .bounded_pg(async |client| settle(&s, client, &n).await)
        .await?;
    metrics::counter!("order_pay_total", "result" => outcome_label(&outcome)).increment(1);
    answer(&n, outcome)
}

async fn settle(
    s: &ApiState,
    client: &mut deadpool_postgres::Object,
    n: &Notification,
) -> Result<PayOutcome, ApiError> {
    let names = StateNames {
        order_event_topic: s.names.order_event_topic.clone(),
        compensate_topic: s.names.compensate_topic.clone(),
    };
    let p = Payment {
        order_id: &n.order_id,
        payment_id: &n.payment_id,
        amount_cents: n.amount_cents,
    };
    let unavailable = |e: TxError| {
        warn!(order_id = %n.order_id, payment_id = %n.payment_id, error = %e, "payment transaction failed");
        ApiError::unavailable("the order store")
    };
    if s.settings.payments.require_sync_standby {
        require_sync_standby(client, n).await?;
    }
    if let Some(tx) = &s.transactions {
        let settled = settle_in_transaction(s, tx.as_ref(), client, &p, &names).await;
        if let Some(outcome) = settled.map_err(unavailable)? {
            return Ok(outcome);
        }
    }
    let outcome = pay(client, &p, &names).await.map_err(unavailable)?;
    if matches!(outcome, PayOutcome::Paid { .. }) {
        delivered("outbox", "outbox");
    }
    Ok(outcome)
}

/// With `payments.require_sync_standby`: a payment goes ahead only while the primary commits
/// on a synchronous standby (`synchronous_standby_names` set: the commit then waits for the
/// standby's flush, so a failover to it keeps the payment). Otherwise 503
/// `PAYMENT_NOT_DURABLE`: the provider keeps the notification and sends it again. If the standby
/// drops out between this check and the commit, the failover manager stops waiting for it and
/// also stops treating it as promotable until it has caught up
/// (docs/architecture/postgresql.md#failover).
async fn require_sync_standby(
    client: &deadpool_postgres::Object,
    n: &Notification,
) -> Result<(), ApiError> {
    let sync = crate::pg::primary::has_sync_standby(&***client)
        .await
        .map_err(|e| {
            warn!(order_id = %n.order_id, error = %e, "could not read synchronous_standby_names");
            ApiError::unavailable("the order store")
        })?;
    if sync {
        return Ok(());
    }
    metrics::counter!("order_pay_total", "result" => "not_durable").increment(1);
    // Every notification is refused while the standby is away: one warning in ten seconds
    // says so (the counter has them all), the rest are debug.
    static LAST_WARNED_S: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);
    let now_s = chrono::Utc::now().timestamp();
    let last = LAST_WARNED_S.load(std::sync::atomic::Ordering::Relaxed);
    if now_s - last >= 10
        && LAST_WARNED_S
            .compare_exchange(
                last,
                now_s,
                std::sync::atomic::Ordering::Relaxed,
                std::sync::atomic::Ordering::Relaxed,
            )
            .is_ok()
    {
        warn!(order_id = %n.order_id, payment_id = %n.payment_id,
            "payments refused: the primary has no synchronous standby (payments.require_sync_standby; \
             order_pay_total{{result=\"not_durable\"}} counts them)");
    } else {
        tracing::debug!(order_id = %n.order_id, payment_id = %n.payment_id,
            "payment refused: no synchronous standby");
    }
    Err(ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "PAYMENT_NOT_DURABLE",
        "the order store has no synchronous standby: the payment would not survive a failover; send it again",
    )
    .retry_after(5))
}

/// `event_delivery_total{family, mode, outcome}`: how each ORDER_PAID left.
fn delivered(mode: &'static str, outcome: &'static str) {
    metrics::counter!("event_delivery_total", "family" => "order_paid", "mode" => mode,
        "outcome" => outcome)
    .increment(1);
}

/// The payment with its ORDER_PAID as a transaction message
/// (docs/architecture/messages.md#delivering-events): the event is drafted from the order as it is,
/// stored as a half message, then the payment writes exactly that event (its row TRANSACTION)
/// before the deadline the half carries, and the half is ended with what the payment came to.
/// `None`: the payment goes the outbox way (the order is not payable, so it answers why and
/// writes nothing; the half could not be stored; the order moved since the draft).
async fn settle_in_transaction(
    s: &ApiState,
    tx: &dyn TransactionPublisher,
    client: &mut deadpool_postgres::Object,
    p: &Payment<'_>,
    names: &StateNames,
) -> Result<Option<PayOutcome>, TxError> {
    let Some(draft) = draft_paid(client, p).await? else {
        return Ok(None);
    };
    let timeout =
        chrono::Duration::milliseconds(s.settings.events.transaction_local_timeout_ms as i64);
    let deadline = chrono::Utc::now() + timeout;
    let msg = half_message(&draft.row(names), deadline);
    let event_id = draft.event.base.event_id.clone();
    let half = match tx.begin(msg).await {
        Ok(half) => half,
        Err(outcome) => {
            // An UNKNOWN half may be stored: its check-back finds the outbox's row (same id)
            // and commits it, a copy the inboxes absorb.
            warn!(order_id = %p.order_id, %event_id, outcome = outcome.label(), error = ?outcome,
                "half message not stored; ORDER_PAID goes through the outbox");
            delivered("transaction", "half_failed");
            return Ok(None);
        }
    };
    fail::fail_point!("tx-after-half-before-local", |_| std::process::abort());
    let row = PaidRow::Transaction {
        draft: &draft,
        deadline,
    };
    let attempt = match pay_with(client, p, names, row).await {
        Ok(attempt) => attempt,
        Err(e) => {
            // The commit may or may not have happened: the check-back reads which.
            half.end(LocalOutcome::Unknown).await;
            delivered("transaction", "unknown");
            return Err(e);
        }
    };
    match attempt {
        PayAttempt::Done(PayOutcome::Paid { version }) => {
            fail::fail_point!("tx-after-commit-before-end", |_| std::process::abort());
            let broker_msg_id = half.end(LocalOutcome::Commit).await;
            delivered("transaction", "commit");
            // Left TRANSACTION if this fails: the check-back still answers COMMIT.
            let sent = crate::pg::outbox::Sent {
                activity_id: draft.event.base.order.activity_id,
                event_id: event_id.clone(),
                broker_msg_id,
            };
            if let Err(e) = mark_sent(&***client, &[sent]).await {
                warn!(order_id = %p.order_id, %event_id, error = %e, "could not mark the event sent");
            }
            Ok(Some(PayOutcome::Paid { version }))
        }
        PayAttempt::Done(other) => {
            half.end(LocalOutcome::Rollback).await;
            delivered("transaction", "rollback");
            Ok(Some(other))
        }
        PayAttempt::Stale => {
            half.end(LocalOutcome::Rollback).await;
            delivered("transaction", "rollback");
            Ok(None)
        }
        PayAttempt::PastDeadline => {
            half.end(LocalOutcome::Rollback).await;
            delivered("transaction", "past_deadline");
            Err(TxError::Transient(
                "the payment passed its transaction deadline and rolled back".into(),
            ))
        }
    }
}

fn outcome_label(o: &PayOutcome) -> &'static str {
    match o {
        PayOutcome::Paid { .. } => "paid",
        PayOutcome::AlreadyPaidSame => "repeat",
        PayOutcome::AlreadyPaidOther => "paid_other",
        PayOutcome::AmountMismatch { .. } => "amount_mismatch",
        PayOutcome::PaymentIdReused => "payment_id_reused",
        PayOutcome::Canceled => "canceled",
        PayOutcome::Expired => "expired",
        PayOutcome::NotFound => "not_found",
    }
}

fn answer(n: &Notification, outcome: PayOutcome) -> Result<Response, ApiError> {
    let paid = |repeat: bool| {
        Json(Paid {
            order_id: &n.order_id,
            status: OrderStatus::Paid.as_str(),
            payment_id: &n.payment_id,
            repeat,
        })
        .into_response()
    };
    let conflict = |code, message: &str| Err(ApiError::new(StatusCode::CONFLICT, code, message));
    match outcome {
        PayOutcome::Paid { .. } => {
            info!(order_id = %n.order_id, payment_id = %n.payment_id, amount_cents = n.amount_cents, "order paid");
            Ok(paid(false))
        }
        PayOutcome::AlreadyPaidSame => Ok(paid(true)),
        PayOutcome::AlreadyPaidOther => {
            conflict(
                "ALREADY_PAID",
                "the order was paid with another payment; this payment is owed back (refund recorded)",
            )
        }
        PayOutcome::PaymentIdReused => conflict(
            "PAYMENT_ID_REUSED",
            "this payment_id already settled, or is owed back for, another order",
        ),
        PayOutcome::AmountMismatch { expected_cents } => Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "AMOUNT_MISMATCH",
            format!(
                "the order costs {expected_cents} cents; this payment is owed back (refund recorded)"
            ),
        )),
        PayOutcome::Canceled => conflict(
            "ORDER_CANCELED",
            "the order was cancelled; the payment is owed back (refund recorded)",
        ),
        PayOutcome::Expired => conflict(
            "ORDER_EXPIRED",
            "the payment window has closed; the payment is owed back (refund recorded)",
        ),
        PayOutcome::NotFound => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "ORDER_NOT_FOUND",
            "no such order",
        )),
    }
}
