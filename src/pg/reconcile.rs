//! What `seckill reconcile` reads from PostgreSQL: the orders changed in its window, which
//! events the outbox holds, expired unpaid orders, which reservations were recorded, and the
//! activity SKUs to check. It writes only through `pg::rows` (the outbox).

use std::collections::HashSet;

use chrono::{DateTime, Utc};
use tokio_postgres::{Error, GenericClient};

use crate::domain::events::OrderRef;

/// An order changed in the window, with what its events need.
#[derive(Debug, Clone)]
pub struct ChangedOrder {
    pub order: OrderRef,
    pub status: String,
    pub version: i32,
    pub expires_at: DateTime<Utc>,
    pub payment_id: Option<String>,
}

/// Orders whose row changed in `[start, end)`.
pub async fn changed_orders(
    pg: &impl GenericClient,
    start: DateTime<Utc>,
    end: DateTime<Utc>,
) -> Result<Vec<ChangedOrder>, Error> {
    let rows = pg
        .query(
            "SELECT order_id, reservation_id, activity_id, sku_id, user_id, status, version,
                    expires_at, payment_id
             FROM orders WHERE updated_at >= $1 AND updated_at < $2",
            &[&start, &end],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| ChangedOrder {
            order: OrderRef {
                order_id: r.get(0),
                reservation_id: r.get(1),
                activity_id: r.get(2),
                sku_id: r.get(3),
                user_id: r.get(4),
            },
            status: r.get(5),
            version: r.get(6),
            expires_at: r.get(7),
            payment_id: r.get(8),
        })
        .collect())
}

/// Orders changed at or after `since` (within the grace period): all, and the paid and the
/// cancelled among them, which the checks of their events leave for the next run.
#[derive(Debug, Clone, Copy, Default)]
pub struct FreshOrders {
    pub all: u64,
    pub paid: u64,
    pub canceled: u64,
}

pub async fn fresh_orders(
    pg: &impl GenericClient,
    since: DateTime<Utc>,
) -> Result<FreshOrders, Error> {
    let r = pg
        .query_one(
            "SELECT count(*), count(*) FILTER (WHERE status = 'PAID'),
                    count(*) FILTER (WHERE status = 'CANCELED')
             FROM orders WHERE updated_at >= $1",
            &[&since],
        )
        .await?;
    let n = |i: usize| r.get::<_, i64>(i) as u64;
    Ok(FreshOrders {
        all: n(0),
        paid: n(1),
        canceled: n(2),
    })
}

/// Which of `ids` the outbox holds, asked in chunks so a long window stays a few queries.
pub async fn outbox_has(pg: &impl GenericClient, ids: &[String]) -> Result<HashSet<String>, Error> {
    let mut present = HashSet::new();
    for chunk in ids.chunks(10_000) {
        let rows = pg
            .query(
                "SELECT event_id FROM event_outbox_by_day WHERE event_id = ANY($1::text[])",
                &[&chunk],
            )
            .await?;
        present.extend(rows.into_iter().map(|r| r.get::<_, String>(0)));
    }
    Ok(present)
}

/// An unpaid order whose pay window ended in the window: (order, activity, SKU, expires_at).
pub type ExpiredOrder = (String, i64, i64, DateTime<Utc>);

/// Unpaid orders that expired in `[start, end)` and are still not cancelled.
pub async fn expired_unpaid(
    pg: &impl GenericClient,
    start: DateTime<Utc>,
    end: DateTime<Utc>,
) -> Result<Vec<ExpiredOrder>, Error> {
    Ok(pg
        .query(
            "SELECT order_id, activity_id, sku_id, expires_at FROM orders
             WHERE status IN ('CREATED', 'PAYING') AND expires_at < $1 AND expires_at >= $2",
            &[&end, &start],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect())
}

/// How many orders' pay windows ended in `[start, end)` (looked at, whatever their state), and
/// how many unpaid ones ended in `[end, now)`, too recently to call them stuck.
pub async fn expiries(
    pg: &impl GenericClient,
    start: DateTime<Utc>,
    end: DateTime<Utc>,
    now: DateTime<Utc>,
) -> Result<(u64, u64), Error> {
    let r = pg
        .query_one(
            "SELECT count(*) FILTER (WHERE expires_at < $2),
                    count(*) FILTER (WHERE expires_at >= $2 AND status IN ('CREATED', 'PAYING'))
             FROM orders WHERE expires_at >= $1 AND expires_at < $3",
            &[&start, &end, &now],
        )
        .await?;
    Ok((r.get::<_, i64>(0) as u64, r.get::<_, i64>(1) as u64))
}

/// Which of `ids` PostgreSQL recorded a decision for (ordered or rejected).
pub async fn recorded_reservations(
    pg: &impl GenericClient,
    ids: &[String],
) -> Result<HashSet<String>, Error> {
    Ok(pg
        .query(
            "SELECT reservation_id FROM reservations WHERE reservation_id = ANY($1::text[])",
            &[&ids],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// The (activity, SKU) pairs of activities that ran at some point in `[start, now)`.
pub async fn skus_in_window(
    pg: &impl GenericClient,
    start: DateTime<Utc>,
    now: DateTime<Utc>,
) -> Result<Vec<(i64, i64)>, Error> {
    Ok(pg
        .query(
            "SELECT s.activity_id, s.sku_id FROM activity_skus s JOIN activities a USING (activity_id)
             WHERE a.ends_at >= $1 AND a.starts_at < $2",
            &[&start, &now],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect())
}
