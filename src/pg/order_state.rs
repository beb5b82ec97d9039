//! Order state changes after creation (docs/architecture/recovery.md#timeout-cancel-and-payment):
//! the payment here, the timeout cancel in `pg::cancel_tx` (batched). Both are conditional updates
//! of the same row, so they can never both win; only a transition that really happened writes its
//! consequences (stock, ledger, events) in the same transaction.

use crate::domain::status::OrderStatus;
use chrono::{DateTime, Utc};
use deadpool_postgres::Client;

use super::errors::TxError;
use super::refunds::{self, Owed, Owing, Unsettled};
use super::rows::{JsonDoc, OutboxEvent, OutboxRows, OutboxStart};
use crate::domain::events::{payload, OrderPaid, TAG_ORDER_PAID};
use crate::domain::PayOutcome;

/// Topics the state changes publish to.
#[derive(Debug, Clone)]
pub struct StateNames {
    pub order_event_topic: String,
    pub compensate_topic: String,
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
/// with one id cannot both win); the same notification again gets the same answer. Its
/// ORDER_PAID goes out through the outbox.
pub async fn pay(
    client: &mut Client,
    p: &Payment<'_>,
    names: &StateNames,
) -> Result<PayOutcome, TxError> {
    match pay_with(client, p, names, PaidRow::Outbox).await? {
        PayAttempt::Done(outcome) => Ok(outcome),
        // Only a transaction-message payment is held to a drafted version or a deadline.
        PayAttempt::Stale | PayAttempt::PastDeadline => {
            Err(TxError::Unknown("an outbox payment held to a draft".into()))
        }
    }
}

/// An ORDER_PAID drafted before its payment commits, for a transaction message
/// (docs/architecture/messages.md#delivering-events): the half message carries exactly this event,
/// and the payment writes exactly it, or nothing.
#[derive(Debug, Clone)]
pub struct PaidDraft {
    pub event: OrderPaid,
    /// The order's version once paid (its version now + 1).
    pub version: i32,
}

impl PaidDraft {
    /// The event as the outbox row the relay would send: the same message in either mode.
    pub fn row(&self, names: &StateNames) -> super::outbox::OutboxRow {
        super::outbox::OutboxRow {
            activity_id: self.event.base.order.activity_id,
            event_id: self.event.base.event_id.clone(),
            topic: names.order_event_topic.clone(),
            tag: TAG_ORDER_PAID.to_string(),
            message_key: self.event.base.order.order_id.clone(),
            aggregate_id: Some(self.event.base.order.order_id.clone()),
            aggregate_version: Some(self.version),
            payload: payload(&self.event),
            deliver_at: None,
            attempts: 1,
        }
    }
}

/// The ORDER_PAID a payment of this order would write now, if it is payable by `p` (unpaid,
/// unexpired, exactly its amount); `None` otherwise (the payment then answers why).
pub async fn draft_paid(client: &Client, p: &Payment<'_>) -> Result<Option<PaidDraft>, TxError> {
    let Some(r) = client
        .query_opt(
            "SELECT version, reservation_id, activity_id, sku_id, user_id, amount_cents
             FROM orders
             WHERE order_id = $1 AND status IN ('CREATED', 'PAYING') AND expires_at > now()
               AND amount_cents = $2",
            &[&p.order_id, &p.amount_cents],
        )
        .await?
    else {
        return Ok(None);
    };
    let version = r.get::<_, i32>(0) + 1;
    let facts = super::order_ref(p.order_id.to_string(), &r, 1);
    let mut event = OrderPaid::new(&facts, version, Some(p.payment_id.to_string()));
    event.amount_cents = Some(r.get(5));
    event.base.occurred_at = Some(Utc::now());
    Ok(Some(PaidDraft { event, version }))
}

/// Where a payment's ORDER_PAID row goes.
#[derive(Debug, Clone, Copy)]
pub enum PaidRow<'a> {
    /// PENDING, with a NOTIFY for the relays.
    Outbox,
    /// TRANSACTION, beside the half message already stored with `draft`: written only if the
    /// order is still at the drafted version, and committed only before `deadline` (read on
    /// PostgreSQL's clock, as the check-back reads it).
    Transaction {
        draft: &'a PaidDraft,
        deadline: DateTime<Utc>,
    },
}

/// What a payment attempt came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PayAttempt {
    Done(PayOutcome),
    /// The order moved past the drafted version: nothing written.
    Stale,
    /// The deadline passed before the commit: rolled back, nothing written.
    PastDeadline,
}

/// [`pay`] with the event row of `row`.
pub async fn pay_with(
    client: &mut Client,
    p: &Payment<'_>,
    names: &StateNames,
    row: PaidRow<'_>,
) -> Result<PayAttempt, TxError> {
    let tx = client.transaction().await?;
    let settled_other = tx
        .query_opt(
            "SELECT order_id FROM orders WHERE payment_id = $1 AND order_id <> $2",
            &[&p.payment_id, &p.order_id],
        )
        .await?;
    if settled_other.is_some() {
        return Ok(PayAttempt::Done(PayOutcome::PaymentIdReused));
    }
    let updated = match tx
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
            return Ok(PayAttempt::Done(PayOutcome::PaymentIdReused))
        }
        Err(e) => return Err(e.into()),
    };
    let (outcome, owed) = match updated {
        Some(r) => match write_paid_event(&tx, p, names, row, &r).await? {
            Some(version) => (PayOutcome::Paid { version }, None),
            None => return Ok(PayAttempt::Stale),
        },
        None => not_paid(&tx, p, names).await?,
    };
    if let PayOutcome::Paid { .. } = outcome {
        if let Some(early) = claim_payment(&tx, p, row).await? {
            return Ok(early);
        }
    }
    tx.commit().await?;
    if let Some(reason) = owed {
        metrics::counter!("refund_obligations_total", "reason" => reason).increment(1);
        tracing::warn!(order_id = %p.order_id, payment_id = %p.payment_id,
            amount_cents = p.amount_cents, reason, "payment owed back: refund obligation recorded");
    }
    Ok(PayAttempt::Done(outcome))
}

/// Why the conditional payment changed nothing, and, when the provider took money no order
/// can keep, the refund obligation recorded in the same transaction (`Some(reason)`: recorded
/// now; a re-sent notification finds it recorded and records nothing).
async fn not_paid(
    tx: &tokio_postgres::Transaction<'_>,
    p: &Payment<'_>,
    names: &StateNames,
) -> Result<(PayOutcome, Option<&'static str>), TxError> {
    let (outcome, found) = why_not_paid(tx, p).await?;
    let (Some(reason), Some(found)) = (outcome.refund_reason(), found) else {
        return Ok((outcome, None));
    };
    let owing = Owing {
        payment_id: p.payment_id,
        amount_cents: p.amount_cents,
        reason,
    };
    Ok(
        match refunds::owe(tx, &owing, &found, &names.order_event_topic).await? {
            Owed::Recorded => (outcome, Some(reason)),
            Owed::Already => (outcome, None),
            Owed::TakenElsewhere => (PayOutcome::PaymentIdReused, None),
        },
    )
}

/// The ORDER_PAID row of an order just paid (`r`: the update's RETURNING), where `row` says;
/// its version, or `None` when the drafted transaction message is of another version.
async fn write_paid_event(
    tx: &tokio_postgres::Transaction<'_>,
    p: &Payment<'_>,
    names: &StateNames,
    row: PaidRow<'_>,
    r: &tokio_postgres::Row,
) -> Result<Option<i32>, TxError> {
    let version: i32 = r.get(0);
    let facts = super::order_ref(p.order_id.to_string(), r, 1);
    match row {
        PaidRow::Outbox => {
            let mut paid = OrderPaid::new(&facts, version, Some(p.payment_id.to_string()));
            paid.amount_cents = Some(r.get(5));
            paid.base.occurred_at = Some(Utc::now());
            insert_paid(tx, &paid, version, names, OutboxStart::Pending).await?;
            super::outbox::notify(tx).await?;
        }
        PaidRow::Transaction { draft, .. } => {
            if draft.version != version {
                return Ok(None);
            }
            insert_paid(tx, &draft.event, version, names, OutboxStart::Transaction).await?;
        }
    }
    Ok(Some(version))
}

/// A payment id settles at most one order across every activity: the orders' own unique
/// key carries the activity (docs/architecture/postgresql.md#a-distributed-postgresql), this table
/// does not. Then, for a transaction message, the deadline. `Some`: the attempt ends here.
async fn claim_payment(
    tx: &tokio_postgres::Transaction<'_>,
    p: &Payment<'_>,
    row: PaidRow<'_>,
) -> Result<Option<PayAttempt>, TxError> {
    let claimed = tx
        .execute(
            "INSERT INTO order_payments (payment_id, activity_id, order_id)
             SELECT $1, activity_id, order_id FROM orders WHERE order_id = $2
             ON CONFLICT (payment_id) DO NOTHING",
            &[&p.payment_id, &p.order_id],
        )
        .await?;
    if claimed == 0 {
        return Ok(Some(PayAttempt::Done(PayOutcome::PaymentIdReused)));
    }
    // Last before the commit, with the order's row locked since the update: a check-back
    // that finds no row once it holds that lock, past the deadline, knows this
    // transaction can no longer commit.
    if let PaidRow::Transaction { deadline, .. } = row {
        let in_time: bool = tx
            .query_one("SELECT clock_timestamp() < $1", &[&deadline])
            .await?
            .get(0);
        if !in_time {
            return Ok(Some(PayAttempt::PastDeadline));
        }
    }
    Ok(None)
}

async fn insert_paid(
    tx: &tokio_postgres::Transaction<'_>,
    paid: &OrderPaid,
    version: i32,
    names: &StateNames,
    start: OutboxStart,
) -> Result<u64, tokio_postgres::Error> {
    let order = &paid.base.order;
    let mut rows = OutboxRows::default();
    rows.push(OutboxEvent {
        event_id: paid.base.event_id.clone(),
        activity_id: order.activity_id,
        topic: &names.order_event_topic,
        tag: "ORDER_PAID",
        key: &order.order_id,
        aggregate: Some((&order.order_id, Some(version))),
        payload: JsonDoc::of(paid),
        deliver_at: None,
        first_send_at: None,
        start,
    });
    rows.insert_with(tx).await
}

/// Why the conditional payment changed nothing, read in the same transaction, with the order
/// as it was found (`None`: no such order).
async fn why_not_paid(
    tx: &tokio_postgres::Transaction<'_>,
    p: &Payment<'_>,
) -> Result<(PayOutcome, Option<Unsettled>), TxError> {
    let Some(r) = tx
        .query_opt(
            "SELECT status, payment_id, amount_cents, version,
                    reservation_id, activity_id, sku_id, user_id
             FROM orders WHERE order_id = $1",
            &[&p.order_id],
        )
        .await?
    else {
        return Ok((PayOutcome::NotFound, None));
    };
    let status: String = r.get(0);
    let paid_with: Option<String> = r.get(1);
    let amount: i64 = r.get(2);
    let outcome = match status.parse::<OrderStatus>() {
        Ok(OrderStatus::Paid) if paid_with.as_deref() == Some(p.payment_id) => {
            PayOutcome::AlreadyPaidSame
        }
        Ok(OrderStatus::Paid) => PayOutcome::AlreadyPaidOther,
        Ok(OrderStatus::Canceled) => PayOutcome::Canceled,
        _ if amount != p.amount_cents => PayOutcome::AmountMismatch {
            expected_cents: amount,
        },
        _ => PayOutcome::Expired,
    };
    let found = Unsettled {
        order: super::order_ref(p.order_id.to_string(), &r, 4),
        status,
        version: r.get(3),
    };
    Ok((outcome, Some(found)))
}

/// Marks the compensation tasks of these reservations done (after Redis released them), in
/// one statement.
pub async fn compensations_done(
    client: &impl tokio_postgres::GenericClient,
    reservation_ids: &[&str],
) -> Result<u64, tokio_postgres::Error> {
    if reservation_ids.is_empty() {
        return Ok(0);
    }
    client
        .execute(
            "UPDATE compensation_tasks SET status = 'DONE', done_at = now()
             WHERE reservation_id = ANY($1::text[]) AND status = 'PENDING'",
            &[&reservation_ids],
        )
        .await
}
