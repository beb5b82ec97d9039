//! The fences of activities whose Redis state cannot be trusted (`redis_fences`,
//! docs/architecture/redis.md#when-redis-forgets), and what a rebuild reads of an activity: every
//! reservation PostgreSQL recorded.

use chrono::{DateTime, Utc};
use tokio_postgres::{Error, GenericClient};

/// One fence, open or closed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    pub fence_id: i64,
    pub activity_id: i64,
    pub signal: String,
    pub detail: String,
    pub detected_by: String,
    pub detected_at: DateTime<Utc>,
    pub drained_at: Option<DateTime<Utc>>,
}

const FENCE_COLUMNS: &str =
    "fence_id, activity_id, signal, detail, detected_by, detected_at, drained_at";

fn fence(r: &tokio_postgres::Row) -> Fence {
    Fence {
        fence_id: r.get(0),
        activity_id: r.get(1),
        signal: r.get(2),
        detail: r.get(3),
        detected_by: r.get(4),
        detected_at: r.get(5),
        drained_at: r.get(6),
    }
}

/// Opens a fence on the activity, or joins the one already open. Returns it and whether this
/// call opened it. `None` when PostgreSQL does not know the activity.
pub async fn open(
    client: &impl GenericClient,
    activity_id: i64,
    signal: &str,
    detail: &str,
    detected_by: &str,
) -> Result<Option<(Fence, bool)>, Error> {
    let inserted = client
        .query_opt(
            &format!(
                "INSERT INTO redis_fences (activity_id, signal, detail, detected_by)
                 SELECT $1, $2, $3, $4 WHERE EXISTS
                   (SELECT 1 FROM activities WHERE activity_id = $1)
                 ON CONFLICT (activity_id) WHERE resumed_at IS NULL DO NOTHING
                 RETURNING {FENCE_COLUMNS}"
            ),
            &[&activity_id, &signal, &detail, &detected_by],
        )
        .await?;
    if let Some(r) = inserted {
        return Ok(Some((fence(&r), true)));
    }
    Ok(open_of(client, activity_id).await?.map(|f| (f, false)))
}

/// The activity's open fence, if any.
pub async fn open_of(
    client: &impl GenericClient,
    activity_id: i64,
) -> Result<Option<Fence>, Error> {
    Ok(client
        .query_opt(
            &format!(
                "SELECT {FENCE_COLUMNS} FROM redis_fences
                 WHERE activity_id = $1 AND resumed_at IS NULL"
            ),
            &[&activity_id],
        )
        .await?
        .map(|r| fence(&r)))
}

/// Every open fence, oldest first.
pub async fn open_fences(client: &impl GenericClient) -> Result<Vec<Fence>, Error> {
    Ok(client
        .query(
            &format!(
                "SELECT {FENCE_COLUMNS} FROM redis_fences WHERE resumed_at IS NULL
                 ORDER BY fence_id"
            ),
            &[],
        )
        .await?
        .iter()
        .map(fence)
        .collect())
}

/// Every message sent before the fence is consumed.
pub async fn mark_drained(client: &impl GenericClient, fence_id: i64) -> Result<(), Error> {
    client
        .execute(
            "UPDATE redis_fences SET drained_at = coalesce(drained_at, now()) WHERE fence_id = $1",
            &[&fence_id],
        )
        .await
        .map(|_| ())
}

/// The rebuild ran (its figures in `rebuild`) and the fence is lifted, in one statement.
/// Returns the fence's length in seconds, detection to resumption.
pub async fn close(
    client: &impl GenericClient,
    fence_id: i64,
    rebuild: &serde_json::Value,
) -> Result<f64, Error> {
    let row = client
        .query_one(
            "UPDATE redis_fences
             SET drained_at = coalesce(drained_at, now()), rebuilt_at = now(),
                 resumed_at = now(), rebuild = $2
             WHERE fence_id = $1
             RETURNING extract(epoch FROM resumed_at - detected_at)::float8",
            &[&fence_id, rebuild],
        )
        .await?;
    Ok(row.get(0))
}

/// The activity's last fence id: its Redis epoch (0 when it never had one).
pub async fn epoch(client: &impl GenericClient, activity_id: i64) -> Result<i64, Error> {
    Ok(client
        .query_one(
            "SELECT coalesce(max(fence_id), 0) FROM redis_fences WHERE activity_id = $1",
            &[&activity_id],
        )
        .await?
        .get(0))
}

/// A reservation as PostgreSQL recorded it, and whether it still holds its unit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    pub reservation_id: String,
    pub message_id: String,
    pub request_id: String,
    pub order_id: String,
    pub sku_id: i64,
    pub user_id: i64,
    pub reserved_at_ms: i64,
    pub valid_until_ms: i64,
    /// A valid order, or a rejection or cancellation whose compensation has not released the
    /// unit in Redis yet.
    pub holds: bool,
    /// Holds only until its compensation runs (a rejection or a cancellation): the release
    /// may have run in Redis before PostgreSQL marked the compensation done.
    pub release_pending: bool,
    /// Why it does not hold (or will not, once released): the rejection's reason, the order's
    /// cancel reason.
    pub released_reason: Option<String>,
}

/// Every reservation of the activity PostgreSQL recorded.
pub async fn recorded(
    client: &impl GenericClient,
    activity_id: i64,
) -> Result<Vec<Recorded>, Error> {
    let rows = client
        .query(
            "SELECT r.reservation_id, r.message_id, r.request_id, r.order_id, r.sku_id, r.user_id,
                    (extract(epoch FROM r.reserved_at) * 1000)::int8,
                    (extract(epoch FROM r.valid_until) * 1000)::int8,
                    r.status = 'ORDERED' AND o.status IS DISTINCT FROM 'CANCELED',
                    t.status = 'PENDING',
                    coalesce(r.reject_reason, o.cancel_reason, o.status)
             FROM reservations r
             LEFT JOIN orders o ON o.reservation_id = r.reservation_id
             LEFT JOIN compensation_tasks t ON t.reservation_id = r.reservation_id
             WHERE r.activity_id = $1",
            &[&activity_id],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| {
            let by_order: bool = r.get(8);
            let pending = r.get::<_, Option<bool>>(9).unwrap_or(false);
            let release_pending = !by_order && pending;
            let holds = by_order || pending;
            Recorded {
                reservation_id: r.get(0),
                message_id: r.get(1),
                request_id: r.get(2),
                order_id: r.get(3),
                sku_id: r.get(4),
                user_id: r.get(5),
                reserved_at_ms: r.get(6),
                valid_until_ms: r.get(7),
                holds,
                release_pending,
                released_reason: if by_order { None } else { r.get(10) },
            }
        })
        .collect())
}
