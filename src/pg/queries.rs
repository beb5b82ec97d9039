//! Reads and the activity set-up: everything the API, admin tools and checks ask PostgreSQL.

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio_postgres::GenericClient;

use crate::domain::events::OrderRef;

/// An activity as `seckill activity create` writes it.
#[derive(Debug, Clone)]
pub struct ActivitySpec {
    pub activity_id: i64,
    pub name: String,
    pub starts_at: DateTime<Utc>,
    pub ends_at: DateTime<Utc>,
    pub reservation_valid_secs: i32,
    /// (sku_id, total_stock, price_cents)
    pub skus: Vec<(i64, i32, i64)>,
    /// How many stock buckets each SKU's stock is split into
    /// (docs/architecture/redis.md#stock-buckets), 1 to 64; fixed once the activity exists.
    pub stock_buckets: i16,
}

#[derive(Debug, thiserror::Error)]
pub enum ActivityError {
    #[error("activity {activity_id} has started: the stock of SKU {sku_id} cannot change ({current} -> {requested})")]
    StartedStockChange {
        activity_id: i64,
        sku_id: i64,
        current: i32,
        requested: i32,
    },
    #[error("activity {activity_id}: SKU {sku_id} already has orders; its stock cannot change")]
    StockInUse { activity_id: i64, sku_id: i64 },
    #[error("activity {activity_id} has {current} stock bucket(s): that cannot change ({requested} asked)")]
    BucketsFixed {
        activity_id: i64,
        current: i16,
        requested: i16,
    },
    #[error(transparent)]
    Db(#[from] tokio_postgres::Error),
}

/// Writes the activity and its SKUs; idempotent. Changing a SKU's stock is refused once the
/// activity has started or once orders exist.
pub async fn create_activity(
    client: &mut tokio_postgres::Client,
    spec: &ActivitySpec,
    now: DateTime<Utc>,
) -> Result<(), ActivityError> {
    let tx = client.transaction().await?;
    let started = upsert_activity(&tx, spec, now).await?;
    for &(sku_id, total, price) in &spec.skus {
        upsert_sku(&tx, spec, (sku_id, total, price), started).await?;
    }
    tx.commit().await?;
    Ok(())
}

/// The activity's row, created or (before its start) updated; whether it has started.
async fn upsert_activity(
    tx: &tokio_postgres::Transaction<'_>,
    spec: &ActivitySpec,
    now: DateTime<Utc>,
) -> Result<bool, ActivityError> {
    let existing = tx
        .query_opt(
            "SELECT starts_at, stock_buckets FROM activities WHERE activity_id = $1 FOR UPDATE",
            &[&spec.activity_id],
        )
        .await?;
    if let Some(current) = existing.as_ref().map(|row| row.get::<_, i16>(1)) {
        if current != spec.stock_buckets {
            return Err(ActivityError::BucketsFixed {
                activity_id: spec.activity_id,
                current,
                requested: spec.stock_buckets,
            });
        }
    }
    let started = existing
        .as_ref()
        .map(|row| row.get::<_, DateTime<Utc>>(0) <= now)
        .unwrap_or(false);
    if existing.is_none() {
        tx.execute(
            "INSERT INTO activities (activity_id, name, starts_at, ends_at, reservation_valid_secs,
                                     stock_buckets)
             VALUES ($1, $2, $3, $4, $5, $6)",
            &[
                &spec.activity_id,
                &spec.name,
                &spec.starts_at,
                &spec.ends_at,
                &spec.reservation_valid_secs,
                &spec.stock_buckets,
            ],
        )
        .await?;
    } else if !started {
        tx.execute(
            "UPDATE activities SET name = $2, starts_at = $3, ends_at = $4,
                    reservation_valid_secs = $5, updated_at = now()
             WHERE activity_id = $1",
            &[
                &spec.activity_id,
                &spec.name,
                &spec.starts_at,
                &spec.ends_at,
                &spec.reservation_valid_secs,
            ],
        )
        .await?;
    }
    Ok(started)
}

/// One SKU's row and its stock buckets: created, or its stock changed while none is taken and
/// the activity has not started.
async fn upsert_sku(
    tx: &tokio_postgres::Transaction<'_>,
    spec: &ActivitySpec,
    (sku_id, total, price): (i64, i32, i64),
    started: bool,
) -> Result<(), ActivityError> {
    let cur = tx
        .query_opt(
            "SELECT k.total_stock,
                    (SELECT sum(remaining_stock)::int4 FROM stock_buckets b
                     WHERE b.activity_id = k.activity_id AND b.sku_id = k.sku_id)
             FROM activity_skus k
             WHERE activity_id = $1 AND sku_id = $2 FOR UPDATE",
            &[&spec.activity_id, &sku_id],
        )
        .await?;
    match cur {
        None => {
            tx.execute(
                "INSERT INTO activity_skus (activity_id, sku_id, total_stock, price_cents)
                 VALUES ($1, $2, $3, $4)",
                &[&spec.activity_id, &sku_id, &total, &price],
            )
            .await?;
            split_stock(tx, spec, sku_id, total).await?;
        }
        Some(row) => {
            let (cur_total, cur_remaining): (i32, Option<i32>) = (row.get(0), row.get(1));
            let cur_remaining = cur_remaining.unwrap_or(0);
            if cur_total == total {
                return Ok(());
            }
            if started {
                return Err(ActivityError::StartedStockChange {
                    activity_id: spec.activity_id,
                    sku_id,
                    current: cur_total,
                    requested: total,
                });
            }
            if cur_remaining != cur_total {
                return Err(ActivityError::StockInUse {
                    activity_id: spec.activity_id,
                    sku_id,
                });
            }
            tx.execute(
                "UPDATE activity_skus SET total_stock = $3, price_cents = $4, updated_at = now()
                 WHERE activity_id = $1 AND sku_id = $2",
                &[&spec.activity_id, &sku_id, &total, &price],
            )
            .await?;
            tx.execute(
                "DELETE FROM stock_buckets WHERE activity_id = $1 AND sku_id = $2",
                &[&spec.activity_id, &sku_id],
            )
            .await?;
            split_stock(tx, spec, sku_id, total).await?;
        }
    }
    Ok(())
}

/// One stock row per bucket, each with its share of `total` (the split Redis uses too).
async fn split_stock(
    tx: &tokio_postgres::Transaction<'_>,
    spec: &ActivitySpec,
    sku_id: i64,
    total: i32,
) -> Result<(), tokio_postgres::Error> {
    let k = spec.stock_buckets.max(1) as u16;
    let buckets: Vec<i16> = (0..k).map(|b| b as i16).collect();
    let shares: Vec<i32> = (0..k)
        .map(|b| crate::domain::ids::bucket_share(i64::from(total), b, k) as i32)
        .collect();
    tx.execute(
        "INSERT INTO stock_buckets (activity_id, sku_id, bucket, total_stock, remaining_stock)
         SELECT $1, $2, b, s, s FROM unnest($3::int2[], $4::int4[]) AS t(b, s)",
        &[&spec.activity_id, &sku_id, &buckets, &shares],
    )
    .await?;
    Ok(())
}

/// An order as the buyer sees it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct OrderView {
    #[serde(flatten)]
    pub order: OrderRef,
    pub status: String,
    pub amount_cents: i64,
    pub version: i32,
    pub expires_at: DateTime<Utc>,
    pub created_at: DateTime<Utc>,
    pub paid_at: Option<DateTime<Utc>>,
    pub canceled_at: Option<DateTime<Utc>>,
    /// The sales channel the buyer reserved through (orders from a v2 message that named one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub channel: Option<String>,
}

const ORDER_COLUMNS: &str = "order_id, reservation_id, activity_id, sku_id, user_id, status,
    amount_cents, version, expires_at, created_at, paid_at, canceled_at, channel";

fn order_view(row: &tokio_postgres::Row) -> OrderView {
    OrderView {
        order: OrderRef {
            order_id: row.get(0),
            reservation_id: row.get(1),
            activity_id: row.get(2),
            sku_id: row.get(3),
            user_id: row.get(4),
        },
        status: row.get(5),
        amount_cents: row.get(6),
        version: row.get(7),
        expires_at: row.get(8),
        created_at: row.get(9),
        paid_at: row.get(10),
        canceled_at: row.get(11),
        channel: row.get(12),
    }
}

pub async fn order_by_id(
    client: &impl GenericClient,
    order_id: &str,
) -> Result<Option<OrderView>, tokio_postgres::Error> {
    let sql = format!("SELECT {ORDER_COLUMNS} FROM orders WHERE order_id = $1");
    Ok(client
        .query_opt(&sql, &[&order_id])
        .await?
        .as_ref()
        .map(order_view))
}

pub async fn order_by_reservation(
    client: &impl GenericClient,
    reservation_id: &str,
) -> Result<Option<OrderView>, tokio_postgres::Error> {
    let sql = format!("SELECT {ORDER_COLUMNS} FROM orders WHERE reservation_id = $1");
    Ok(client
        .query_opt(&sql, &[&reservation_id])
        .await?
        .as_ref()
        .map(order_view))
}

/// The consumer's decision for a reservation, once recorded.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ReservationDecision {
    pub reservation_id: String,
    pub order_id: String,
    pub activity_id: i64,
    pub sku_id: i64,
    pub user_id: i64,
    pub status: String,
    pub reject_reason: Option<String>,
    pub valid_until: DateTime<Utc>,
}

pub async fn reservation_decision(
    client: &impl GenericClient,
    reservation_id: &str,
) -> Result<Option<ReservationDecision>, tokio_postgres::Error> {
    Ok(client
        .query_opt(
            "SELECT reservation_id, order_id, activity_id, sku_id, user_id, status, reject_reason, valid_until
             FROM reservations WHERE reservation_id = $1",
            &[&reservation_id],
        )
        .await?
        .map(|row| ReservationDecision {
            reservation_id: row.get(0),
            order_id: row.get(1),
            activity_id: row.get(2),
            sku_id: row.get(3),
            user_id: row.get(4),
            status: row.get(5),
            reject_reason: row.get(6),
            valid_until: row.get(7),
        }))
}

/// Sets an activity's fair window (docs/architecture/hot-path.md#a-fair-start) and, the first time,
/// its seed; returns what the activity holds. The window of an activity that has started is
/// fixed: a different one is refused (`Ok(None)`).
pub async fn set_fair_window(
    client: &impl GenericClient,
    activity_id: i64,
    fair_window_ms: i32,
    seed: &str,
    now: DateTime<Utc>,
) -> Result<Option<(i32, String)>, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "UPDATE activities SET fair_window_ms = $2, fair_seed = COALESCE(fair_seed, $3),
                    updated_at = now()
             WHERE activity_id = $1 AND (starts_at > $4 OR fair_window_ms = $2)
             RETURNING fair_window_ms, fair_seed",
            &[&activity_id, &fair_window_ms, &seed, &now],
        )
        .await?;
    Ok(row.map(|r| (r.get(0), r.get(1))))
}

/// An activity's fair window and seed (`(0, None)`: first come first served).
pub async fn fair_window(
    client: &impl GenericClient,
    activity_id: i64,
) -> Result<Option<(i32, Option<String>)>, tokio_postgres::Error> {
    Ok(client
        .query_opt(
            "SELECT fair_window_ms, fair_seed FROM activities WHERE activity_id = $1",
            &[&activity_id],
        )
        .await?
        .map(|r| (r.get(0), r.get(1))))
}

/// `(starts_at, ends_at, reservation_valid_secs, [(sku_id, total_stock)])` of an activity.
/// `(starts_at, ends_at, reservation_valid_secs, [(sku_id, total_stock)], stock_buckets)`.
pub type ActivityRow = (DateTime<Utc>, DateTime<Utc>, i32, Vec<(i64, i32)>, i16);

pub async fn activity(
    client: &impl GenericClient,
    activity_id: i64,
) -> Result<Option<ActivityRow>, tokio_postgres::Error> {
    let Some(a) = client
        .query_opt(
            "SELECT starts_at, ends_at, reservation_valid_secs, stock_buckets FROM activities
             WHERE activity_id = $1",
            &[&activity_id],
        )
        .await?
    else {
        return Ok(None);
    };
    let skus = client
        .query(
            "SELECT sku_id, total_stock FROM activity_skus WHERE activity_id = $1 ORDER BY sku_id",
            &[&activity_id],
        )
        .await?
        .into_iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    Ok(Some((a.get(0), a.get(1), a.get(2), skus, a.get(3))))
}

/// Which of `message_ids` the group's inbox holds for the activity (the scanner's check that a
/// confirmed send reached the consumers).
pub async fn in_inbox(
    client: &impl GenericClient,
    activity_id: i64,
    consumer_group: &str,
    message_ids: &[String],
) -> Result<std::collections::HashSet<String>, tokio_postgres::Error> {
    Ok(client
        .query(
            "SELECT message_id FROM consumer_inbox_by_day
             WHERE activity_id = $1 AND consumer_group = $2 AND message_id = ANY($3)",
            &[&activity_id, &consumer_group, &message_ids],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// The SKU ids of an activity, in order (none: no such activity).
pub async fn activity_skus(
    client: &impl GenericClient,
    activity_id: i64,
) -> Result<Vec<i64>, tokio_postgres::Error> {
    Ok(client
        .query(
            "SELECT sku_id FROM activity_skus WHERE activity_id = $1 ORDER BY sku_id",
            &[&activity_id],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}
