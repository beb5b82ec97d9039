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

/// The mirror of the cancel: `CREATED|PAYING → PAID` only before `expires_at`.
pub async fn pay(
    client: &mut Client,
    order_id: &str,
    payment_id: &str,
    names: &StateNames,
) -> Result<PayOutcome, TxError> {
    let tx = client.transaction().await?;
    let row = tx
        .query_opt(
            "UPDATE orders SET status = 'PAID', version = version + 1, payment_id = $2, paid_at = now(),
                    updated_at = now()
             WHERE order_id = $1 AND status IN ('CREATED', 'PAYING') AND expires_at > now()
             RETURNING version, reservation_id, activity_id, sku_id, user_id, amount_cents",
            &[&order_id, &payment_id],
        )
        .await?;
    let outcome = match row {
        Some(r) => {
            let version: i32 = r.get(0);
            let rid: String = r.get(1);
            let facts = OrderRef {
                order_id: order_id.to_string(),
                reservation_id: rid.clone(),
                activity_id: r.get(2),
                sku_id: r.get(3),
                user_id: r.get(4),
            };
            let mut paid = OrderPaid::new(&facts, version, Some(payment_id.to_string()));
            paid.amount_cents = Some(r.get(5));
            paid.base.occurred_at = Some(Utc::now());
            tx.execute(
                "INSERT INTO event_outbox (event_id, topic, tag, message_key, aggregate_id, aggregate_version, payload)
                 VALUES ($1, $2, 'ORDER_PAID', $3, $3, $4, $5) ON CONFLICT (event_id) DO NOTHING",
                &[&paid.base.event_id, &names.order_event_topic, &order_id, &version, &payload(&paid)],
            )
            .await?;
            tx.batch_execute(&format!("NOTIFY {OUTBOX_CHANNEL}"))
                .await?;
            PayOutcome::Paid { version }
        }
        None => {
            let cur = tx
                .query_opt(
                    "SELECT status, payment_id FROM orders WHERE order_id = $1",
                    &[&order_id],
                )
                .await?;
            match cur {
                None => PayOutcome::NotFound,
                Some(r) => {
                    let status: String = r.get(0);
                    let paid_with: Option<String> = r.get(1);
                    match status.as_str() {
                        "PAID" if paid_with.as_deref() == Some(payment_id) => {
                            PayOutcome::AlreadyPaidSame
                        }
                        "PAID" => PayOutcome::AlreadyPaidOther,
                        "CANCELED" => PayOutcome::Canceled,
                        _ => PayOutcome::Expired,
                    }
                }
            }
        }
    };
    tx.commit().await?;
    Ok(outcome)
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
