//! Order state changes after creation (docs/ARCHITECTURE.md#timeout-cancel-and-payment): the timeout cancel and the payment. Both are
//! conditional updates of the same row, so they can never both win; only a transition that
//! really happened writes its consequences (stock, ledger, events) in the same transaction.

use chrono::{DateTime, Utc};
use deadpool_postgres::Client;

use super::errors::TxError;
use super::outbox::OUTBOX_CHANNEL;
use crate::domain::events::{
    compensation_task_id, payload, OrderCanceled, OrderPaid, OrderRef, ReleaseReservation,
};
use crate::domain::{CancelOutcome, PayOutcome};

/// Topics the state changes publish to.
#[derive(Debug, Clone)]
pub struct StateNames {
    pub order_event_topic: String,
    pub compensate_topic: String,
}

/// The conditional cancel of an unpaid, expired order, with its inbox row.
pub async fn cancel_if_unpaid(
    client: &mut Client,
    group: &str,
    topic: &str,
    message_id: &str,
    order_id: &str,
    names: &StateNames,
) -> Result<CancelOutcome, TxError> {
    let tx = client.transaction().await?;
    let fresh = tx
        .execute(
            "INSERT INTO consumer_inbox (consumer_group, message_id, topic, order_id, status)
             VALUES ($1, $2, $3, $4, 'PROCESSING') ON CONFLICT DO NOTHING",
            &[&group, &message_id, &topic, &order_id],
        )
        .await?;
    if fresh == 0 {
        return Ok(CancelOutcome::Duplicate);
    }
    let row = tx
        .query_opt(
            "UPDATE orders SET status = 'CANCELED', version = version + 1, canceled_at = now(),
                    cancel_reason = 'PAYMENT_TIMEOUT', updated_at = now()
             WHERE order_id = $1 AND status IN ('CREATED', 'PAYING') AND expires_at <= now()
             RETURNING version, reservation_id, activity_id, sku_id, user_id",
            &[&order_id],
        )
        .await?;
    let outcome = match row {
        Some(r) => {
            let (version, rid, aid, sku, uid): (i32, String, i64, i64, i64) =
                (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4));
            // The unit goes back to the final stock, with its ledger credit.
            tx.execute(
                "UPDATE activity_skus SET remaining_stock = remaining_stock + 1, updated_at = now()
                 WHERE activity_id = $1 AND sku_id = $2",
                &[&aid, &sku],
            )
            .await?;
            tx.execute(
                "INSERT INTO stock_ledger (activity_id, sku_id, order_id, delta, reason)
                 VALUES ($1, $2, $3, 1, 'ORDER_CANCELED')",
                &[&aid, &sku, &order_id],
            )
            .await?;
            // ... and to Redis through the compensation path (exactly once per reservation).
            tx.execute(
                "INSERT INTO compensation_tasks (task_id, reservation_id, activity_id, sku_id, user_id, reason)
                 VALUES ($1, $2, $3, $4, $5, 'ORDER_CANCELED') ON CONFLICT DO NOTHING",
                &[&compensation_task_id(&rid), &rid, &aid, &sku, &uid],
            )
            .await?;
            let now = Utc::now();
            let facts = OrderRef {
                order_id: order_id.to_string(),
                reservation_id: rid.clone(),
                activity_id: aid,
                sku_id: sku,
                user_id: uid,
            };
            let mut canceled = OrderCanceled::new(&facts, version);
            canceled.reason = Some("PAYMENT_TIMEOUT".to_string());
            canceled.base.occurred_at = Some(now);
            let mut release = ReleaseReservation::new(&facts, "ORDER_CANCELED");
            release.occurred_at = Some(now);
            tx.execute(
                "INSERT INTO event_outbox (event_id, topic, tag, message_key, aggregate_id, aggregate_version, payload)
                 VALUES ($1, $2, 'ORDER_CANCELED', $3, $3, $4, $5),
                        ($6, $7, 'RELEASE_RESERVATION', $8, NULL, NULL, $9)
                 ON CONFLICT (event_id) DO NOTHING",
                &[
                    &canceled.base.event_id,
                    &names.order_event_topic,
                    &order_id,
                    &version,
                    &payload(&canceled),
                    &release.event_id,
                    &names.compensate_topic,
                    &rid,
                    &payload(&release),
                ],
            )
            .await?;
            tx.batch_execute(&format!("NOTIFY {OUTBOX_CHANNEL}"))
                .await?;
            CancelOutcome::Canceled { version }
        }
        None => {
            let cur = tx
                .query_opt(
                    "SELECT status, expires_at FROM orders WHERE order_id = $1",
                    &[&order_id],
                )
                .await?;
            match cur {
                None => CancelOutcome::NotFound,
                Some(r) => match r.get::<_, String>(0).as_str() {
                    "PAID" => CancelOutcome::AlreadyPaid,
                    "CANCELED" => CancelOutcome::AlreadyCanceled,
                    // Unpaid but not expired by the database clock: the message came early.
                    _ => {
                        let expires_at: DateTime<Utc> = r.get(1);
                        // Nothing is committed: the redelivery must find no inbox row.
                        tx.rollback().await?;
                        return Ok(CancelOutcome::NotYetExpired { expires_at });
                    }
                },
            }
        }
    };
    tx.execute(
        "UPDATE consumer_inbox SET status = 'SUCCEEDED', decision = $3, updated_at = now()
         WHERE consumer_group = $1 AND message_id = $2",
        &[&group, &message_id, &outcome.label().to_uppercase()],
    )
    .await?;
    tx.commit().await?;
    Ok(outcome)
}

/// A payment the provider confirmed: which order, its payment id, what was paid.
#[derive(Debug, Clone, Copy)]
pub struct Payment<'a> {
    pub order_id: &'a str,
    pub payment_id: &'a str,
    pub amount_cents: i64,
}

/// The conditional payment of an unpaid, unexpired order, for exactly its amount. A payment
/// id settles at most one order (a unique index backs the check, so two notifications racing
/// with one id cannot both win); the same notification again gets the same answer.
pub async fn pay(
    client: &mut Client,
    p: &Payment<'_>,
    names: &StateNames,
) -> Result<PayOutcome, TxError> {
    let tx = client.transaction().await?;
    let settled_other = tx
        .query_opt(
            "SELECT order_id FROM orders WHERE payment_id = $1 AND order_id <> $2",
            &[&p.payment_id, &p.order_id],
        )
        .await?;
    if settled_other.is_some() {
        return Ok(PayOutcome::PaymentIdReused);
    }
    let row = match tx
        .query_opt(
            "UPDATE orders SET status = 'PAID', version = version + 1, payment_id = $2, paid_at = now(),
                    updated_at = now()
             WHERE order_id = $1 AND status IN ('CREATED', 'PAYING') AND expires_at > now()
               AND amount_cents = $3
             RETURNING version, reservation_id, activity_id, sku_id, user_id, amount_cents",
            &[&p.order_id, &p.payment_id, &p.amount_cents],
        )
        .await
    {
        Ok(row) => row,
        // Another order took this payment id between the check and the update.
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION) => {
            return Ok(PayOutcome::PaymentIdReused)
        }
        Err(e) => return Err(e.into()),
    };
    let outcome = match row {
        Some(r) => {
            let version: i32 = r.get(0);
            let facts = OrderRef {
                order_id: p.order_id.to_string(),
                reservation_id: r.get(1),
                activity_id: r.get(2),
                sku_id: r.get(3),
                user_id: r.get(4),
            };
            let mut paid = OrderPaid::new(&facts, version, Some(p.payment_id.to_string()));
            paid.amount_cents = Some(r.get(5));
            paid.base.occurred_at = Some(Utc::now());
            tx.execute(
                "INSERT INTO event_outbox (event_id, topic, tag, message_key, aggregate_id, aggregate_version, payload)
                 VALUES ($1, $2, 'ORDER_PAID', $3, $3, $4, $5) ON CONFLICT (event_id) DO NOTHING",
                &[&paid.base.event_id, &names.order_event_topic, &p.order_id, &version, &payload(&paid)],
            )
            .await?;
            tx.batch_execute(&format!("NOTIFY {OUTBOX_CHANNEL}"))
                .await?;
            PayOutcome::Paid { version }
        }
        None => why_not_paid(&tx, p).await?,
    };
    tx.commit().await?;
    Ok(outcome)
}

/// Why the conditional payment changed nothing, read in the same transaction.
async fn why_not_paid(
    tx: &tokio_postgres::Transaction<'_>,
    p: &Payment<'_>,
) -> Result<PayOutcome, TxError> {
    let Some(r) = tx
        .query_opt(
            "SELECT status, payment_id, amount_cents FROM orders WHERE order_id = $1",
            &[&p.order_id],
        )
        .await?
    else {
        return Ok(PayOutcome::NotFound);
    };
    let status: String = r.get(0);
    let paid_with: Option<String> = r.get(1);
    let amount: i64 = r.get(2);
    Ok(match status.as_str() {
        "PAID" if paid_with.as_deref() == Some(p.payment_id) => PayOutcome::AlreadyPaidSame,
        "PAID" => PayOutcome::AlreadyPaidOther,
        "CANCELED" => PayOutcome::Canceled,
        _ if amount != p.amount_cents => PayOutcome::AmountMismatch {
            expected_cents: amount,
        },
        _ => PayOutcome::Expired,
    })
}

/// Marks a reservation's compensation task done (after Redis released it).
pub async fn compensation_done(
    client: &impl tokio_postgres::GenericClient,
    reservation_id: &str,
) -> Result<u64, tokio_postgres::Error> {
    client
        .execute(
            "UPDATE compensation_tasks SET status = 'DONE', done_at = now()
             WHERE reservation_id = $1 AND status = 'PENDING'",
            &[&reservation_id],
        )
        .await
}
