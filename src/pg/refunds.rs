//! Refund obligations (docs/architecture/recovery.md#refund-obligations): a payment the provider
//! confirmed that no order could take is owed back. The row and its REFUND_REQUIRED event are
//! written in the transaction that found the order could not take the payment, once per
//! payment id; an operator (`seckill refunds`) or the shop's refund worker (the admin route)
//! marks it REFUNDED, audited.

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio_postgres::GenericClient;

use super::rows::{JsonDoc, OutboxEvent, OutboxRows, OutboxStart};
use crate::domain::events::{OrderRef, RefundRequired, TAG_REFUND_REQUIRED};

/// The order a payment could not settle, as the payment's transaction read it.
#[derive(Debug, Clone)]
pub struct Unsettled {
    pub order: OrderRef,
    pub status: String,
    pub version: i32,
}

/// What recording an obligation came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owed {
    /// A new obligation, with its event.
    Recorded,
    /// This payment id's obligation for this order was recorded before (a re-sent notification).
    Already,
    /// The payment id is taken by another order (settled or owed back there): nothing written.
    TakenElsewhere,
}

/// A payment owed back: its id, what the buyer paid, and why no order took it.
#[derive(Debug, Clone, Copy)]
pub struct Owing<'a> {
    pub payment_id: &'a str,
    pub amount_cents: i64,
    /// `ORDER_CANCELED`, `ORDER_EXPIRED`, `ALREADY_PAID` or `AMOUNT_MISMATCH`.
    pub reason: &'a str,
}

/// Records `p` as owed back, inside the payment's transaction `tx`: the payment id is bound to
/// the order in `order_payments` (a payment belongs to one order, paid or refunded, so an id
/// owed back here can never settle another), then the row and its REFUND_REQUIRED event on
/// `order_event_topic`, with a NOTIFY for the relays.
pub async fn owe(
    tx: &tokio_postgres::Transaction<'_>,
    p: &Owing<'_>,
    found: &Unsettled,
    order_event_topic: &str,
) -> Result<Owed, tokio_postgres::Error> {
    let order = &found.order;
    let claimed = tx
        .execute(
            "INSERT INTO order_payments (payment_id, activity_id, order_id) VALUES ($1, $2, $3)
             ON CONFLICT (payment_id) DO NOTHING",
            &[&p.payment_id, &order.activity_id, &order.order_id],
        )
        .await?;
    if claimed == 0 {
        // A statement of its own: it sees the row that made the insert do nothing, even one
        // a concurrent transaction committed while the insert waited for it.
        let bound: Option<String> = tx
            .query_opt(
                "SELECT order_id FROM order_payments WHERE payment_id = $1",
                &[&p.payment_id],
            )
            .await?
            .map(|r| r.get(0));
        if bound.as_deref() != Some(order.order_id.as_str()) {
            return Ok(Owed::TakenElsewhere);
        }
    }
    let inserted = tx
        .execute(
            "INSERT INTO refund_obligations
                 (payment_id, activity_id, order_id, user_id, amount_cents, reason)
             VALUES ($1, $2, $3, $4, $5, $6)
             ON CONFLICT (payment_id) DO NOTHING",
            &[
                &p.payment_id,
                &order.activity_id,
                &order.order_id,
                &order.user_id,
                &p.amount_cents,
                &p.reason,
            ],
        )
        .await?;
    if inserted == 0 {
        return Ok(Owed::Already);
    }
    let mut event = RefundRequired::new(
        order,
        &found.status,
        found.version,
        p.payment_id,
        p.amount_cents,
        p.reason,
    );
    event.base.occurred_at = Some(Utc::now());
    let mut rows = OutboxRows::default();
    rows.push(OutboxEvent {
        event_id: event.base.event_id.clone(),
        activity_id: order.activity_id,
        topic: order_event_topic,
        tag: TAG_REFUND_REQUIRED,
        key: &order.order_id,
        aggregate: Some((&order.order_id, Some(found.version))),
        payload: JsonDoc::of(&event),
        deliver_at: None,
        first_send_at: None,
        start: OutboxStart::Pending,
    });
    rows.insert_with(tx).await?;
    super::outbox::notify(tx).await?;
    Ok(Owed::Recorded)
}

/// One obligation, as `seckill refunds list` and the admin route show it.
#[derive(Debug, Clone, Serialize)]
pub struct Obligation {
    pub payment_id: String,
    pub activity_id: i64,
    pub order_id: String,
    pub user_id: i64,
    pub amount_cents: i64,
    pub reason: String,
    pub status: String,
    pub created_at: DateTime<Utc>,
    pub refunded_at: Option<DateTime<Utc>>,
    pub refund_reference: Option<String>,
    pub refunded_by: Option<String>,
}

const COLUMNS: &str = "payment_id, activity_id, order_id, user_id, amount_cents, reason, status, \
                       created_at, refunded_at, refund_reference, refunded_by";

fn obligation(r: &tokio_postgres::Row) -> Obligation {
    Obligation {
        payment_id: r.get(0),
        activity_id: r.get(1),
        order_id: r.get(2),
        user_id: r.get(3),
        amount_cents: r.get(4),
        reason: r.get(5),
        status: r.get(6),
        created_at: r.get(7),
        refunded_at: r.get(8),
        refund_reference: r.get(9),
        refunded_by: r.get(10),
    }
}

/// Obligations oldest first: PENDING only, or every one.
pub async fn list(
    client: &impl GenericClient,
    pending_only: bool,
    limit: i64,
) -> Result<Vec<Obligation>, tokio_postgres::Error> {
    let sql = format!(
        "SELECT {COLUMNS} FROM refund_obligations
         WHERE status = 'PENDING' OR NOT $1
         ORDER BY created_at, payment_id LIMIT $2"
    );
    let rows = client.query(&sql, &[&pending_only, &limit]).await?;
    Ok(rows.iter().map(obligation).collect())
}

/// What marking an obligation refunded came to.
#[derive(Debug, Clone)]
pub enum Marked {
    /// Marked now.
    Refunded(Obligation),
    /// Marked before (by this reference or another): unchanged, shown as it is.
    Already(Obligation),
    NotFound,
}

/// Marks `payment_id`'s obligation REFUNDED with the provider's `reference`, by `actor`;
/// repeating it changes nothing.
pub async fn mark_refunded(
    client: &impl GenericClient,
    payment_id: &str,
    reference: &str,
    actor: &str,
) -> Result<Marked, tokio_postgres::Error> {
    let sql = format!(
        "UPDATE refund_obligations
         SET status = 'REFUNDED', refunded_at = now(), refund_reference = $2, refunded_by = $3
         WHERE payment_id = $1 AND status = 'PENDING'
         RETURNING {COLUMNS}"
    );
    if let Some(r) = client
        .query_opt(&sql, &[&payment_id, &reference, &actor])
        .await?
    {
        return Ok(Marked::Refunded(obligation(&r)));
    }
    let sql = format!("SELECT {COLUMNS} FROM refund_obligations WHERE payment_id = $1");
    Ok(match client.query_opt(&sql, &[&payment_id]).await? {
        Some(r) => Marked::Already(obligation(&r)),
        None => Marked::NotFound,
    })
}

/// [`mark_refunded`] and its `admin_audit` row (`refund_mark`, with what it came to), in one
/// transaction: a mark that cannot be audited is not made.
pub async fn mark_refunded_audited(
    client: &mut tokio_postgres::Client,
    payment_id: &str,
    reference: &str,
    actor: &str,
) -> Result<Marked, tokio_postgres::Error> {
    let tx = client.transaction().await?;
    let marked = mark_refunded(&tx, payment_id, reference, actor).await?;
    let outcome = match &marked {
        Marked::Refunded(_) => "refunded",
        Marked::Already(_) => "already_refunded",
        Marked::NotFound => "not_found",
    };
    super::audit::record(
        &tx,
        actor,
        "refund_mark",
        &format!("payment:{payment_id}"),
        &serde_json::json!({"reference": reference, "outcome": outcome}),
    )
    .await?;
    tx.commit().await?;
    Ok(marked)
}

/// A refund reference as the provider gives it: 1-128 printable ASCII characters.
pub fn valid_reference(r: &str) -> bool {
    !r.is_empty() && r.len() <= 128 && r.bytes().all(|b| b.is_ascii_graphic())
}

/// PENDING obligations: how many, how much, and how long the oldest has waited.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backlog {
    pub pending: i64,
    pub pending_cents: i64,
    pub oldest_age_secs: f64,
}

pub async fn backlog(client: &impl GenericClient) -> Result<Backlog, tokio_postgres::Error> {
    let r = client
        .query_one(
            "SELECT count(*), coalesce(sum(amount_cents), 0)::int8,
                    coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8
             FROM refund_obligations WHERE status = 'PENDING'",
            &[],
        )
        .await?;
    Ok(Backlog {
        pending: r.get(0),
        pending_cents: r.get(1),
        oldest_age_secs: r.get::<_, f64>(2).max(0.0),
    })
}
